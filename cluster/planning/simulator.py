"""A discrete-event simulation of the service: the router's target schedulers (continuous batching,
micro-batch lanes, chunked prefill under the round budget, the k policy and its cost meter, the
goodput gate, pre-drafting, draft deadlines and fail-open) over draft and target workers whose
forwards cost what a profile or the roofline model says (:mod:`cluster.planning.costs`).

Structure (after Vidur's: an event heap ordered by time, entities that turn events into new
events). Each scheduler lane is a generator that mirrors ``router.scheduler.TargetScheduler._lane``
and ``_round`` step by step: it yields the simulated time at which it continues (or ``PARK`` to
wait for the scheduler's wake-up). A worker is a FIFO resource, like the worker client's lock that
serialises batch RPCs: a call reserves it from max(now, free) for its duration. Every decision is
made by :class:`cluster.planning.policies.RouterPolicy`, i.e. by the router's own functions.

Acceptance comes from each request's :class:`~cluster.planning.workload.AcceptanceModel`; token
ids are placeholders and each request ends after its output length, as the requests of
`specdec bench serve` do at max_tokens.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import random
from collections import deque
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any

from cluster.planning.costs import Costs
from cluster.planning.policies import RouterPolicy, Telemetry
from cluster.planning.workload import SimRequestSpec, WorkloadError
from specdec.bench.serve import summarize
from specdec.core.prefill_plan import PrefillNeed
from specdec.core.request_state import RequestState

log = logging.getLogger(__name__)

__all__ = ["Deployment", "SimResult", "simulate"]

PARK = None  # what a lane yields to wait for its scheduler's wake-up


@dataclass
class Deployment:
    """What runs: ``groups`` target groups (one scheduler each) and ``drafts`` draft workers (group g
    drafts on worker g % drafts; 0 = no draft worker), with the router's config."""

    costs: Costs
    policy: RouterPolicy
    groups: int = 1
    drafts: int = 1
    target_slots: int = 8
    draft_slots: int = 8
    max_context: int = 4096
    colocated: bool = False  # one device for the draft and the target (a CPU machine): their work serialises
    mode: str = "auto"  # what each request asks for: auto | draft | ngram | off


class _Worker:
    """A worker that runs one batch RPC at a time, in the order they are sent."""

    def __init__(self) -> None:
        self.free_at = 0.0
        self.busy = 0.0

    def reserve(self, now: float, duration: float) -> tuple[float, float]:
        start = max(now, self.free_at)
        self.free_at = start + duration
        self.busy += duration
        return start, self.free_at


@dataclass
class _PreDraft:
    end: float  # when the pre-draft Propose returns
    k: int  # draft tokens it holds after the guessed bonus token


@dataclass(eq=False)
class _Job:
    spec_in: SimRequestSpec
    key: str
    state: RequestState
    spec: str
    auto: bool
    t_arrival: float
    t_first: float | None = None
    t_last: float | None = None
    t_end: float | None = None
    in_flight: bool = False
    done: bool = False
    draft_cached: int = 0  # prompt tokens the drafter has cached
    predraft: _PreDraft | None = None
    last_all_accepted: bool = False  # the previous round accepted every draft token ...
    last_bonus_match: bool = False  # ... and the drafter's next token was the target's bonus token
    outcome: tuple[int, int, bool] = (0, 0, False)  # this round: drafted, accepted, bonus match
    error: str | None = None


@dataclass
class _Group:
    index: int
    target: _Worker
    draft: _Worker | None
    capacity: int
    cost: Any  # the router's CostMeter
    waiting: deque = field(default_factory=deque)
    running: list = field(default_factory=list)
    parked: list = field(default_factory=list)
    verify_ema: float | None = None
    late_until: float = -1.0  # a Propose that missed its deadline runs until then
    rounds: int = 0
    batch_rows: int = 0
    split: dict[str, float] = field(default_factory=lambda: dict.fromkeys(("draft_wait", "verify", "router"), 0.0))
    drafted: int = 0
    accepted: int = 0
    fail_open: int = 0
    predraft_hits: int = 0
    predraft_misses: int = 0
    peak_running: int = 0


