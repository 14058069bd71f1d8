"""Where a round's drafts come from: the draft worker (with pre-drafting), the local n-gram drafter,
or nothing; and failing open when a draft is late or its worker is gone (DESIGN.md invariant 4).

Pre-drafting: the drafter drafts round r+1 of a micro-batch while the target verifies round r, on
the guess that all of round r's draft is accepted and the target's bonus token is the drafter's own
next token; the pre-draft is used when the guess proves right and discarded otherwise (PEARL-style).
Drafts have a deadline (:meth:`DraftSource.deadline`); a Propose that missed it is let finish (it
builds the drafter's cache) while the next rounds fail open instead of queueing behind it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

import grpc

from router.config import RouterConfig
from router.jobs import Job, PreDraft
from router.metrics import Metrics
from router.policy import draft_deadline, predraft_k
from router.workers import WorkerClient, WorkerUnavailable
from specdec.core.ngram import NgramDrafter
from specdec.core.params import VerifyMode
from specdec.core.round_types import Draft
from specdec.rpc import worker_pb2
from specdec.rpc.convert import draft_from_proto, sequence_to_proto

log = logging.getLogger(__name__)

__all__ = ["DraftSource"]


class DraftSource:
    """Drafts for one target scheduler's rounds."""

    def __init__(
        self,
        draft: WorkerClient | None,
        config: RouterConfig,
        metrics: Metrics,
        vocab_size: int,
        max_context: int,
        spawn: Callable[[Coroutine[Any, Any, Any]], asyncio.Task],
    ):
        self.draft = draft
        self.cfg = config
        self.metrics = metrics
        self.vocab_size = vocab_size
        self.max_context = max_context
        self.spawn = spawn
        self.ngram = NgramDrafter(max_ngram=config.ngram_max, min_ngram=config.ngram_min)
        self._late: asyncio.Task | None = None  # a Propose that missed its deadline, still running
        self.verify_ema: float | None = None  # recent Verify wall time (s), for the draft deadline

    def observe_verify(self, seconds: float) -> None:
        self.verify_ema = seconds if self.verify_ema is None else 0.8 * self.verify_ema + 0.2 * seconds

    def fail_open(self, job: Job, reason: str) -> None:
        job.state.stats.fail_open_rounds += 1
        self.metrics.fail_open.labels(reason).inc()

    async def propose(self, seqs: list[worker_pb2.Sequence], started: list | None = None) -> list[worker_pb2.Draft]:
        assert self.draft is not None
        async with self.draft.lock:
            if started is not None:
                started.append(True)  # the call reaches the worker now (before: only queued here)
            resp = await self.draft.call(
                "Propose", worker_pb2.ProposeRequest(sequences=seqs), timeout=self.cfg.rpc_timeout_s
            )
        if len(resp.drafts) != len(seqs):
            raise WorkerUnavailable(f"draft worker answered {len(resp.drafts)} drafts for {len(seqs)} sequences")
        return list(resp.drafts)

    def decode_draft(self, m: worker_pb2.Draft, k: int, offset: int = 0) -> Draft | None:
        try:
            d = draft_from_proto(m, self.vocab_size)
        except Exception as exc:  # noqa: BLE001 - a bad draft fails open
            log.warning("discarding a bad draft: %s", exc)
            return None
        tokens = d.tokens[offset : offset + k]
        probs = d.probs[offset : offset + k] if d.probs is not None else None
        return Draft(tokens=tokens, probs=probs)

    async def drafts(self, batch: list[Job], ks: list[int]) -> tuple[list[Draft], float]:
        drafts = [Draft(tokens=[]) for _ in batch]
        remote: list[int] = []  # indices needing a Propose
        pending: list[tuple[int, PreDraft]] = []  # indices with a pre-draft that may still be right
        for i, (job, k) in enumerate(zip(batch, ks)):
            pd, job.predraft = job.predraft, None
            if k <= 0:
                continue
            if job.spec == "ngram":
                d = self.ngram.propose_one(job.state.tokens, k)
                if job.mode is not VerifyMode.REJECTION:
                    d.probs = None
                drafts[i] = d
            elif job.spec == "draft":
                if self.draft is None or not self.draft.up:
                    self.fail_open(job, "unavailable")
                    continue
                toks = job.state.tokens
                if pd is not None and len(toks) == pd.base + 1 and toks[pd.base - len(pd.draft) : pd.base] == pd.draft:
                    pending.append((i, pd))
                else:
                    if pd is not None:
                        self.metrics.predraft.labels("miss").inc()
                    remote.append(i)
        if not remote and not pending:
            return drafts, 0.0
        t0 = time.monotonic()
        t_end = t0 + self.deadline(max(ks))
        # Pre-drafts first: they are already running on the drafter.
        for i, pd in pending:
            job, k = batch[i], ks[i]
            try:
                res = await asyncio.wait_for(asyncio.shield(pd.task), max(0.0, t_end - time.monotonic()))
                d = self.decode_draft(res[pd.index], k + 1)
            except TimeoutError:
                self._late = pd.task
                d = None
            except (WorkerUnavailable, grpc.aio.AioRpcError):
                d = None
            if d is not None and len(d.tokens) >= 2 and d.tokens[0] == job.state.tokens[-1]:
                drafts[i] = Draft(tokens=d.tokens[1:], probs=d.probs[1:] if d.probs is not None else None)
                self.metrics.predraft.labels("hit").inc()
            else:
                self.metrics.predraft.labels("miss").inc()
                remote.append(i)
        if remote:
            seqs = [
                sequence_to_proto(batch[i].key, batch[i].state.tokens, batch[i].params, batch[i].mode, ks[i])
                for i in remote
            ]
            reason = None
            if self._late is not None and not self._late.done():
                # The drafter is still computing a draft that came too late; a new Propose would
                # queue behind it. Fail open now, speculate again once it has caught up.
                reason = "deadline"
            else:
                started: list = []
                task = self.spawn(self.propose(seqs, started))
                task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved: no warning
                try:
                    res = await asyncio.wait_for(asyncio.shield(task), max(0.0, t_end - time.monotonic()))
                except TimeoutError:
                    reason = "deadline"
                    if started:
                        self._late = task  # let it finish (it builds the drafter's cache), results unused
                    else:
                        task.cancel()  # still queued behind another draft: never send it
                except (WorkerUnavailable, grpc.aio.AioRpcError) as exc:
                    log.info("draft worker failed, failing open: %s", exc)
                    reason = "unavailable"
            for i in remote:
                batch[i].used_draft = True  # the drafter may hold a cache slot for it now
            for n, i in enumerate(remote):
                d = self.decode_draft(res[n], ks[i]) if reason is None else None
                if d is None:
                    self.fail_open(batch[i], reason or "unavailable")
                else:
                    drafts[i] = d
        return drafts, time.monotonic() - t0

    def deadline(self, k: int) -> float:
        """How long a round waits for its drafts: ``draft_deadline_factor`` x (k + 1) recent verify
        times (a draft slower than that cannot pay for itself), within [draft_deadline_min_s,
        draft_deadline_s]; ``draft_deadline_s`` until a verify time has been measured."""
        return draft_deadline(self.cfg, self.verify_ema, k)

    def launch_predraft(
        self, batch: list[Job], ks: list[int], drafts: list[Draft], policy_k: Callable[[Job], int]
    ) -> None:
        """Draft round r+1 on the all-accepted guess while the target verifies round r."""
        if not self.cfg.predraft or self.draft is None or not self.draft.up:
            return
        idx, seqs = [], []
        for i, (job, k, d) in enumerate(zip(batch, ks, drafts)):
            if job.spec != "draft" or k <= 0 or len(d.tokens) != k:
                continue
            st = job.state
            k_next = predraft_k(
                policy_k(job), len(st.generated), k, st.params.max_tokens, len(st.tokens), self.max_context
            )
            if k_next <= 0:
                continue
            idx.append(i)
            seqs.append(sequence_to_proto(job.key, st.tokens + d.tokens, job.params, job.mode, k_next + 1))
        if not seqs:
            return
        task = self.spawn(self.propose(seqs))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved: no warning
        for n, i in enumerate(idx):
            job = batch[i]
            job.predraft = PreDraft(
                base=len(job.state.tokens) + ks[i], draft=list(drafts[i].tokens), task=task, index=n
            )

    def prefill(self, jobs: list[Job], ends: dict[str, int]) -> None:
        """Send the draft worker the same prompt chunks as the target, without waiting: it caches them
        while the target does, and the job's first Propose queues behind them on the worker. A
        prompt's last chunk goes with that first Propose instead (a short prompt sends no Prefill)."""
        jobs = [j for j in jobs if j.spec == "draft" and ends[j.key] < j.state.prefill_total]
        if not jobs or self.draft is None or not self.draft.up:
            return
        seqs = [sequence_to_proto(j.key, j.state.prompt_ids[: ends[j.key] + 1], j.params, j.mode) for j in jobs]
        for job in jobs:
            job.used_draft = True  # the drafter holds a slot for it now
        task = self.spawn(self._prefill(seqs))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved: no warning

    async def _prefill(self, seqs: list[worker_pb2.Sequence]) -> None:
        assert self.draft is not None
        try:
            async with self.draft.lock:
                await self.draft.call(
                    "Prefill", worker_pb2.PrefillRequest(sequences=seqs), timeout=self.cfg.rpc_timeout_s
                )
        except (WorkerUnavailable, grpc.aio.AioRpcError) as exc:  # the first Propose caches the prompt itself
            log.info("draft prefill failed: %s", exc)

    async def release(self, job: Job) -> None:
        """Free the job's draft slot (after any pre-draft for it has finished: it would re-create it)."""
        pd, job.predraft = job.predraft, None
        if pd is not None and not pd.task.done():
            await asyncio.wait([pd.task])
        if self.draft is not None and (job.used_draft or pd is not None):
            await self.draft.release([job.key])
