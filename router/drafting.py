"""Where a round's drafts come from: the draft worker (with pre-drafting), the local n-gram drafter,
or nothing; and failing open when a draft is late or its worker is gone (docs/design.md, invariant 4).

Pre-drafting: the drafter drafts round r+1 of a micro-batch while the target verifies round r, on
the guess that all of round r's draft is accepted and the target's bonus token is the drafter's own
next token; the pre-draft is used when the guess proves right and discarded otherwise (PEARL-style).
Drafts have a deadline (:meth:`DraftSource.deadline`); a Propose that missed it is let finish (it
builds the drafter's cache) while the next rounds fail open instead of queueing behind it.

The draft workers are one pool shared by every target (:class:`router.drafter_pool.DrafterPool`):
each request drafts on the drafter the pool assigns it, and a round's requests on different
drafters are drafted there concurrently.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import grpc

from router import clock
from router.batching import draft_deadline
from router.config import RouterConfig
from router.draft_depth import is_catch_up, predraft_k, predraft_room
from router.drafter_pool import DrafterPool
from router.jobs import Job, PreDraft
from router.metrics import Metrics
from router.workers import WorkerUnavailable
from specdec.core.ngram import NgramDrafter
from specdec.core.params import VerifyMode
from specdec.core.round_types import Draft
from specdec.core.token_tree import within_depth
from specdec.core.tree_size import TreeSizer
from specdec.rpc import worker_pb2
from specdec.rpc.convert import draft_from_proto, sequence_to_proto

log = logging.getLogger(__name__)

__all__ = ["DraftSource"]


async def _after(task: asyncio.Task, then: Callable[[], Awaitable]) -> None:
    await asyncio.wait([task])
    await then()


class DraftSource:
    """Drafts for one target scheduler's rounds, from the shared pool (``home``: this target's own
    drafter, the only one it uses when the rebalancer is off)."""

    def __init__(
        self,
        pool: DrafterPool | None,
        home: str | None,
        config: RouterConfig,
        metrics: Metrics,
        vocab_size: int,
        max_context: int,
        spawn: Callable[[Coroutine[Any, Any, Any]], asyncio.Task],
        name: str | None = None,
    ):
        self.name = name  # the target's: the pool keeps a target's requests on one drafter
        self.pool = pool
        self.home = home
        self.cfg = config
        self.metrics = metrics
        self.vocab_size = vocab_size
        self.max_context = max_context
        self.spawn = spawn
        self.ngram = NgramDrafter(max_ngram=config.ngram_max, min_ngram=config.ngram_min)
        self.verify_ema: float | None = None  # recent Verify wall time (s), for the draft deadline
        self.tree_sizer = TreeSizer()  # how many nodes of the drafters' token trees a round verifies

    @property
    def available(self) -> bool:
        """Whether requests may ask for the draft model here."""
        if self.pool is None or not len(self.pool):
            return False
        return self.cfg.rebalance.enabled or self.pool.client(self.home) is not None

    def observe_verify(self, seconds: float, drafts: list[Draft], accepted: list[int]) -> None:
        self.verify_ema = seconds if self.verify_ema is None else 0.8 * self.verify_ema + 0.2 * seconds
        if any(d.scores for d in drafts):
            self.tree_sizer.observe_round(drafts, accepted, seconds)

    def fail_open(self, job: Job, reason: str) -> None:
        job.state.stats.fail_open_rounds += 1
        self.metrics.fail_open.labels(reason).inc()

    def _assign(self, job: Job, pd: PreDraft | None = None) -> str | None:
        assert self.pool is not None
        name = self.pool.assign(job, self.home, self.name)
        if job.moved_from is not None:  # free the slot it left (again at the end: a late call may re-create it)
            self._release_on(job.moved_from, [job.key], pd or job.predraft)
        return name

    async def propose(
        self,
        name: str,
        seqs: list[worker_pb2.Sequence],
        started: list | None = None,
        prefill_tokens: int = 0,
        predraft: bool = False,
    ) -> list[worker_pb2.Draft]:
        assert self.pool is not None
        return await self.pool.propose(name, seqs, started, prefill_tokens, predraft)

    def _catch_up(self, job: Job, name: str) -> bool:
        """A request that decoded without speculating (switched off, or moved to this drafter)
        catches its drafter up with a Prefill in the background and verifies this round without a
        draft: a Propose carrying its tokens would hold the whole round while the drafter prefills
        them. False (nothing to do) for a request's first round, whose Propose carries the prompt's
        tail as before."""
        toks = job.state.tokens
        new = len(toks) - job.draft_fed.get(name, 0)
        if not job.state.generated or not is_catch_up(new, self.cfg.k_policy.k_max):
            return False
        job.drafters.add(name)
        job.draft_fed[name] = len(toks)
        task = self.spawn(self._prefill(name, [sequence_to_proto(job.key, toks, job.params, job.mode)], new))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved: no warning
        self.metrics.draft_catch_up.inc()
        return True

    def _feed(self, job: Job, name: str, length: int) -> int:
        """Record that drafter ``name`` is sent ``length`` tokens of ``job``; the new tokens where
        that is more than a round commits (a prompt's tail, or catching up after speculation was
        off: such a Propose prefills them, and its time says nothing of a draft step), else 0."""
        new = length - job.draft_fed.get(name, 0)
        job.draft_fed[name] = length
        return new if is_catch_up(new, self.cfg.k_policy.k_max) else 0

    def decode_draft(self, m: worker_pb2.Draft, k: int, offset: int = 0) -> Draft | None:
        try:
            d = draft_from_proto(m, self.vocab_size)
        except Exception as exc:  # noqa: BLE001 - a bad draft fails open
            log.warning("discarding a bad draft: %s", exc)
            return None
        if d.parents is not None:  # a token tree: its nodes within depth k (never a pre-draft's)
            return None if offset else d.keep(within_depth(d.parents, k))
        tokens = d.tokens[offset : offset + k]
        probs = d.probs[offset : offset + k] if d.probs is not None else None
        return Draft(tokens=tokens, probs=probs)

    async def drafts(self, batch: list[Job], ks: list[int]) -> tuple[list[Draft], float]:
        drafts = [Draft(tokens=[]) for _ in batch]
        remote: dict[str, list[int]] = {}  # drafter -> indices needing a Propose there
        pending: list[tuple[int, PreDraft]] = []  # indices with a pre-draft that may still be right
        shadow = self.cfg.speculation_off.ngram_fallback and self.cfg.rebalance.enabled
        for i, (job, k) in enumerate(zip(batch, ks)):
            pd, job.predraft = job.predraft, None
            if shadow and job.auto and job.spec == "draft":  # scored after the verify (router/ngram_fallback.py)
                job.ngram_guess = self.ngram.propose_one(job.state.tokens, self.cfg.k_policy.k_max).tokens
            if k <= 0:
                continue
            if job.source == "ngram":
                d = self.ngram.propose_one(job.state.tokens, k)
                if job.mode is not VerifyMode.REJECTION:
                    d.probs = None
                drafts[i] = d
                if d.tokens:
                    self.metrics.draft_sequences.labels("ngram").inc()  # beside the draft workers
            elif job.spec == "draft":
                name = self._assign(job, pd) if self.pool is not None else None
                if name is None:
                    self.fail_open(job, "unavailable")
                    continue
                toks = job.state.tokens
                if self._catch_up(job, name):
                    continue
                if (
                    pd is not None
                    and pd.drafter == name
                    and len(toks) == pd.base + 1
                    and toks[pd.base - len(pd.draft) : pd.base] == pd.draft
                ):
                    pending.append((i, pd))
                else:
                    if pd is not None:
                        self.metrics.predraft.labels("miss").inc()
                    remote.setdefault(name, []).append(i)
        if not remote and not pending:
            return drafts, 0.0
        t0 = clock.now()
        t_end = t0 + self.deadline(max(ks))
        # Pre-drafts first: they are already running on their drafters.
        for i, pd in pending:
            job, k = batch[i], ks[i]
            try:
                res = await asyncio.wait_for(asyncio.shield(pd.task), max(0.0, t_end - clock.now()))
                d = self.decode_draft(res[pd.index], k + 1)
            except TimeoutError:
                self.pool.set_late(pd.drafter, pd.task)
                d = None
            except (WorkerUnavailable, grpc.aio.AioRpcError):
                d = None
            if d is not None and len(d.tokens) >= 2 and d.tokens[0] == job.state.tokens[-1]:
                drafts[i] = Draft(tokens=d.tokens[1:], probs=d.probs[1:] if d.probs is not None else None)
                self.metrics.predraft.labels("hit").inc()
            else:
                self.metrics.predraft.labels("miss").inc()
                remote.setdefault(pd.drafter, []).append(i)
        calls = [self._call(name, idx, batch, ks) for name, idx in remote.items()]
        results = await asyncio.gather(*(self._await(c, t_end) for c in calls))
        for (_, idx, _, _), (res, reason) in zip(calls, results):
            for n, i in enumerate(idx):
                d = self.decode_draft(res[n], ks[i]) if reason is None else None
                if d is None:
                    self.fail_open(batch[i], reason or "unavailable")
                else:
                    drafts[i] = d
        wait = clock.now() - t0
        if any(d.scores for d in drafts):  # trees cut to the nodes worth verifying (specdec/core/tree_size.py)
            self.tree_sizer.cut(drafts, wait)
        return drafts, wait

    def _call(self, name: str, idx: list[int], batch: list[Job], ks: list[int]):
        """Start one Propose on ``name`` for ``idx`` (or not, when it is busy with a late one)."""
        for i in idx:
            batch[i].drafters.add(name)  # the drafter may hold a cache slot for it now
        if self.pool.is_late(name):
            # The drafter is still computing a draft that came too late; a new Propose would queue
            # behind it. Fail open now, speculate again once it has caught up.
            return name, idx, None, []
        seqs = [
            sequence_to_proto(batch[i].key, batch[i].state.tokens, batch[i].params, batch[i].mode, ks[i]) for i in idx
        ]
        prefill = sum(self._feed(batch[i], name, len(batch[i].state.tokens)) for i in idx)
        started: list = []
        task = self.spawn(self.propose(name, seqs, started, prefill))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved: no warning
        return name, idx, task, started

    async def _await(self, call, t_end: float) -> tuple[list | None, str | None]:
        """(drafts, None) or (None, fail-open reason) for one started call."""
        name, _, task, started = call
        if task is None:
            return None, "deadline"
        try:
            return await asyncio.wait_for(asyncio.shield(task), max(0.0, t_end - clock.now())), None
        except TimeoutError:
            if started:
                self.pool.set_late(name, task)  # let it finish (it builds the drafter's cache), results unused
            else:
                task.cancel()  # still queued behind another draft: never send it
            return None, "deadline"
        except (WorkerUnavailable, grpc.aio.AioRpcError) as exc:
            log.info("draft worker %s failed, failing open: %s", name, exc)
            return None, "unavailable"

    def deadline(self, k: int) -> float:
        """How long a round waits for its drafts: ``draft_deadline_factor`` x (k + 1) recent verify
        times (a draft slower than that cannot pay for itself), within [draft_deadline_min_s,
        draft_deadline_s]; ``draft_deadline_s`` until a verify time has been measured."""
        return draft_deadline(self.cfg, self.verify_ema, k)

    def launch_predraft(
        self,
        batch: list[Job],
        ks: list[int],
        drafts: list[Draft],
        policy_k: Callable[[Job], int],
        enabled: bool,
    ) -> None:
        """Draft round r+1 on the all-accepted guess while the target verifies round r."""
        if not enabled or self.pool is None:
            return
        groups: dict[str, tuple[list[int], list[worker_pb2.Sequence], list[bool]]] = {}
        rooms: dict[str, int | None] = {}  # draft steps a pre-draft may take on each drafter
        for i, (job, k, d) in enumerate(zip(batch, ks, drafts)):
            if job.source != "draft" or k <= 0 or d.parents is not None or len(d.tokens) != k or job.drafter is None:
                continue  # the all-accepted guess of a chain (a tree has no one such guess)
            client = self.pool.client(job.drafter)
            if client is None or not client.up or self.pool.is_late(job.drafter):
                continue
            if job.drafter not in rooms:
                rooms[job.drafter] = predraft_room(self.pool.view_of(job.drafter, self.name), self.verify_ema)
            st = job.state
            k_next = predraft_k(
                policy_k(job),
                len(st.generated),
                k,
                st.params.max_tokens,
                len(st.tokens),
                self.max_context,
                rooms[job.drafter],
            )
            if k_next <= 0:
                continue
            idx, seqs = groups.setdefault(job.drafter, ([], [], []))[:2]
            idx.append(i)
            seqs.append(sequence_to_proto(job.key, st.tokens + d.tokens, job.params, job.mode, k_next + 1))
            groups[job.drafter][2].append(self._feed(job, job.drafter, len(st.tokens) + len(d.tokens)))
        for name, (idx, seqs, prefill) in groups.items():
            task = self.spawn(self.propose(name, seqs, None, sum(prefill), predraft=True))
            task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved: no warning
            for n, i in enumerate(idx):
                job = batch[i]
                job.predraft = PreDraft(
                    drafter=name, base=len(job.state.tokens) + ks[i], draft=list(drafts[i].tokens), task=task, index=n
                )

    def prefill(self, jobs: list[Job], ends: dict[str, int]) -> None:
        """Send the drafters the same prompt chunks as the target, without waiting: they cache them
        while the target does, and a job's first Propose queues behind them on its drafter. A
        prompt's last chunk goes with that first Propose instead (a short prompt sends no Prefill).
        A request that starts with speculation switched off, or drafting by n-gram, sends nothing
        (TargetBalance.start)."""
        jobs = [j for j in jobs if j.source == "draft" and not j.spec_off and ends[j.key] < j.state.prefill_total]
        if not jobs or self.pool is None:
            return
        groups: dict[str, list[Job]] = {}
        for job in jobs:
            name = self._assign(job)
            # A drafter fed past this chunk still holds it: a target restart loses only the target's caches.
            if name is not None and job.fed_to(name) <= ends[job.key]:
                groups.setdefault(name, []).append(job)
        for name, group in groups.items():
            seqs = [sequence_to_proto(j.key, j.state.tokens[: ends[j.key] + 1], j.params, j.mode) for j in group]
            new = sum(ends[j.key] + 1 - j.draft_fed.get(name, 0) for j in group)
            for job in group:
                job.drafters.add(name)  # the drafter holds a slot for it now
                job.draft_fed[name] = ends[job.key] + 1
            task = self.spawn(self._prefill(name, seqs, new))
            task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved: no warning

    async def _prefill(self, name: str, seqs: list[worker_pb2.Sequence], new_tokens: int) -> None:
        client = self.pool.client(name)
        if client is None or not client.up:
            return
        call = self.pool.begin(name, 0)
        try:
            async with client.lock:
                t0 = clock.now()
                _, compute = await client.call_timed(
                    "Prefill", worker_pb2.PrefillRequest(sequences=seqs), timeout=self.cfg.rpc_timeout_s
                )
                wall = clock.now() - t0
                self.pool.observe_prefill(name, wall if compute is None else compute, new_tokens)
            log.debug(
                "draft prefill on %s: %d rows, %d new tokens; ran %.0f ms (computed %s)",
                name, len(seqs), new_tokens, 1e3 * wall, "-" if compute is None else f"{1e3 * compute:.0f}",
            )  # fmt: skip
            if compute is not None:
                self.metrics.record_draft_prefill(compute, new_tokens)
        except (WorkerUnavailable, grpc.aio.AioRpcError) as exc:  # the first Propose caches the prompt itself
            log.info("draft prefill on %s failed: %s", name, exc)
        finally:
            self.pool.end(name, call, False)

    def _release_on(self, name: str, keys: list[str], pd: PreDraft | None = None) -> Awaitable | None:
        """Free ``keys``' slots on drafter ``name``: started now (WorkerClient.release), or once a
        pre-draft still running there is done (it would re-create the slot); None: not in the pool."""
        client = self.pool.client(name) if self.pool is not None else None
        if client is None:
            return None
        if pd is not None and pd.drafter == name and not pd.task.done():
            return self.spawn(_after(pd.task, lambda: client.release(keys)))
        return client.release(keys)

    def release(self, job: Job) -> list[Awaitable]:
        """Free the job's draft slots on every drafter it used, started now (see :meth:`_release_on`)."""
        pd, job.predraft = job.predraft, None
        if self.pool is None:
            return []
        self.pool.forget(job)
        return [r for name in job.drafters if (r := self._release_on(name, [job.key], pd)) is not None]