@dataclass
class SimResult:
    summary: dict[str, Any]  # the same fields as `specdec bench serve`'s summary of a scenario
    records: list[dict[str, Any]]
    wall_s: float
    utilization: dict[str, float]  # busy fraction of the wall: target, draft (means over workers)
    mean_batch: float
    split: dict[str, float]  # ms per round, as bench serve's: draft_wait, verify, router
    rejected: int  # queue full
    unfinished: int  # still running when the time limit hit (an overloaded deployment)
    predraft_hit_rate: float | None
    peak_running: int  # the most requests one target ran at once (below max_batch: the cap never bound)


class _Sim:
    def __init__(self, dep: Deployment, requests: list[SimRequestSpec], seed: int, time_limit: float, closed: int):
        self.dep, self.P, self.costs = dep, dep.policy, dep.costs
        self.rng = random.Random(seed)
        self.now = 0.0
        self.limit = time_limit
        self._heap: list = []
        self._seq = itertools.count()
        drafts = [_Worker() for _ in range(dep.drafts)]
        self.targets = [_Worker() for _ in range(dep.groups)]
        if dep.colocated:
            drafts = [self.targets[i % dep.groups] for i in range(dep.drafts)]
        self.draft_workers = drafts
        self.groups = [
            _Group(
                i,
                self.targets[i],
                drafts[i % len(drafts)] if drafts else None,
                self.P.capacity(dep.target_slots, dep.draft_slots if drafts else None),
                self.P.new_cost_meter(),
            )
            for i in range(dep.groups)
        ]
        self.requests = requests
        self.closed = closed
        self._next = 0  # closed loop: the next request a client sends
        self.jobs: list[_Job] = []
        self.rejected = 0

    # ---- the kernel ----------------------------------------------------------------------------
    def at(self, t: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), fn))

    def _step(self, gen: Generator, group: _Group) -> None:
        try:
            t = next(gen)
        except StopIteration:
            return
        if t is PARK:
            group.parked.append(gen)
        else:
            self.at(max(t, self.now), lambda: self._step(gen, group))

    def _wake(self, g: _Group) -> None:
        parked, g.parked = g.parked, []
        for gen in parked:
            self.at(self.now, lambda gen=gen: self._step(gen, g))

    def run(self) -> None:
        if self.closed:
            for _ in range(min(self.closed, len(self.requests))):
                self._send_next()
        else:
            for spec in self.requests:
                self.at(spec.t, lambda spec=spec: self._arrive(spec))
        for g in self.groups:
            for lane in range(self.P.cfg.micro_batches):
                self._step(self._lane(g, lane), g)
        if self.P.rebalance is not None:
            self.at(self.P.rebalance_interval_s, self._rebalance)
        while self._heap:
            t, _, fn = heapq.heappop(self._heap)
            if t > self.limit:
                break
            self.now = t
            fn()
            if len(self.jobs) == len(self.requests) and all(j.done for j in self.jobs):
                break

    def _send_next(self) -> None:
        """Closed loop: a client sends its next request as soon as its last one ends."""
        if self._next < len(self.requests):
            spec = self.requests[self._next]
            self._next += 1
            self.at(self.now, lambda: self._arrive(spec))

    # ---- admission (TargetScheduler.new_job / submit / _admit) ---------------------------------
    def _arrive(self, spec: SimRequestSpec) -> None:
        g = self.groups[self.P.pick_group([len(x.running) + len(x.waiting) for x in self.groups])]
        state, mode, auto = self.P.new_request(
            spec.id, spec.prompt_tokens, spec.output_tokens, self.dep.mode, g.draft is not None, g.index
        )
        drafter = "draft" if mode == "draft" else "ngram"
        if mode != "off" and drafter not in spec.acceptance:
            raise WorkloadError(f"request {spec.id}: no acceptance model for the {drafter} drafter")
        job = _Job(spec, spec.id, state, mode, auto, self.now)
        self.jobs.append(job)
        if len(g.waiting) >= self.P.cfg.max_queue:
            job.done, job.error, job.t_end = True, "RESOURCE_EXHAUSTED: the request queue is full", self.now
            self.rejected += 1
            if self.closed:
                self._send_next()
            return
        g.waiting.append(job)
        self._admit(g)
        self._wake(g)

    def _admit(self, g: _Group) -> None:
        while g.waiting and self.P.can_admit(len(g.running), g.capacity):
            g.running.append(g.waiting.popleft())
        g.peak_running = max(g.peak_running, len(g.running))

    def _take(self, g: _Group, lane: int) -> list[_Job]:
        self._admit(g)
        ready = [j for j in g.running if not j.in_flight and not j.done]
        if not ready:
            return []
        share = self.P.lane_share(len(g.running), lane)
        if share == 0:
            return []
        batch = ready[:share]
        for j in batch:
            j.in_flight = True
        return batch

    def _lane(self, g: _Group, lane: int) -> Generator:
        while True:
            batch = self._take(g, lane)
            if not batch:
                yield PARK
                continue
            yield from self._round(g, batch)
            for j in batch:
                j.in_flight = False
            self._wake(g)

    # ---- a round (TargetScheduler._round) ------------------------------------------------------
    def _want_k(self, g: _Group, j: _Job) -> int:
        return self.P.want_k(j.spec, j.auto, len(g.running), j.state, self.dep.max_context, g.cost)

    def _round(self, g: _Group, batch: list[_Job]) -> Generator:
        c = self.costs
        t_round = self.now
        decoding = [j for j in batch if not j.state.prefilling]
        ks = [self._want_k(g, j) for j in decoding]
        cached = yield from self._prefill(g, batch, sum(k + 1 for k in ks))
        batch = decoding + cached
        ks += [self._want_k(g, j) for j in cached]
        if not batch:
            return
        prefills = any(not j.state.generated for j in batch)
        t0 = self.now
        drafted = yield from self._drafts(g, batch, ks)
        draft_wait = self.now - t0
        self._launch_predraft(g, batch, ks, drafted)
        router = c.router_s(len(batch))
        width = max(d + 1 for d in drafted)
        context = max(len(j.state.tokens) for j in batch)
        _, end = g.target.reserve(self.now + router, c.verify_rpc_s + c.verify_s(len(batch), width, context))
        t1 = self.now + router
        yield end
        dt = end - t1
        g.verify_ema = dt if g.verify_ema is None else 0.8 * g.verify_ema + 0.2 * dt
        steps = max((d for j, d in zip(batch, drafted) if j.spec == "draft"), default=0)
        if not prefills:
            g.cost.update(draft_wait, steps, dt, sum(d + 1 for d in drafted))
        g.rounds += 1
        g.batch_rows += len(batch)
        g.split["draft_wait"] += draft_wait
        g.split["verify"] += dt
        g.split["router"] += (end - t_round) - draft_wait - dt  # as the router's metric: prefill included
        for j, d in zip(batch, drafted):
            self._commit(g, j, d)

    def _prefill(self, g: _Group, batch: list[_Job], verify_tokens: int) -> Generator:
        prefilling = [j for j in batch if j.state.prefilling]
        needs = [PrefillNeed(j.key, j.state.prefilled, j.state.prefill_total) for j in prefilling]
        plan = self.P.plan_prefill(needs, verify_tokens)
        chunks = [j for j in prefilling if j.key in plan]
        if not chunks:
            return []
        if g.draft is not None:  # the drafter caches the same chunks, unawaited (not a prompt's last one)
            for j in chunks:
                if j.spec == "draft" and plan[j.key] < j.state.prefill_total:
                    cost = self.costs.draft_prefill_s(plan[j.key] - j.draft_cached)
                    g.draft.reserve(self.now, self.costs.draft_rpc_s + cost)
                    j.draft_cached = plan[j.key]
        width = max(plan[j.key] - j.state.prefilled for j in chunks)
        context = max(j.state.prefilled for j in chunks)
        _, end = g.target.reserve(self.now, self.costs.verify_rpc_s + self.costs.prefill_s(len(chunks), width, context))
        yield end
        for j in chunks:
            j.state.prefilled = plan[j.key]
        return [j for j in chunks if not j.state.prefilling and not j.done]

    def _sample(self, j: _Job, k: int) -> int:
        model = j.spec_in.acceptance["draft" if j.spec == "draft" else "ngram"]
        j.outcome = model.sample(k, self.rng)
        return j.outcome[0]

    def _fail_open(self, g: _Group, j: _Job) -> None:
        j.state.stats.fail_open_rounds += 1
        g.fail_open += 1

    def _drafts(self, g: _Group, batch: list[_Job], ks: list[int]) -> Generator:
        """DraftSource.drafts: tokens drafted per job (0 when failing open)."""
        drafted = [0] * len(batch)
        for j in batch:
            j.outcome = (0, 0, False)
        remote, pending = [], []
        for i, (j, k) in enumerate(zip(batch, ks)):
            pd, j.predraft = j.predraft, None
            if k <= 0:
                continue
            if j.spec == "ngram":
                drafted[i] = self._sample(j, k)
            elif j.spec == "draft":
                if g.draft is None:
                    self._fail_open(g, j)
                elif pd is not None and j.last_all_accepted:
                    pending.append((i, pd))
                else:
                    if pd is not None:
                        g.predraft_misses += 1
                    remote.append(i)
        if not remote and not pending:
            return drafted
        assert g.draft is not None
        t_end = self.now + self.P.draft_deadline(g.verify_ema, max(ks))
        for i, pd in pending:
            j = batch[i]
            if pd.end > t_end:
                yield t_end
                g.late_until = max(g.late_until, pd.end)
                hit = False
            else:
                yield pd.end
                hit = j.last_bonus_match and pd.k > 0
            if hit:
                drafted[i] = self._sample(j, min(ks[i], pd.k))
                g.predraft_hits += 1
            else:
                g.predraft_misses += 1
                remote.append(i)
        if remote:
            late = g.late_until > self.now
            start = max(self.now, g.draft.free_at)
            if late or start > t_end:  # still busy with a late draft, or queued past the deadline: never sent
                yield t_end if not late else self.now
                ok = False
            else:
                k_max = max(ks[i] for i in remote)
                uncached = sum(batch[i].state.prefill_total + 1 - batch[i].draft_cached for i in remote)
                context = max(len(batch[i].state.tokens) for i in remote)
                dur = self.costs.draft_rpc_s + self.costs.draft_s(len(remote), k_max, context)
                dur += self.costs.draft_prefill_s(uncached) if uncached > 0 else 0.0
                _, end = g.draft.reserve(self.now, dur)
                for i in remote:
                    batch[i].draft_cached = batch[i].state.prefill_total + 1
                ok = end <= t_end
                if not ok:
                    g.late_until = end
                yield min(end, t_end)
            for i in remote:
                if ok:
                    drafted[i] = self._sample(batch[i], ks[i])
                else:
                    self._fail_open(g, batch[i])
        return drafted

    def _launch_predraft(self, g: _Group, batch: list[_Job], ks: list[int], drafted: list[int]) -> None:
        """DraftSource.launch_predraft: draft round r+1 on the all-accepted guess during the verify."""
        if not self.P.cfg.predraft or g.draft is None:
            return
        picked = []
        for j, k, d in zip(batch, ks, drafted):
            if j.spec != "draft" or k <= 0 or d != k:
                continue
            k_next = self.P.predraft_k(j.state, k, self.dep.max_context)
            if k_next > 0:
                picked.append((j, k_next))
        if not picked:
            return
        k_max = max(k for _, k in picked)
        context = max(len(j.state.tokens) for j, _ in picked)
        _, end = g.draft.reserve(self.now, self.costs.draft_rpc_s + self.costs.draft_s(len(picked), k_max + 1, context))
        for j, k_next in picked:
            j.predraft = _PreDraft(end, k_next)

    def _commit(self, g: _Group, j: _Job, k: int) -> None:
        """TargetScheduler._commit through the request's real stop rules and adaptive k."""
        if j.done:
            return
        d, a, bonus = j.outcome if k > 0 else (0, 0, False)
        committed = j.state.commit([0] * (a + 1), a, d, self.dep.max_context)
        g.drafted += d
        g.accepted += min(a, len(committed))
        j.last_all_accepted = d > 0 and a == d
        j.last_bonus_match = bonus
        if committed:
            if j.t_first is None:
                j.t_first = self.now
            j.t_last = self.now
        if j.state.finish_reason is not None:
            j.done = True
            j.t_end = self.now
            g.running.remove(j)
            if self.closed:
                self._send_next()

    # ---- rebalancing ---------------------------------------------------------------------------
    def _rebalance(self) -> None:
        dt = self.P.rebalance_interval_s
        snap = []
        for g in self.groups:
            snap.append(
                Telemetry(
                    group=g.index,
                    t=self.now,
                    running=len(g.running),
                    waiting=len(g.waiting),
                    target_busy=min(1.0, g.target.busy / max(self.now, 1e-9)),
                    draft_busy=min(1.0, g.draft.busy / max(self.now, 1e-9)) if g.draft else 0.0,
                    cost_c=g.cost.c,
                    acceptance=g.accepted / g.drafted if g.drafted else 0.0,
                    k_max=self.P._kpolicy.get(g.index, self.P.cfg.k_policy).k_max,
                )
            )
        self.P.apply_rebalance(snap)
        if any(not j.done for j in self.jobs) or len(self.jobs) < len(self.requests):
            self.at(self.now + dt, self._rebalance)

    # ---- results -------------------------------------------------------------------------------
    def result(self) -> SimResult:
        records = []
        for j in self.jobs:
            st = j.state
            records.append(
                {
                    "id": j.key,
                    "mode": self.dep.mode,
                    "t_start": j.t_arrival,
                    "t_first": j.t_first,
                    "t_last": j.t_last,
                    "t_end": j.t_end if j.t_end is not None else self.now,
                    "tokens": len(st.generated),
                    "stats": st.stats.as_dict(),
                    "finish_reason": st.finish_reason,
                    "error": j.error or (None if j.done else "unfinished: the deployment fell behind its arrivals"),
                }
            )
        wall = max((r["t_end"] for r in records), default=0.0)  # from time 0, as bench serve's clock
        rounds = sum(g.rounds for g in self.groups)
        split = {
            f"{k}_ms_per_round": round(1e3 * sum(g.split[k] for g in self.groups) / rounds, 3) if rounds else 0.0
            for k in ("draft_wait", "verify", "router")
        }
        split["rounds"] = rounds
        hits = sum(g.predraft_hits for g in self.groups)
        misses = sum(g.predraft_misses for g in self.groups)
        span = max(self.now, 1e-9)
        util = {"target": sum(w.busy for w in self.targets) / len(self.targets) / span}
        if self.draft_workers and not self.dep.colocated:
            util["draft"] = sum(w.busy for w in self.draft_workers) / len(self.draft_workers) / span
        summary = summarize(records, wall)
        summary["split"] = split
        return SimResult(
            summary=summary,
            records=records,
            wall_s=wall,
            utilization={k: round(min(v, 1.0), 4) for k, v in util.items()},
            mean_batch=round(sum(g.batch_rows for g in self.groups) / rounds, 3) if rounds else 0.0,
            split=split,
            rejected=self.rejected,
            unfinished=sum(not j.done for j in self.jobs) + len(self.requests) - len(self.jobs),
            predraft_hit_rate=round(hits / (hits + misses), 3) if hits + misses else None,
            peak_running=max(g.peak_running for g in self.groups),
        )


def simulate(
    dep: Deployment,
    requests: list[SimRequestSpec],
    seed: int = 0,
    time_limit: float | None = None,
    closed: int = 0,
) -> SimResult:
    """Run the requests through the deployment: at their arrival times, or with ``closed`` > 0 as
    that many clients that each send the next request when their last one ends (arrival times
    ignored). ``time_limit`` (simulated s; default: the last arrival plus ten minutes) ends a run
    that cannot keep up: its unfinished requests count as errors."""
    if not requests:
        raise WorkloadError("no requests to simulate")
    if dep.groups < 1 or dep.drafts < 0:
        raise WorkloadError("a deployment needs at least one target group")
    if time_limit is None:
        time_limit = 600.0 + (60.0 * len(requests) if closed else max(r.t for r in requests))
    sim = _Sim(dep, requests if closed else sorted(requests, key=lambda r: r.t), seed, time_limit, closed)
    sim.run()
    return sim.result()
