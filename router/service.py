"""The public ``specdec.v1.Generation`` servicer (grpc.aio): Generate, GenerateStream, ListModels, Tokenize.

Each call is checked in order of cost (router.validate): the request id, the model (NOT_FOUND),
every bound that needs no tokenizer, then room in the queue of the scheduler router/target_choice.py picks
(RESOURCE_EXHAUSTED with a queue-drain RetryInfo). Only then is text tokenized, by the target
worker (another process: the router's loop keeps admitting other requests meanwhile), checked
against the context and submitted. The handler then relays the job's committed chunks. When the
client cancels or its deadline passes, gRPC cancels the handler and the job is dropped, which
releases its KV slots on both workers. Every call ends with one access-log line.
"""

from __future__ import annotations

import asyncio
import logging
import math
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, Protocol

import grpc

from router import clock
from router.access_log import AccessRecord
from router.client_limit import client_key
from router.config import RouterConfig
from router.metrics import Metrics
from router.retry import DrainEstimate, worker_recovery_estimate
from router.scheduler import Chunk, Job, TargetScheduler
from router.traces import end_request, start_request, traced_job
from router.validate import Limits, PromptInput, check_request_id, finalize, parse, parse_prompt
from router.workers import WorkerUnavailable
from specdec.rpc import generate_pb2, generate_pb2_grpc, tracing
from specdec.rpc.convert import check_token_ids
from specdec.rpc.errors import RpcStatusError, abort_with_async, rich_status_for

log = logging.getLogger(__name__)

__all__ = ["GenerationService", "SERVICE_NAME"]

SERVICE_NAME = generate_pb2.DESCRIPTOR.services_by_name["Generation"].full_name

_OUTCOME = {
    grpc.StatusCode.INVALID_ARGUMENT: "invalid_argument",
    grpc.StatusCode.NOT_FOUND: "not_found",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "resource_exhausted",
    grpc.StatusCode.UNAVAILABLE: "unavailable",
    grpc.StatusCode.DEADLINE_EXCEEDED: "deadline_exceeded",
}


def stats_proto(job: Job) -> generate_pb2.SpeculationStats:
    s = job.state.stats
    return generate_pb2.SpeculationStats(
        rounds=s.rounds,
        drafted=s.drafted,
        accepted=s.accepted,
        acceptance_rate=s.acceptance_rate,
        accepted_per_position=list(s.accepted_per_position),
        fail_open_rounds=s.fail_open_rounds,
        drafted_per_position=list(s.drafted_per_position),
    )


def usage_proto(job: Job) -> generate_pb2.Usage:
    return generate_pb2.Usage(prompt_tokens=len(job.state.prompt_ids), completion_tokens=len(job.state.generated))


class Schedulers(Protocol):
    """What the servicer needs of the router (router.server.Router provides it)."""

    config: RouterConfig
    metrics: Metrics

    def schedulers_for(self, model: str) -> list[TargetScheduler]: ...

    def pick(self, model: str) -> TargetScheduler: ...

    def list_models(self) -> generate_pb2.ListModelsResponse: ...


@dataclass
class _Call:
    """One call being served: its access-log record, its span while tracing (router/traces.py),
    and once picked, its scheduler and job."""

    rec: AccessRecord
    span: Any = None
    sched: TargetScheduler | None = None
    job: Job | None = None

    def end(self) -> None:
        self.rec.emit()
        end_request(self.span, self.rec, self.job)


