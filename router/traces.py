"""The router's spans (docs/design.md, Telemetry): one per ``Generate`` / ``GenerateStream`` call
and, in its trace, one per round the request takes part in, with the round's phases. Nothing here
runs while tracing is off (:data:`specdec.rpc.tracing.active`): a request or a round then costs
one check, and the round gets the shared do-nothing :data:`OFF`.

A request's trace::

    (POST /v1/completions)                    over HTTP, the gateway's SERVER span above (gateway/http_spans.py)
    specdec.v1.Generation/Generate            SERVER; child of the caller's traceparent (or the gateway's)
    ├── specdec.v1.TargetService/Tokenize     the target worker's span (text prompts)
    ├── prefill                               a round that cached a chunk of its prompt (not the last)
    │   ├── specdec.v1.TargetService/Verify   the round's call, where no request of it verifies
    │   └── specdec.v1.DraftService/Prefill
    └── round                                 one per round that verified it: SpeculationStats.rounds
                                              (specdec.prefill.tokens: the prompt tokens its row cached first)
        ├── draft_wait                        the round waiting for its drafts
        │   └── specdec.v1.DraftService/Propose
        ├── verify
        │   ├── specdec.v1.TargetService/Verify
        │   └── replay                        the target did not answer: the wait for it, and the call
        │       └── specdec.v1.TargetService/Verify    again if the same process came back (a new one: the
        │                                              tokens are cached again in the prefill spans that follow)
        └── specdec.v1.DraftService/Propose   the next round's pre-draft, made while this one verifies

The phases are named as the round's phases in ``specdec_round_phase_seconds``. A round serves a
batch of requests with one call per worker, and a call carries one ``traceparent``: the first
traced request of the batch (the lead) parents the workers' spans, and every other request's phase
span links to the lead's, so each trace still reaches the worker's.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager, ExitStack, nullcontext
from typing import Any

import grpc
from opentelemetry import trace

from router.access_log import AccessRecord
from router.jobs import Job
from specdec.rpc import tracing

__all__ = ["OFF", "RoundTrace", "end_request", "round_trace", "start_request", "traced_job"]


def start_request(service: str, rpc: str, context: Any) -> Any:
    """The span of one public call (None while tracing is off), child of the caller's context."""
    if not tracing.active:
        return None
    parent = tracing.incoming(context.invocation_metadata())
    attributes = {"rpc.system": "grpc", "rpc.service": service, "rpc.method": rpc}
    return tracing.tracer().start_span(
        f"{service}/{rpc}", context=parent, kind=trace.SpanKind.SERVER, attributes=attributes
    )


def traced_job(span: Any, job: Job) -> None:
    """Attach the call's span to its job (the rounds' parent) and record how the job speculates."""
    if span is None:
        return
    job.span = span
    span.set_attribute("specdec.request_id", job.request_id)
    span.set_attribute("specdec.speculation.mode", ("auto:" if job.auto else "") + job.spec)
    span.set_attribute("specdec.verify.mode", job.mode.value)


def end_request(span: Any, rec: AccessRecord, job: Job | None) -> None:
    """End a call's span with what its access line says (model, tokens, finish reason, status)."""
    if span is None:
        return
    code = getattr(grpc.StatusCode, rec.status, grpc.StatusCode.UNKNOWN)
    span.set_attribute("gen_ai.request.model", rec.model)
    span.set_attribute("gen_ai.usage.input_tokens", rec.prompt_tokens)
    span.set_attribute("gen_ai.usage.output_tokens", rec.completion_tokens)
    if rec.finish_reason:
        span.set_attribute("gen_ai.response.finish_reasons", [rec.finish_reason])
    span.set_attribute("rpc.grpc.status_code", code.value[0])
    if job is not None:
        span.set_attribute("specdec.rounds", job.state.stats.rounds)
        span.set_attribute("specdec.draft_tokens.accepted", job.state.stats.accepted)
        span.set_attribute("specdec.draft_tokens.proposed", job.state.stats.drafted)
    if code is not grpc.StatusCode.OK:
        span.set_status(trace.Status(trace.StatusCode.ERROR, rec.status))
    span.end()


