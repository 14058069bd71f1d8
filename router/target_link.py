"""Calls to a target worker that survive its restart: a round waits for the target to come back
(bounded by ``recovery_timeout_s``). A call whose requests have KV caches on the target is never
replayed on a new process: a replay would rebuild every context in one forward, minutes and
gigabytes for long ones. It raises :class:`TargetRestarted` instead, and the scheduler makes those
requests cache their committed tokens again in chunks within the rounds' token budget, as prompts
are (docs/design.md, "Recovery"); the committed tokens did not change, so each request completes
unchanged (invariant 1). A batch that fails is verified item by item, so one bad item does not fail
the others; a round's prompt chunks ride in its Verify, and in a Prefill of their own when it fails."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import grpc

from router import clock
from router.config import RouterConfig
from router.jobs import Job
from router.workers import WorkerClient, WorkerUnavailable
from specdec.core.round_types import Draft
from specdec.rpc import generate_pb2, tracing, worker_pb2
from specdec.rpc.convert import add_verify_item
from specdec.rpc.errors import RpcStatusError

log = logging.getLogger(__name__)

__all__ = ["TargetLink", "TargetRestarted"]


class TargetRestarted(Exception):
    """The target is a new process since the call's requests were cached on it: their caches are gone."""


class TargetLink:
    def __init__(self, name: str, target: WorkerClient, config: RouterConfig):
        self.name = name
        self.target = target
        self.cfg = config
        self.down_since: float | None = None

    @property
    def process(self) -> int:
        """Which process of the target serves now (its restart count): what a cache belongs to."""
        return self.target.restarts

    async def _replayed(self, method: str, request, n: int, cached_on: int):
        """One call, waiting for the target to come back if it is down; (response, the worker's
        compute seconds if reported). ``cached_on``: the :attr:`process` holding the caches the call
        builds on; if another serves by the time the call goes out, TargetRestarted."""
        t_end = clock.now() + self.cfg.recovery_timeout_s
        replay = None  # a "replay" span (router/traces.py) from the first failure on, while tracing
        error: BaseException | None = None
        try:
            while True:
                try:
                    await self.target.wait_up(max(0.1, t_end - clock.now()))
                    self.down_since = None
                    async with self.target.lock:
                        if self.process != cached_on:
                            raise TargetRestarted(f"target {self.name} restarted: its KV caches are gone")
                        resp, compute = await self.target.call_timed(method, request, timeout=self.cfg.rpc_timeout_s)
                    if len(resp.outcomes) != n:
                        raise RpcStatusError(grpc.StatusCode.INTERNAL, "the target answered the wrong number of items")
                    return resp, compute
                except WorkerUnavailable:
                    if self.down_since is None:
                        self.down_since = clock.now()
                    if clock.now() >= t_end:
                        raise
                    log.info("target %s unavailable; waiting for it to come back", self.name)
                    if replay is None:
                        replay = tracing.child("replay", {"specdec.worker": self.target.name, "rpc.method": method})
                    await asyncio.sleep(0.05)
        except BaseException as exc:
            error = exc
            raise
        finally:
            if replay is not None:  # a restart is no error of the wait: the requests are cached again
                replay.close(None if isinstance(error, TargetRestarted) else error)

    async def _verify_call(self, request, cached_on: int) -> tuple[list[worker_pb2.VerifyOutcome], float | None]:  # noqa: ANN001
        resp, compute = await self._replayed("Verify", request, len(request.items), cached_on)
        return list(resp.outcomes), compute

    async def prefill(self, seqs: Sequence[worker_pb2.Sequence], cached_on: int) -> None:
        """Cache all but the last token of each sequence (prompt chunks) on the target process
        ``cached_on`` (TargetRestarted if another serves)."""
        await self._replayed("Prefill", worker_pb2.PrefillRequest(sequences=seqs), len(seqs), cached_on)

    def encode(
        self, jobs: Sequence[Job], drafts: Sequence[Draft], prefill: Sequence[worker_pb2.Sequence] = ()
    ) -> worker_pb2.VerifyRequest:
        """A round's Verify request: each job's committed tokens (its whole context: the worker's
        cache is only a cache) and its draft, built into the request once, and the round's prompt
        chunks."""
        request = worker_pb2.VerifyRequest(prefill=prefill)
        for job, draft in zip(jobs, drafts):
            add_verify_item(request, job.key, job.state.tokens, job.params, job.mode, draft)
        return request

    async def verify(
        self,
        jobs: Sequence[Job],
        drafts: Sequence[Draft],
        cached_on: int,
        prefill: Sequence[worker_pb2.Sequence] = (),
    ) -> tuple[list, float | None, BaseException | None]:
        """Verify each job's draft, and cache the prompt chunks ``prefill`` in the same forward, on
        the target process ``cached_on`` (TargetRestarted if another serves): outcomes (or the
        exception failing that item) in order, the worker's compute time, and the exception that
        failed the chunks (None: cached). A call that fails is split: the chunks in a Prefill of
        their own, then the items."""
        request = self.encode(jobs, drafts, prefill)
        items = request.items
        try:
            outcomes, compute = await self._verify_call(request, cached_on)
            return outcomes, compute, None
        except WorkerUnavailable as exc:
            return [exc] * len(items), None, exc
        except grpc.aio.AioRpcError as exc:
            if len(items) == 1 and not prefill:
                return [RpcStatusError(exc.code(), exc.details() or "verification failed")], None, None
            log.warning("batch verify failed (%s: %s); verifying items one by one", exc.code().name, exc.details())
        chunks_failed = None
        if prefill:
            try:
                await self.prefill(prefill, cached_on)
            except WorkerUnavailable as exc:
                chunks_failed = exc
            except grpc.aio.AioRpcError as exc:
                chunks_failed = RpcStatusError(exc.code(), exc.details() or "the target refused a prompt chunk")
        out: list = []
        for item in items:  # isolate the bad item: the others keep being served
            try:
                out.extend((await self._verify_call(worker_pb2.VerifyRequest(items=[item]), cached_on))[0])
            except WorkerUnavailable as exc:
                out.append(exc)
            except grpc.aio.AioRpcError as exc:
                out.append(RpcStatusError(exc.code(), exc.details() or "verification failed"))
        return out, None, chunks_failed

    async def tokenize(
        self, text: str, chat: bool, timeout: float, messages: list[tuple[str, str]] | None = None
    ) -> list[int]:
        t_end = clock.now() + min(timeout, self.cfg.recovery_timeout_s)
        while True:
            try:
                await self.target.wait_up(max(0.1, t_end - clock.now()))
                turns = [generate_pb2.ChatMessage(role=r, content=c) for r, c in messages or ()]
                request = worker_pb2.TokenizeTextRequest(text=text, chat=chat, messages=turns)
                resp = await self.target.call("Tokenize", request, timeout=self.cfg.rpc_timeout_s)
                return list(resp.token_ids)
            except WorkerUnavailable:
                if clock.now() >= t_end:
                    raise
                await asyncio.sleep(0.05)