class GenerationService(generate_pb2_grpc.GenerationServicer):
    def __init__(self, router: Schedulers):
        self.router = router
        self._drain: dict[TargetScheduler, DrainEstimate] = {}

    # ---- the shared path -----------------------------------------------------------------------
    def _limits(self, model: str, rec: AccessRecord) -> Limits:
        sched = self.router.schedulers_for(model)[0]
        rec.model = sched.name
        return Limits.for_model(sched.max_context, self.router.config.max_prompt_bytes)

    async def _prompt_ids(self, sched: TargetScheduler, prompt: PromptInput, timeout: float | None) -> list[int]:
        if prompt.prompt_ids is not None:
            return prompt.prompt_ids
        limit = math.inf if timeout is None else timeout
        return await sched.tokenize(prompt.prompt or "", prompt.chat, timeout=limit, messages=prompt.messages)

    async def _submit(self, request: generate_pb2.GenerateRequest, context, call: _Call) -> Job:
        rec = call.rec
        check_request_id(request.request_id)
        rec.request_id = request.request_id
        parsed = parse(request, self._limits(request.model, rec))
        sched = call.sched = self.router.pick(parsed.model)
        sched.check_room()  # a full queue refuses before the prompt is tokenized
        remaining = context.time_remaining()
        deadline = rec.t_start + remaining if remaining is not None else None
        prompt = PromptInput(parsed.prompt, parsed.prompt_ids, parsed.chat, parsed.messages)
        with tracing.current(call.span):  # the target's Tokenize span joins the request's trace
            prompt_ids = await self._prompt_ids(sched, prompt, remaining)
        rec.prompt_tokens = len(prompt_ids)
        params, mode = finalize(
            parsed,
            prompt_ids,
            vocab_size=sched.vocab_size,
            max_context=sched.max_context,
            default_max_tokens=self.router.config.default_max_tokens,
        )
        request_id = rec.request_id = request.request_id or f"req-{uuid.uuid4().hex[:16]}"
        job = sched.new_job(request_id, prompt_ids, params, mode, parsed.spec_mode, parsed.k, deadline)
        job.t_arrival = rec.t_start
        job.client = client_key(context.invocation_metadata(), context.peer())  # as the per-client limit counts
        call.job = job
        traced_job(call.span, job)
        sched.submit(job)
        return job

    def _with_retry(self, exc: BaseException, sched: TargetScheduler | None) -> BaseException:
        """Worker failures as statuses, with the RetryInfo delay the router can estimate."""
        if isinstance(exc, WorkerUnavailable):
            exc = RpcStatusError(grpc.StatusCode.UNAVAILABLE, f"no worker available: {exc}")
        elif isinstance(exc, grpc.aio.AioRpcError):  # a worker refused (e.g. Tokenize with chat)
            exc = RpcStatusError(exc.code(), exc.details() or exc.code().name)
        if isinstance(exc, RpcStatusError) and exc.retry_after is None and sched is not None:
            if exc.code is grpc.StatusCode.RESOURCE_EXHAUSTED:
                exc.retry_after = self._drain.setdefault(sched, DrainEstimate()).seconds(len(sched.waiting))
            elif exc.code is grpc.StatusCode.UNAVAILABLE:
                exc.retry_after = worker_recovery_estimate(sched.target)
        return exc

    async def _abort(self, context, exc: BaseException, call: _Call, count: bool = True) -> None:
        """Answer with the status for ``exc`` (raises); ``count``: record the outcome in the metrics
        (the scheduler already did for jobs it failed)."""
        exc = self._with_retry(exc, call.sched)
        code = rich_status_for(exc).code
        call.rec.status = code.name
        if count:
            self.router.metrics.requests.labels(_OUTCOME.get(code, "error"), call.rec.model or "").inc()
        await abort_with_async(context, exc, where=call.rec.rpc)

    async def _chunks(self, request, context, call: _Call) -> AsyncIterator[tuple[Job, Chunk]]:
        rec = call.rec
        try:
            job = await self._submit(request, context, call)
        except Exception as exc:  # noqa: BLE001 - the edge: every error becomes a status
            await self._abort(context, exc, call)
            return
        sched = call.sched
        try:
            while True:
                event = await job.events.get()
                if isinstance(event, BaseException):
                    await self._abort(context, event, call, count=False)
                    return
                rec.completion_tokens = len(job.state.generated)
                rec.t_first = job.t_first
                yield job, event
                if event.finish_reason is not None:
                    rec.finish_reason = event.finish_reason
                    return
        finally:
            if not job.done:  # the client cancelled or its deadline passed
                late = job.deadline is not None and clock.now() >= job.deadline - 0.01
                rec.status = "DEADLINE_EXCEEDED" if late else "CANCELLED"
                sched.cancel(job, "deadline" if late else "cancelled")
            rec.acceptance_rate = job.state.stats.acceptance_rate if job.state.stats.drafted else None
            rec.completion_tokens = len(job.state.generated)
            self._drain.setdefault(sched, DrainEstimate()).finished()

    def refused(self, method: str, peer: str, error: RpcStatusError) -> None:
        """A request that did not decode (specdec.rpc.decode_guard): count it and log its access line."""
        self.router.metrics.requests.labels("invalid_argument", "").inc()  # the model is unknown
        AccessRecord(method.rsplit("/", 1)[-1], peer, status=error.code.name).emit()

    def _turned_away(self, method: str, peer: str, code: grpc.StatusCode, outcome: str) -> None:
        rpc = method.rsplit("/", 1)[-1]
        if rpc in ("Generate", "GenerateStream"):
            self.router.metrics.requests.labels(outcome, "").inc()  # turned away before its request was read
        AccessRecord(rpc, peer, status=code.name).emit()

    def denied(self, method: str, peer: str) -> None:
        """A call without a valid token (specdec.rpc.auth): counted, with its access line."""
        self._turned_away(method, peer, grpc.StatusCode.UNAUTHENTICATED, "unauthenticated")

    def limited(self, method: str, peer: str) -> None:
        """A call beyond its client's limit (router.client_limit): counted, with its access line."""
        self._turned_away(method, peer, grpc.StatusCode.RESOURCE_EXHAUSTED, "resource_exhausted")

    # ---- RPCs ----------------------------------------------------------------------------------
    async def Generate(self, request: generate_pb2.GenerateRequest, context) -> generate_pb2.GenerateResponse:
        call = _Call(AccessRecord("Generate", context.peer()), start_request(SERVICE_NAME, "Generate", context))
        token_ids: list[int] = []
        text: list[str] = []
        job = last = None
        try:
            async for chunk_job, chunk in self._chunks(request, context, call):
                token_ids.extend(chunk.token_ids)
                text.append(chunk.text)
                job, last = chunk_job, chunk
        finally:
            call.end()
        if job is None or last is None:  # aborted (the abort raised inside the generator)
            return generate_pb2.GenerateResponse()
        return generate_pb2.GenerateResponse(
            request_id=job.request_id,
            text="".join(text),
            token_ids=token_ids,
            finish_reason=last.finish_reason,
            usage=usage_proto(job),
            speculation=stats_proto(job),
        )

    async def GenerateStream(self, request: generate_pb2.GenerateRequest, context) -> None:
        call = _Call(
            AccessRecord("GenerateStream", context.peer()), start_request(SERVICE_NAME, "GenerateStream", context)
        )
        bound = self.router.config.stream_write_timeout_s
        stopped_reading = False
        # aclosing: a client that goes away, or stops reading, closes this generator; the chunks'
        # cleanup (cancel the job, status CANCELLED) must run before the access line is written.
        try:
            async with aclosing(self._chunks(request, context, call)) as chunks:
                async for job, chunk in chunks:
                    msg = generate_pb2.GenerateChunk(
                        request_id=job.request_id, text=chunk.text, token_ids=chunk.token_ids
                    )
                    if chunk.finish_reason is not None:
                        msg.finish_reason = chunk.finish_reason
                        msg.usage.CopyFrom(usage_proto(job))
                        msg.speculation.CopyFrom(stats_proto(job))
                    try:
                        # A write waits while the client's flow-control window is full: a client
                        # that stopped reading holds its slots only this long (docs/design.md, "API").
                        async with asyncio.timeout(bound):  # a timer, no task per chunk
                            await context.write(msg)
                    except TimeoutError:
                        stopped_reading, call.rec.status = True, "CANCELLED"
                        break
                    except asyncio.CancelledError:  # the client left before this chunk reached it
                        call.rec.status = "CANCELLED"
                        raise
        finally:
            call.end()
        if stopped_reading:  # the job was cancelled, and counted, as the chunks closed
            try:  # the status goes out behind the unread chunks: this waits until the client reads or leaves
                await context.abort(
                    grpc.StatusCode.CANCELLED,
                    f"the client took no part of a stream chunk for {bound:g} s (router.stream_write_timeout_s): "
                    "the call was ended and its KV slots freed",
                )
            except grpc.aio.AbortError:
                raise
            except Exception:  # noqa: BLE001 - it left first: nobody to tell, and no traceback to log
                return

    async def ListModels(self, request, context) -> generate_pb2.ListModelsResponse:
        return self.router.list_models()

    async def Tokenize(self, request: generate_pb2.TokenizeRequest, context) -> generate_pb2.TokenizeResponse:
        call = _Call(AccessRecord("Tokenize", context.peer()))
        try:
            prompt = parse_prompt(request, self._limits(request.model, call.rec))
            sched = call.sched = self.router.pick(request.model)
            if prompt.prompt_ids is not None:
                check_token_ids(prompt.prompt_ids, sched.vocab_size, "prompt_token_ids")
            ids = await self._prompt_ids(sched, prompt, context.time_remaining())
            call.rec.prompt_tokens = len(ids)
            return generate_pb2.TokenizeResponse(token_ids=ids, count=len(ids))
        except Exception as exc:  # noqa: BLE001 - the edge: every error becomes a status
            await self._abort(context, exc, call, count=False)  # not a generation request: not counted
        finally:
            call.rec.emit()
