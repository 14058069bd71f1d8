"""A discrete-event simulation of the service: the router's target schedulers (continuous batching,
micro-batch lanes, chunked prefill under the round budget, the k policy and its cost meter, the
goodput gate), its drafting (the shared drafter pool, pre-drafting, draft deadlines and fail-open:
:mod:`cluster.planning.sim_drafting`) and its rebalancer (depth by device load, the speculation
switch by goodput, drafter placement, routing), over draft and target workers whose forwards cost
what a profile or the roofline model says (:mod:`cluster.planning.costs`).

Structure (after Vidur's: an event heap ordered by time, entities that turn events into new
events). Each scheduler lane is a generator that mirrors ``router.scheduler.TargetScheduler._lane``
and ``_round`` step by step: it yields the simulated time at which it continues, a call to wait for
(or an :class:`~cluster.planning.sim_entities.Until`: calls or a deadline), or ``PARK`` to wait for
the scheduler's wake-up. A worker runs its calls one at a time in the order sent, like the worker
client's lock that serialises batch RPCs; the calls running on one device share it (processor
sharing: a colocated drafter slows its target while both compute). Every decision is
made through :class:`cluster.planning.policies.RouterPolicy`, i.e. by the router's own code; the
rebalancer's telemetry tick runs every ``rebalance.period_s`` with each device's busy fraction as
its load.

Acceptance comes from each request's :class:`~cluster.planning.workload.AcceptanceModel`; token
ids are placeholders and each request ends after its output length, as the requests of
`specdec bench serve` do at max_tokens.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import random
from collections.abc import Callable, Generator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from cluster.planning.costs import Costs
from cluster.planning.policies import RouterPolicy
from cluster.planning.sim_drafting import SimDrafting
from cluster.planning.sim_entities import Call, ClosedLoopClients, Device, Group, Job, SimClient, Until, Worker
from cluster.planning.workload import SimRequestSpec, WorkloadError
from specdec.bench.serve import summarize
from specdec.core.prefill_plan import PrefillNeed

log = logging.getLogger(__name__)

__all__ = ["RouterMemory", "Deployment", "SimResult", "simulate"]

PARK = None  # what a lane yields to wait for its scheduler's wake-up


@dataclass
class Deployment:
    """What runs: ``groups`` target groups (one scheduler each) and ``drafts`` draft workers (one
    pool shared by every group; group g's own drafter is g mod drafts; 0 = no draft worker), with
    the router's config."""

    costs: Costs
    policy: RouterPolicy
    groups: int = 1
    drafts: int = 1
    target_slots: int = 8
    draft_slots: int = 8
    max_context: int = 4096
    colocated: bool = False  # one device for the draft and the target (a CPU machine): they share it
    mode: str = "auto"  # what each request asks for: auto | draft | ngram | off
    # The service's own spread of a call's time: each call's work times exp(N(0, jitter)), drawn
    # from the run's seed. The router's k reads measured times, so the spread moves its k, and a
    # greedy request's path with it; without it the draws of greedy requests never differ.
    jitter: float = 0.0


@dataclass
class RouterMemory:
    """What the router has learned that outlives a run's requests: per target group its verify
    cost meter, pooled acceptance and draft-wait share, and per drafter its measured wait line
    (with its age). A service serves a benchmark's scenarios one after the other with one router;
    passing one run's memory to the next simulates that (ages go on from the end of the run)."""

    costs: list[Any]
    pools: list[tuple[float, float]]
    wait_shares: list[float]
    drafters: dict[str, tuple]


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
    rebalance_actions: dict[str, float]  # what the router's rebalancer did (its counters)
    memory: RouterMemory | None = None  # the router's state at the end (for the next run)


class _Sim:
    def __init__(
        self,
        dep: Deployment,
        requests: list[SimRequestSpec],
        seed: int,
        time_limit: float,
        closed: int,
        memory: RouterMemory | None = None,
    ):
        self.dep, self.P, self.costs = dep, dep.policy, dep.costs
        self.rng = random.Random(seed)
        spread = random.Random(seed + 7919)  # its own stream: the acceptance draws stay as without it
        noise = (lambda: math.exp(spread.gauss(0.0, dep.jitter))) if dep.jitter > 0 else None
        self.now = 0.0
        self.limit = time_limit
        self._heap: list = []
        self._seq = itertools.count()
        clock = self.clock
        P = self.P
        self.targets = [
            SimClient(f"target-{i}", "target", Worker(Device(self.at, clock)), dep.target_slots, noise=noise)
            for i in range(dep.groups)
        ]
        self.pool = P.new_pool(clock) if dep.drafts else None
        drafters: dict[str, SimClient] = {}
        for i in range(dep.drafts):
            # colocated: the draft model runs on its target's device, and they share it
            device = self.targets[i % dep.groups].worker.device if dep.colocated else Device(self.at, clock)
            drafters[f"draft-{i}"] = SimClient(f"draft-{i}", "draft", Worker(device), dep.draft_slots, noise=noise)
            self.pool.add(drafters[f"draft-{i}"])
        self.drafting = SimDrafting(self, drafters)
        static = not P.cfg.rebalance.enabled
        self.groups = []
        for i, t in enumerate(self.targets):
            home = f"draft-{i % dep.drafts}" if dep.drafts else None
            g = Group(
                index=i,
                target=t,
                home=home,
                capacity=P.capacity(dep.target_slots, dep.draft_slots if home and static else None),
                cost=P.new_cost_meter(),
                cfg=P.cfg,
                metrics=P.metrics,
                drafting=SimpleNamespace(pool=self.pool),
            )
            g.balance = P.new_balance(g, clock)
            if memory is not None and i < len(memory.costs):
                g.cost = memory.costs[i]
                g.balance.pool, g.balance.wait_share = memory.pools[i], memory.wait_shares[i]
            self.groups.append(g)
        if memory is not None and self.pool is not None:
            self.pool.restore(memory.drafters, self.now)
        self.requests = requests
        self.closed = closed
        self.clients = ClosedLoopClients(requests)
        self.jobs: list[Job] = []
        self.rejected = 0

    def clock(self) -> float:
        return self.now

    # ---- the kernel ----------------------------------------------------------------------------
    def at(self, t: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), fn))

    def _step(self, gen: Generator, group: Group) -> None:
        try:
            t = next(gen)
        except StopIteration:
            return
        resume = lambda: self._step(gen, group)  # noqa: E731
        if t is PARK:
            group.parked.append(gen)
        elif isinstance(t, Call):
            t.on_done(lambda: self.at(self.now, resume))
        elif isinstance(t, Until):
            self._until(t, resume)
        else:
            self.at(max(t, self.now), resume)

    def _until(self, u: Until, resume: Callable[[], None]) -> None:
        """Resume once every call in ``u`` is done or at ``u.t``, whichever comes first (once)."""
        fired = False

        def go() -> None:
            nonlocal fired
            if not fired:
                fired = True
                self.at(self.now, resume)

        pending = [c for c in u.calls if not c.done]
        left = len(pending)

        def one() -> None:
            nonlocal left
            left -= 1
            if left == 0:
                go()

        if not pending:
            go()
            return
        self.at(max(u.t, self.now), go)
        for c in pending:
            c.on_done(one)

    def _wake(self, g: Group) -> None:
        parked, g.parked = g.parked, []
        for gen in parked:
            self.at(self.now, lambda gen=gen: self._step(gen, g))

    def _all_done(self) -> bool:
        return len(self.jobs) == len(self.requests) and all(j.done for j in self.jobs)

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
        period = self.P.rebalance_period_s
        if period:
            self.at(period, self._tick)
        while self._heap:
            t, _, fn = heapq.heappop(self._heap)
            if t > self.limit:
                break
            self.now = t
            fn()
            if self._all_done():
                break

    def _send_next(self) -> None:
        """Closed loop: a client sends its next request as soon as its last one ends."""
        sent = self.clients.send(self.now)
        if sent is not None:
            spec, t = sent
            self.at(t, lambda: self._arrive(spec))

    # ---- admission (Router.pick, TargetScheduler.new_job / submit / _admit) ------------------
    def _arrive(self, spec: SimRequestSpec) -> None:
        g = self.groups[self.P.pick_target([x.balance.view() for x in self.groups])]
        state, mode, auto = self.P.new_request(
            spec.id, spec.prompt_tokens, spec.output_tokens, self.dep.mode, self.pool is not None
        )
        drafter = "draft" if mode == "draft" else "ngram"
        if mode != "off" and drafter not in spec.acceptance:
            raise WorkloadError(f"request {spec.id}: no acceptance model for the {drafter} drafter")
        job = Job(spec, spec.id, state, mode, auto, self.now)
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

    def _admit(self, g: Group) -> None:
        while g.waiting and self.P.can_admit(len(g.running), g.capacity):
            g.running.append(g.waiting.popleft())
        g.peak_running = max(g.peak_running, len(g.running))

    def _take(self, g: Group, lane: int) -> list[Job]:
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

    def _lane(self, g: Group, lane: int) -> Generator:
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
    def _want_k(self, g: Group, j: Job) -> int:
        return g.balance.want_k(j, len(g.running), self.dep.max_context)

    def _round(self, g: Group, batch: list[Job]) -> Generator:
        c = self.costs
        t_round = self.now
        if any(not j.spec_planned for j in g.running):
            g.balance.start(g.running, [self._want_k(g, j) for j in g.running])
        decoding = [j for j in batch if not j.state.prefilling]
        ks = [self._want_k(g, j) for j in decoding]
        tp = self.now
        cached = yield from self._prefill(g, batch, sum(k + 1 for k in ks))
        prefill = self.now - tp
        batch = decoding + cached
        ks += [self._want_k(g, j) for j in cached]
        if not batch:
            return
        prefills = any(not j.state.generated for j in batch)
        ks = g.balance.speculation(batch, ks)
        t0 = self.now
        drafted = yield from self.drafting.drafts(g, batch, ks)
        draft_wait = self.now - t0
        self.drafting.launch_predraft(g, batch, ks, drafted, g.balance.predraft)
        router = c.router_s(len(batch))
        # The target's GEMMs run over the rows' tokens packed (runner.forward), so a round costs what
        # the profile's uniform rows of the mean width cost, not the widest row times the batch.
        width = sum(d + 1 for d in drafted) / len(batch)
        context = max(len(j.state.tokens) for j in batch)
        t1 = self.now + router
        call = g.target.submit(c.verify_rpc_s + c.verify_s(len(batch), width, context), at=t1)
        yield call
        end = call.end
        dt = end - t1
        g.verify_ema = dt if g.verify_ema is None else 0.8 * g.verify_ema + 0.2 * dt
        g.balance.log_round(batch, ks, drafted, draft_wait, dt)
        steps = max((d for j, d in zip(batch, drafted) if j.spec == "draft"), default=0)
        if not prefills:  # the worker's compute, as the scheduler reads it
            g.cost.update(draft_wait, steps, end - call.start, sum(d + 1 for d in drafted))
        g.rounds += 1
        g.batch_rows += len(batch)
        g.split["draft_wait"] += draft_wait
        g.split["verify"] += dt
        g.split["prefill"] += prefill
        g.split["router"] += (end - t_round) - draft_wait - dt - prefill
        for j, d in zip(batch, drafted):
            self._commit(g, j, d)
        g.balance.observe_round(draft_wait, end - t_round)

    def _prefill(self, g: Group, batch: list[Job], verify_tokens: int) -> Generator:
        prefilling = [j for j in batch if j.state.prefilling]
        if not prefilling:  # most rounds: no budget to work out
            return []
        needs = [PrefillNeed(j.key, j.state.prefilled, j.state.prefill_total) for j in prefilling]
        plan = self.P.plan_prefill(needs, verify_tokens, g.balance.prefill_budget(batch))
        chunks = [j for j in prefilling if j.key in plan]
        if not chunks:
            return []
        self.drafting.prefill(g, chunks, plan)
        width = max(plan[j.key] - j.state.prefilled for j in chunks)
        context = max(j.state.prefilled for j in chunks)
        cost = self.costs.verify_rpc_s + self.costs.prefill_s(len(chunks), width, context)
        yield g.target.submit(cost)
        for j in chunks:
            j.state.prefilled = plan[j.key]
        return [j for j in chunks if not j.state.prefilling and not j.done]

    def sample(self, j: Job, k: int) -> int:
        """Draft ``k`` tokens for ``j``: how many the drafter proposes, how many the target accepts
        (its first round from the model's first-round part, where the profile has one; a greedy
        path's from where the request stands)."""
        model = j.spec_in.acceptance["draft" if j.spec == "draft" else "ngram"]
        if model.first is not None and not j.state.generated:
            model = model.first
        j.outcome = model.sample(k, self.rng, len(j.state.generated))
        return j.outcome[0]

    def _commit(self, g: Group, j: Job, k: int) -> None:
        """TargetScheduler._commit through the request's real stop rules and adaptive k."""
        if j.done:
            return
        d, a, bonus = j.outcome if k > 0 else (0, 0, False)
        committed = j.state.commit([0] * (a + 1), a, d, self.dep.max_context)
        g.balance.observe_outcome(d, a)
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
            if self.pool is not None:
                self.pool.forget(j)
            if self.closed:
                self._send_next()

    # ---- the rebalancer's clock (router/rebalancer.py) -------------------------------------------
    def _tick(self) -> None:
        """Telemetry: each worker's busy fraction over the period (its own calls' compute within it)
        as its load; then every target's depth is re-planned by the router's own code."""
        period = self.P.rebalance_period_s or 1.0
        for c in self.targets + list(self.drafting.drafters.values()):
            c.telemetry.load = min(1.0, max(0.0, c.busy_in(self.now - period, self.now) / period))
        for g in self.groups:
            g.balance.update_depth(self.now)
        if not self._all_done():
            self.at(self.now + period, self._tick)

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
            for k in ("draft_wait", "verify", "prefill", "router")
        }
        split["rounds"] = rounds
        split.update(self.drafting.prefill_split())
        hits = sum(g.predraft_hits for g in self.groups)
        misses = sum(g.predraft_misses for g in self.groups)
        span = max(self.now, 1e-9)
        util = {"target": sum(c.worker.busy for c in self.targets) / len(self.targets) / span}
        drafters = list(self.drafting.drafters.values())
        if drafters and not self.dep.colocated:
            util["draft"] = sum(c.worker.busy for c in drafters) / len(drafters) / span
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
            rebalance_actions=_counters(self.P.metrics.rebalance_actions),
            memory=RouterMemory(
                costs=[g.cost for g in self.groups],
                pools=[g.balance.pool for g in self.groups],
                wait_shares=[g.balance.wait_share for g in self.groups],
                drafters=self.pool.measurements(self.now) if self.pool is not None else {},
            ),
        )


