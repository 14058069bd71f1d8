"""The public ``specdec.v1.Generation`` servicer (grpc.aio): Generate, GenerateStream, ListModels.

Each call is validated (INVALID_ARGUMENT naming the field), tokenized by the target worker when it
is text, and submitted to the least-loaded scheduler of its model (RESOURCE_EXHAUSTED when its
queue is full). The handler then relays the job's committed chunks. When the client cancels or
its deadline passes, gRPC cancels the handler and the job is dropped, which releases its KV
slots on both workers.
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from collections.abc import AsyncIterator
from typing import Protocol

import grpc

from router.config import RouterConfig
from router.metrics import Metrics
from router.scheduler import Chunk, Job, TargetScheduler
from router.validate import finalize, parse
from router.workers import WorkerUnavailable
from specdec.core.params import InvalidParams
from specdec.rpc import generate_pb2, generate_pb2_grpc
from specdec.rpc.errors import RpcStatusError, abort_with_async

log = logging.getLogger(__name__)

__all__ = ["GenerationService", "SERVICE_NAME"]

SERVICE_NAME = generate_pb2.DESCRIPTOR.services_by_name["Generation"].full_name

_OUTCOME = {
    grpc.StatusCode.INVALID_ARGUMENT: "invalid_argument",
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

    def pick(self, model: str) -> TargetScheduler: ...

    def list_models(self) -> generate_pb2.ListModelsResponse: ...


class GenerationService(generate_pb2_grpc.GenerationServicer):
    def __init__(self, router: Schedulers):
        self.router = router

    # ---- the shared path -----------------------------------------------------------------------
    async def _submit(self, request: generate_pb2.GenerateRequest, context) -> tuple[TargetScheduler, Job]:
        t_arrival = time.monotonic()
        parsed = parse(request)
        sched = self.router.pick(parsed.model)
        remaining = context.time_remaining()
        deadline = t_arrival + remaining if remaining is not None else None
        if parsed.prompt_ids is None:
            prompt_ids = await sched.tokenize(
                parsed.prompt, parsed.chat, timeout=remaining if remaining is not None else math.inf
            )
        else:
            prompt_ids = parsed.prompt_ids
        params, mode = finalize(
            parsed,
            prompt_ids,
            vocab_size=sched.vocab_size,
            max_context=sched.max_context,
            default_max_tokens=self.router.config.default_max_tokens,
        )
        request_id = request.request_id or f"req-{uuid.uuid4().hex[:16]}"
        job = sched.new_job(request_id, prompt_ids, params, mode, parsed.spec_mode, parsed.k, deadline)
        job.t_arrival = t_arrival
        sched.submit(job)
        return sched, job

    async def _abort(self, context, exc: BaseException, where: str, count: bool = True) -> None:
        """Answer with the status for ``exc`` (raises); ``count``: record the outcome in the metrics
        (the scheduler already did for jobs it failed)."""
        if isinstance(exc, WorkerUnavailable):
            exc = RpcStatusError(grpc.StatusCode.UNAVAILABLE, f"no worker available: {exc}")
        elif isinstance(exc, grpc.aio.AioRpcError):  # a worker refused (e.g. Tokenize with chat)
            exc = RpcStatusError(exc.code(), exc.details() or exc.code().name)
        if count:
            if isinstance(exc, InvalidParams):
                code = grpc.StatusCode.INVALID_ARGUMENT
            elif isinstance(exc, RpcStatusError):
                code = exc.code
            else:
                code = grpc.StatusCode.INTERNAL
            self.router.metrics.requests.labels(_OUTCOME.get(code, "error")).inc()
        await abort_with_async(context, exc, where=where)

    async def _chunks(self, request, context, where: str) -> AsyncIterator[tuple[Job, Chunk]]:
        try:
            sched, job = await self._submit(request, context)
        except Exception as exc:  # noqa: BLE001 - the edge: every error becomes a status
            await self._abort(context, exc, where)
            return
        try:
            while True:
                event = await job.events.get()
                if isinstance(event, BaseException):
                    await self._abort(context, event, where, count=False)
                    return
                yield job, event
                if event.finish_reason is not None:
                    return
        finally:
            if not job.done:  # the client cancelled or its deadline passed
                late = job.deadline is not None and time.monotonic() >= job.deadline - 0.01
                sched.cancel(job, "deadline" if late else "cancelled")

    # ---- RPCs ----------------------------------------------------------------------------------
    async def Generate(self, request: generate_pb2.GenerateRequest, context) -> generate_pb2.GenerateResponse:
        token_ids: list[int] = []
        text: list[str] = []
        job = last = None
        async for chunk_job, chunk in self._chunks(request, context, "Generate"):
            token_ids.extend(chunk.token_ids)
            text.append(chunk.text)
            job, last = chunk_job, chunk
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

    async def GenerateStream(self, request: generate_pb2.GenerateRequest, context):
        async for job, chunk in self._chunks(request, context, "GenerateStream"):
            msg = generate_pb2.GenerateChunk(request_id=job.request_id, text=chunk.text, token_ids=chunk.token_ids)
            if chunk.finish_reason is not None:
                msg.finish_reason = chunk.finish_reason
                msg.usage.CopyFrom(usage_proto(job))
                msg.speculation.CopyFrom(stats_proto(job))
            yield msg

    async def ListModels(self, request, context) -> generate_pb2.ListModelsResponse:
        return self.router.list_models()
