"""The router's scheduler for one target worker: continuous batching, pipelined rounds, fail open.

Every request (a :class:`Job`) owns its committed tokens in a core
:class:`specdec.core.request_state.RequestState` (docs/design.md, invariant 1): workers only ever see
``Sequence(tokens=committed)`` and rebuild their caches from it.

Rounds. A round takes a micro-batch of running jobs, gets their drafts (the draft worker's
``Propose``, the local n-gram drafter, or nothing), sends one ``Verify`` to the target, and commits
each job's verified tokens through the stop rules (invariant 5), streaming them to the client.

Pipelining. ``micro_batches`` lanes (coroutines) run rounds concurrently over disjoint
micro-batches. The worker clients serialise their batch RPCs, so with two lanes the pools
alternate: while the target verifies micro-batch A, the drafter drafts for B, and the other way
round. Jobs are not pinned to a lane: a lane starting a round takes up to its share of the jobs
that are not in flight; new jobs join at the next round (continuous batching). With
``predraft`` the drafter also drafts round r+1 while the target verifies round r
(:mod:`router.drafting`).

Fail open (invariant 4). Drafts have a deadline (``draft_deadline_s``): a late draft, a failed
``Propose`` or a draft worker that is down makes the round verify with k = 0 for those jobs (plain
decoding on the target; counted in ``fail_open_rounds``). The worker client re-resolves a lost
drafter in the background (a restarted Ray actor has a new port) and speculation resumes when it
answers again. A target failure makes the round wait for the target to come back and replays it
(:mod:`router.target_link`).

Rebalancing (when ``rebalance.enabled``): drafts come from the drafter pool shared by all targets
(router/drafter_choice.py); the target's depth level (router/draft_depth.py, set from its device
telemetry by router/telemetry_loop.py) bounds the adaptive k and turns pre-drafting on or off; and
each round, AUTO requests stop speculating while the measured goodput says plain decoding is
faster (router/speculation_off.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable

import grpc

from router import clock
from router.admission import Admission
from router.batching import (
    batch_capacity,
    lane_share,
    request_k_policy,
    resolve_spec,
)
from router.config import RouterConfig
from router.draft_depth import policy_k
from router.drafter_pool import DrafterPool
from router.drafting import DraftSource
from router.jobs import Chunk, Job, QueueFull, next_job_key
from router.metrics import Metrics
from router.target_balance import TargetBalance
from router.target_link import TargetLink, TargetRestarted
from router.traces import round_trace
from router.workers import WorkerClient, WorkerUnavailable
from specdec.core.params import InvalidParams, SamplingParams, VerifyMode
from specdec.core.prefill_plan import PrefillNeed, chunks_between, plan_prefill
from specdec.core.request_state import CostMeter, new_request
from specdec.core.round_types import Draft
from specdec.rpc import worker_pb2
from specdec.rpc.convert import sequence_to_proto
from specdec.rpc.errors import RpcStatusError

log = logging.getLogger(__name__)

__all__ = ["Chunk", "Job", "TargetScheduler", "QueueFull"]


async def _all(*started: Awaitable) -> None:
    await asyncio.gather(*started)


class TargetScheduler(Admission):
    """Queue, running set and round lanes of one target worker. Drafts come from ``pool`` (shared by
    every target; ``home`` is this target's own drafter, the only one used without the rebalancer)."""

    def __init__(
        self,
        name: str,
        target: WorkerClient,
        pool: DrafterPool | None,
        home: str | None,
        config: RouterConfig,
        metrics: Metrics,
        decode: Callable[[list[int]], str],
    ):
        self.name = name
        self.target = target
        self.cfg = config
        self.metrics = metrics
        metrics.add_model(name)
        self.decode = decode
        info = target.info
        if info is None:
            raise RuntimeError(f"target {name}: no worker info (connect first)")
        self.max_context = int(info.max_context)
        self.vocab_size = int(info.vocab_size)
        self.eos_token_ids = set(int(t) for t in info.eos_token_ids)
        own = pool.client(home) if pool is not None and not config.rebalance.enabled else None
        # static pairing: its drafter's slots bound the batch
        draft_slots = int(own.info.num_slots) if own is not None and own.info is not None else None
        self.capacity = batch_capacity(int(info.num_slots), config.max_batch, draft_slots)
        self.waiting: deque[Job] = deque()
        self.running: list[Job] = []
        self.admitted: dict[str, int] = {}  # client -> the admission count when it last got a slot
        self._admissions = 0
        self.served = 0  # requests completed here (autoscaling: a new replica serves)
        self.peak_running = 0  # the most requests run at once (the planner: did the batch cap bind?)
        self.first_served_at: float | None = None  # router clock
        self._wake = asyncio.Event()
        self._closing = False
        self._lanes: list[asyncio.Task] = []
        self._bg: set[asyncio.Task] = set()
        self.link = TargetLink(name, target, config)
        self.drafting = DraftSource(
            pool, home, config, metrics, self.vocab_size, self.max_context, self._spawn, name=target.name
        )
        self.draft = pool if self.drafting.available else None  # None: this deployment has no draft model
        self.balance = TargetBalance(self)  # depth level, speculation switch (router/target_balance.py)
        # c = draft step / target step as this pipeline sees it (the time a round waits per draft
        # step over its verify time), for the adaptive k; pre-draft hits make drafting look free.
        self.cost = CostMeter(c=config.k_policy.cost_ratio)

    # ---- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._lanes = [
            loop.create_task(self._lane(i), name=f"{self.name}-lane{i}") for i in range(self.cfg.micro_batches)
        ]

    @property
    def load(self) -> int:
        return len(self.running) + len(self.waiting)

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)
        return task

    def _shut_out(self, job: Job) -> None:
        """End a job the server cannot finish before it stops: UNAVAILABLE, retry elsewhere."""
        self._fail(
            job,
            RpcStatusError(
                grpc.StatusCode.UNAVAILABLE,
                "the server shut down before this request finished (router.grace_s); retry it",
                retry_after=1.0,
            ),
            outcome="unavailable",
        )

    async def close(self, grace: float) -> None:
        """Stop admitting; give running jobs ``grace`` seconds, then end them UNAVAILABLE."""
        self._closing = True
        t_end = clock.now() + grace
        while (self.running or self.waiting) and clock.now() < t_end:
            await asyncio.sleep(0.05)
        while self.waiting:
            job = self.waiting.popleft()
            self.metrics.queue_depth.dec()
            self._shut_out(job)
        for job in list(self.running):
            if not job.done:
                if job.in_flight:
                    job.cancelled = "shutdown"
                else:
                    self._shut_out(job)
        t_end = clock.now() + 5.0
        while any(j.in_flight for j in self.running) and clock.now() < t_end:
            await asyncio.sleep(0.02)
        for task in self._lanes:
            task.cancel()
        await asyncio.gather(*self._lanes, return_exceptions=True)
        if self._bg:
            await asyncio.wait(list(self._bg), timeout=5.0)

    # ---- admission -----------------------------------------------------------------------------
    def new_job(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        mode: VerifyMode,
        spec: str,
        k: int | None,
        deadline: float | None,
    ) -> Job:
        spec, auto = resolve_spec(spec, self.cfg.default_mode, self.draft is not None)
        if spec == "draft" and self.draft is None:
            raise InvalidParams("speculation.mode", "this deployment has no draft model; use NGRAM, OFF or AUTO")
        policy = request_k_policy(spec, k, self.cfg.k_policy)
        key = next_job_key(request_id)
        state = new_request(key, prompt_ids, params, mode, policy, self.eos_token_ids, self.decode)
        return Job(key=key, request_id=request_id, state=state, spec=spec, auto=auto, deadline=deadline)

    def _take(self, lane: int) -> list[Job]:
        self._admit()
        now = clock.now()
        for job in [j for j in self.running if not j.in_flight and j.deadline is not None and j.deadline <= now]:
            self._fail(
                job,
                RpcStatusError(grpc.StatusCode.DEADLINE_EXCEEDED, "the request's deadline passed"),
                outcome="deadline_exceeded",
            )
        ready = [j for j in self.running if not j.in_flight and not j.done]
        if not ready:
            return []
        share = lane_share(len(self.running), lane, self.cfg.micro_batches, self.cfg.split_min_batch)
        if share == 0:
            return []
        batch = ready[:share]
        for job in batch:
            job.in_flight = True
        return batch

    async def _lane(self, lane: int) -> None:
        while True:
            batch = self._take(lane)
            if not batch:
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                await self._round(batch)
            except asyncio.CancelledError:
                for job in batch:
                    job.in_flight = False
                raise
            except Exception as exc:  # noqa: BLE001 - a round failure fails its jobs, not the router
                log.exception("round failed on %s", self.name)
                for job in batch:
                    if not job.done:
                        self._fail(job, exc, outcome="error")
            finally:
                for job in batch:
                    job.in_flight = False
                    if job.cancelled and not job.done:
                        if job.cancelled == "shutdown":
                            self._shut_out(job)
                        else:
                            self._finish(
                                job, None, outcome="deadline_exceeded" if job.cancelled == "deadline" else "cancelled"
                            )
                self._wake.set()

    # ---- a round -------------------------------------------------------------------------------
    def _policy_k(self, job: Job) -> int:
        return policy_k(job.state)

    def _want_k(self, job: Job) -> int:
        return self.balance.want_k(job, len(self.running), self.max_context)

    def _plan_chunks(self, batch: list[Job], verify_tokens: int, process: int) -> list[tuple[Job, int]]:
        """This round's prompt chunks within its budget, which the target caches in the round's
        Verify (docs/design.md, Scheduling): each job given one and the prompt tokens it caches.
        Marks the job's prompt as cached up to its chunk's end on ``process``; a call that fails
        undoes it (:meth:`_caches_lost`, :meth:`_fail`)."""
        prefilling = [j for j in batch if j.state.prefilling]
        if not prefilling:  # most rounds: no budget to work out
            return []
        fair = self.cfg.fair_share  # off: every request counts as one client's (by request only)
        needs = [
            PrefillNeed(j.key, j.state.prefilled, j.state.prefill_total, j.client if fair else "") for j in prefilling
        ]
        plan = plan_prefill(needs, verify_tokens, self.balance.prefill_budget(batch), self.cfg.prefill_chunk)
        chunked = [(j, plan[j.key] - j.state.prefilled) for j in prefilling if j.key in plan]
        if not chunked:
            return []
        self.metrics.prefill_chunks.inc(
            sum(chunks_between(j.state.prefilled, plan[j.key], self.cfg.prefill_chunk) for j, _ in chunked)
        )
        self.metrics.round_tokens.observe(verify_tokens + sum(n for _, n in chunked))
        for job, _ in chunked:
            job.state.prefilled, job.cached_on = plan[job.key], process
        return chunked

    def _caches_lost(self, jobs: list[Job]) -> None:
        """The target restarted since these jobs were cached on it: they cache their committed
        tokens again in chunks within the rounds' budget, never all in one forward (docs/design.md,
        "Recovery")."""
        lost = [j for j in jobs if j.cached_on is not None and not j.done]
        for job in lost:
            job.cache_again()
        if lost:
            self.metrics.recached.inc(len(lost))
            log.info("target %s restarted: %d requests cache their tokens again in chunks", self.name, len(lost))

    async def _round(self, batch: list[Job]) -> None:
        t0 = clock.now()
        process = self.link.process
        self._caches_lost([j for j in batch if j.cached_on not in (None, process)])
        if any(not j.spec_planned for j in self.running):
            self.balance.start(self.running, [self._want_k(j) for j in self.running])
        decoding = [j for j in batch if not j.state.prefilling]
        ks = [self._want_k(j) for j in decoding]
        chunked = self._plan_chunks(batch, sum(k + 1 for k in ks), process)
        # A prompt's last chunk goes in its first verify row; the others are cached beside the rows.
        first = [j for j, _ in chunked if not j.state.prefilling and not j.done and not j.cancelled]
        caching = [j for j, _ in chunked if j.state.prefilling]
        batch = decoding + first
        ks += [self._want_k(j) for j in first]
        with round_trace(caching, "prefill"), round_trace(batch) as trace:
            if chunked:
                # The drafters cache the same chunks meanwhile (a prompt's last goes with its first Propose).
                self.drafting.prefill(caching, {j.key: j.state.prefilled for j in caching})
                trace.prefilled(chunked)
            try:
                if batch:
                    await self._verify_round(batch, ks, caching, bool(chunked), t0, trace, process)
                elif caching:
                    await self._cache_chunks(caching, process)
            except TargetRestarted:
                trace.restarted()
                self._caches_lost(batch + caching)

    def _chunk_sequences(self, caching: list[Job]) -> list[worker_pb2.Sequence]:
        """Each job's prompt up to its chunk's end: the target caches all but the last token."""
        return [sequence_to_proto(j.key, j.state.tokens[: j.state.prefilled + 1], j.params, j.mode) for j in caching]

    def _chunks_failed(self, caching: list[Job], error: BaseException | None) -> None:
        if error is not None:
            for job in caching:
                self._fail(job, error, outcome="unavailable" if isinstance(error, WorkerUnavailable) else "error")

    async def _cache_chunks(self, caching: list[Job], process: int) -> None:
        """A round of prompt chunks only (no request to verify): a Verify of no items."""
        t0 = clock.now()
        _, _, failed = await self.link.verify([], [], process, self._chunk_sequences(caching))
        self._chunks_failed(caching, failed)
        self.metrics.phase.labels("prefill").observe(clock.now() - t0)

    async def _verify_round(
        self, batch: list[Job], ks: list[int], caching: list[Job], chunked: bool, t0: float, trace, process: int
    ) -> None:
        """The rest of a round: drafts, then one Verify that also caches the prompt chunks of
        ``caching`` (``chunked``: the round has prompt chunks, those and prompts' last), then commit."""
        # A request's first round feeds the drafter its prompt's tail: it says nothing of a step.
        # Nor does a round whose forward holds prompt chunks: its time is mostly theirs.
        measured = all(j.state.generated for j in batch) and not caching
        ks = self.balance.speculation(batch, ks, measured)
        with trace.phase("draft_wait"):
            drafts, draft_wait = await self.drafting.drafts(batch, ks)
        self.drafting.launch_predraft(batch, ks, drafts, self._policy_k, self.balance.predraft)
        chunks = self._chunk_sequences(caching)
        t1 = clock.now()
        with trace.phase("verify"):
            outcomes, compute, chunks_failed = await self.link.verify(batch, drafts, process, chunks)
        t2 = clock.now()
        self._chunks_failed(caching, chunks_failed)
        trace.outcomes(batch, drafts, outcomes)
        self.balance.log_round(batch, ks, [len(d.tokens) for d in drafts], draft_wait, t2 - t1, compute)
        if not any(isinstance(o, BaseException) for o in outcomes) and not chunked:
            dt = t2 - t1
            self.drafting.observe_verify(dt, drafts, [getattr(o, "num_accepted", 0) for o in outcomes])
            steps = max((d.depth for j, d in zip(batch, drafts) if j.source == "draft"), default=0)
            if measured:  # the worker's own time: with two lanes the wall holds the other lane's call
                busy = compute if compute is not None else dt
                self.cost.update(draft_wait, steps, busy, sum(len(d.tokens) + 1 for d in drafts), len(batch))
        m = self.metrics
        m.rounds.inc()
        m.batch_size.observe(len(batch))
        if not chunked:  # else _plan_chunks counted the round's tokens
            m.round_tokens.observe(sum(k + 1 for k in ks))
        for job, draft, out in zip(batch, drafts, outcomes):
            if job.done or job.cancelled:
                continue
            if isinstance(out, BaseException):
                self._fail(job, out, outcome="unavailable" if isinstance(out, WorkerUnavailable) else "error")
                continue
            job.cached_on = process  # a verify caches its context too (a one-token prompt's first)
            self._commit(job, draft, out)
        t3 = clock.now()
        m.phase.labels("draft_wait").observe(draft_wait)
        # A Verify that caches prompt tokens is timed as the round's prefill: the verify phase stays
        # the cost of verifying, which the cost line and the planner's calibration read.
        m.phase.labels("prefill" if chunked else "verify").observe(t2 - t1)
        if compute is not None:
            m.phase.labels("rpc").observe(max(0.0, (t2 - t1) - compute))
        m.phase.labels("router").observe((t3 - t0) - draft_wait - (t2 - t1))
        m.phase.labels("round").observe(t3 - t0)
        self.balance.observe_round(draft_wait, t3 - t0)

    def _commit(self, job: Job, draft: Draft, out: worker_pb2.VerifyOutcome) -> None:
        tokens, n_acc = list(out.tokens), int(out.num_accepted)
        k = draft.depth
        if not (0 <= n_acc <= k and len(tokens) == n_acc + 1 and draft.holds(tokens[:n_acc])):
            self._fail(
                job,
                RpcStatusError(
                    grpc.StatusCode.INTERNAL,
                    "the target returned an inconsistent verification result; see the router log",
                ),
                outcome="error",
            )
            log.error("bad outcome for %s: draft %s, tokens %s, accepted %d", job.key, draft.tokens, tokens, n_acc)
            return
        st = job.state
        # An n-gram draft in place of the draft model teaches the draft model's k and acceptance
        # nothing (router/ngram_fallback.py): its outcome counts as n-gram evidence only.
        model_draft = not job.ngram_on
        committed = st.commit(tokens, n_acc, k, self.max_context, adapt=model_draft)
        self.metrics.record_draft(k, min(n_acc, len(committed)), None if draft.parents is None else draft.k)
        if model_draft:
            self.balance.observe_outcome(k, n_acc)
        self.balance.observe_guess(job, tokens)
        now = clock.now()
        if committed:
            if job.t_first is None:
                job.t_first = now
                self.metrics.ttft.labels(self.name).observe(now - job.t_arrival)
            else:
                self.metrics.inter_token.observe(now - job.t_last)
            job.t_last = now
            self.metrics.generated_tokens.inc(len(committed))
        if st.finish_reason is not None:
            self._finish(job, st.finish_reason, committed)
        elif committed:
            text = st.stops.stable_text
            job.events.put_nowait(Chunk(committed, text[job.emitted :]))
            job.emitted = len(text)

    # ---- finishing -----------------------------------------------------------------------------
    def _remove(self, job: Job) -> None:
        job.done = True
        self._release(job)

    def _release(self, job: Job) -> None:
        if job in self.running:
            self.running.remove(job)
            self.metrics.running.dec()
        # Started here, not in a task of their own: the next round's calls wait for them (WorkerClient.release).
        self._spawn(_all(self.target.release([job.key]), *self.drafting.release(job)))

    def _finish(
        self, job: Job, finish_reason: str | None, committed: list[int] | None = None, *, outcome: str | None = None
    ) -> None:
        """End a job: a final chunk when ``finish_reason`` is set, else (client gone) nothing."""
        if job.done:
            return
        self._remove(job)
        m = self.metrics
        if finish_reason is not None:
            st = job.state
            text = st.text
            job.events.put_nowait(Chunk(list(committed or []), text[job.emitted :], finish_reason))
            job.emitted = len(text)
            outcome = outcome or finish_reason
            n = len(st.generated)
            if job.t_first is not None and job.t_last is not None:
                if n > 1:
                    m.tpot.labels(self.name).observe((job.t_last - job.t_first) / (n - 1))
                m.duration.labels(self.name).observe(job.t_last - job.t_arrival)
            m.generation_len.labels(self.name).observe(n)
            self.served += 1
            if self.first_served_at is None:
                self.first_served_at = clock.now()
                # a replica's first finished request: the end of a scale-up, as an operator (and the
                # autoscaling e2e test) reads it from the log
                log.info("%s: first request served", self.target.name)
        job.outcome = outcome
        m.requests.labels(outcome or "cancelled", self.name).inc()

    def _fail(self, job: Job, exc: BaseException, *, outcome: str) -> None:
        if job.done:
            return
        self._remove(job)
        job.outcome = outcome
        self.metrics.requests.labels(outcome, self.name).inc()
        job.events.put_nowait(exc)

    async def tokenize(
        self, text: str, chat: bool, timeout: float, messages: list[tuple[str, str]] | None = None
    ) -> list[int]:
        return await self.link.tokenize(text, chat, timeout, messages)