def _counters(counter: Any) -> dict[str, float]:
    """A labelled Prometheus counter's values by label (the router's rebalance actions)."""
    out: dict[str, float] = {}
    for fam in counter.collect():
        for sample in fam.samples:
            if sample.name.endswith("_total"):
                out[next(iter(sample.labels.values()), "")] = sample.value
    return out


def simulate(
    dep: Deployment,
    requests: list[SimRequestSpec],
    seed: int = 0,
    time_limit: float | None = None,
    closed: int = 0,
    memory: RouterMemory | None = None,
) -> SimResult:
    """Run the requests through the deployment: at their arrival times, or with ``closed`` > 0 as
    that many clients that each send the next request when their last one ends (arrival times
    ignored). ``time_limit`` (simulated s; default: the last arrival plus ten minutes) ends a run
    that cannot keep up: its unfinished requests count as errors. ``memory``: the router's state
    after an earlier run (SimResult.memory; None = a fresh router)."""
    if not requests:
        raise WorkloadError("no requests to simulate")
    if dep.groups < 1 or dep.drafts < 0:
        raise WorkloadError("a deployment needs at least one target group")
    if time_limit is None:
        time_limit = 600.0 + (60.0 * len(requests) if closed else max(r.t for r in requests))
    sim = _Sim(dep, requests if closed else sorted(requests, key=lambda r: r.t), seed, time_limit, closed, memory)
    sim.run()
    return sim.result()