class RoundTrace:
    """One round's spans (``name``: ``round`` or ``prefill``) in each traced job's trace. Used as a
    context manager: inside, the lead's span is current, so the calls the round starts carry it."""

    def __init__(self, jobs: Sequence[Job], name: str):
        tracer = tracing.tracer()
        self.jobs = [j for j in jobs if j.span is not None]
        attributes = {"specdec.batch_size": len(jobs)}
        self.spans = [
            tracer.start_span(name, context=trace.set_span_in_context(j.span), attributes=attributes) for j in self.jobs
        ]
        self._stack = ExitStack()

    def __enter__(self) -> RoundTrace:
        if self.spans:
            self._stack.enter_context(trace.use_span(self.spans[0], end_on_exit=False))
        return self

    def __exit__(self, kind, exc, tb) -> None:
        self._stack.close()
        for span in self.spans:
            if exc is not None:
                span.set_status(trace.Status(trace.StatusCode.ERROR, f"{kind.__name__}: {exc}"))
            span.end()

    def phase(self, name: str) -> AbstractContextManager:
        """A ``name`` span under each job's span for the block; the lead's is current inside it."""
        if not self.spans:
            return nullcontext()
        tracer = tracing.tracer()
        lead = tracer.start_span(name, context=trace.set_span_in_context(self.spans[0]))
        links = [trace.Link(lead.get_span_context())]
        others = [tracer.start_span(name, context=trace.set_span_in_context(s), links=links) for s in self.spans[1:]]
        return _Phase(lead, others)

    def restarted(self) -> None:
        """The round ended without a verdict: the target restarted, and its jobs' tokens are
        cached again in the rounds that follow (not a round of ``SpeculationStats.rounds``)."""
        for span in self.spans:
            span.set_attribute("specdec.target_restarted", True)

    def prefilled(self, chunked: Sequence[tuple[Job, int]]) -> None:
        """The prompt tokens each job's verify row caches ahead of its first verdict (its prompt's
        last chunk, or all of a short one) on its round span."""
        spans = dict(zip(map(id, self.jobs), self.spans))
        for job, tokens in chunked:
            if (span := spans.get(id(job))) is not None:
                span.set_attribute("specdec.prefill.tokens", tokens)

    def outcomes(self, batch: Sequence[Job], drafts: Sequence[Any], outcomes: Sequence[Any]) -> None:
        """Each job's draft length and accepted tokens (or its failure) on its round span."""
        spans = dict(zip(map(id, self.jobs), self.spans))
        for job, draft, out in zip(batch, drafts, outcomes):
            span = spans.get(id(job))
            if span is None:
                continue
            span.set_attribute("specdec.k", len(draft.tokens))
            if isinstance(out, BaseException):
                span.set_status(trace.Status(trace.StatusCode.ERROR, f"{type(out).__name__}: {out}"))
            else:
                span.set_attribute("specdec.accepted", int(out.num_accepted))


class _Phase:
    def __init__(self, lead: Any, others: list[Any]):
        self.lead, self.others = lead, others
        self._use = trace.use_span(lead, end_on_exit=True)

    def __enter__(self) -> None:
        self._use.__enter__()

    def __exit__(self, kind, exc, tb) -> None:
        self._use.__exit__(kind, exc, tb)  # ends the lead's span, with the error if any
        for span in self.others:
            if exc is not None:
                span.set_status(trace.Status(trace.StatusCode.ERROR, f"{kind.__name__}: {exc}"))
            span.end()


class _Off:
    """The round of an untraced process: every method does nothing."""

    def __enter__(self) -> _Off:
        return self

    def __exit__(self, *exc) -> None:
        return None

    def phase(self, name: str) -> AbstractContextManager:
        return _NULL

    def outcomes(self, batch, drafts, outcomes) -> None:
        return None

    def prefilled(self, chunked) -> None:
        return None

    def restarted(self) -> None:
        return None


OFF = _Off()
_NULL = nullcontext()


def round_trace(jobs: Sequence[Job], name: str = "round") -> RoundTrace | _Off:
    """:class:`RoundTrace` for ``jobs``, or :data:`OFF` while tracing is off."""
    return RoundTrace(jobs, name) if tracing.active else OFF
