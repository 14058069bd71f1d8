"""A simulation of the service that runs the router's own code: its target schedulers
(``router.scheduler.TargetScheduler``: continuous batching, micro-batch lanes, chunked prefill,
the k policy, the goodput gate, the speculation switch, commits through the stop rules), its
drafting (``router.drafting.DraftSource`` over the shared ``router.drafter_pool.DrafterPool``:
pre-drafting, draft deadlines, fail-open), its target link and its telemetry loop
(``router.telemetry_loop.TelemetryLoop``: device load polls, depth by load), over simulated
workers whose calls cost what a profile or the roofline model says
(:mod:`cluster.planning.sim_workers`).

Everything runs on an event loop whose clock is simulated time
(:mod:`cluster.planning.virtual_loop`): a run takes the Python time of the router's decisions, not
the workload's seconds. What differs from the service is only what cannot run here: the workers
(costs and acceptance models instead of models), the clients (requests are submitted to the
schedulers as the public servicer does after its checks, at their arrival times or as closed-loop
clients), and token ids (placeholders; see :mod:`cluster.planning.sim_workers`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
from dataclasses import dataclass
from typing import Any

from prometheus_client import generate_latest

from cluster.planning.costs import Costs
from cluster.planning.devices import Device
from cluster.planning.sim_clients import ClosedLoopClients
from cluster.planning.sim_trees import SimTrees
from cluster.planning.sim_workers import Outcomes, SimNgram, SimTargetLink, SimWorker, jitter
from cluster.planning.virtual_loop import VirtualClockLoop
from cluster.planning.workload import SimRequestSpec, WorkloadError
from router.config import RouterConfig
from router.draft_depth import is_catch_up
from router.drafter_pool import DrafterPool
from router.jobs import Job, QueueFull
from router.metrics import Metrics
from router.scheduler import TargetScheduler
from router.target_choice import pick_target
from router.telemetry_loop import TelemetryLoop
from specdec.bench.serve import summarize
from specdec.bench.serve_metrics import parse_metrics, phase_split
from specdec.core.params import SamplingParams, VerifyMode

__all__ = ["RouterMemory", "Deployment", "SimResult", "simulate"]


def _no_text(ids: list[int]) -> str:
    return ""


@dataclass
class Deployment:
    """What runs: ``groups`` target groups (one scheduler each) and ``drafts`` draft workers (one
    pool shared by every group; group g's own drafter is g mod drafts; 0 = no draft worker), with
    the router's config."""

    costs: Costs
    router: RouterConfig
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
    # The draft worker drafts token trees of this shape (its --tree-* options), runners-up accepted
    # as sim_trees.py says; None: chains.
    trees: SimTrees | None = None


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
    split: dict[str, Any]  # per round, as bench serve's from the router's metrics: draft_wait, verify, ...
    rejected: int  # queue full
    unfinished: int  # still running when the time limit hit (an overloaded deployment)
    predraft_hit_rate: float | None
    peak_running: int  # the most requests one target ran at once (below max_batch: the cap never bound)
    rebalance_actions: dict[str, float]  # what the router's rebalancer did (its counters)
    memory: RouterMemory | None = None  # the router's state at the end (for the next run)
    # With trees: their rounds' nodes and accepted tokens beside the acceptance model's expectation
    # (sim_trees.TreeTally), and the router's own histogram of the nodes it verified (its
    # specdec_draft_tree_nodes: cumulative counts by upper bound, after its TreeSizer's cut)
    trees: dict[str, Any] | None = None


class _Run:
    """One simulation: the router's objects over simulated workers, and the requests' records."""

    def __init__(self, dep: Deployment, requests: list[SimRequestSpec], seed: int, closed: int):
        self.dep, self.requests, self.closed = dep, requests, closed
        # A simulated request's tokens are placeholders, so no n-gram guess can be scored: AUTO
        # requests draft by their draft model or not at all here (router/ngram_fallback.py).
        off = dataclasses.replace(dep.router.speculation_off, ngram_fallback=False)
        self.cfg = cfg = dataclasses.replace(dep.router, speculation_off=off)
        self.loop = asyncio.get_running_loop()
        self.metrics = Metrics()
        self.outcomes = Outcomes(random.Random(seed), dep.trees)
        noise = jitter(random.Random(seed + 7919), dep.jitter)  # its own stream: the draws stay as without it
        k_max = cfg.k_policy.k_max

        def worker(name: str, role: str, device: Device, slots: int) -> SimWorker:
            return SimWorker(
                name,
                role,
                device,
                slots,
                dep.max_context,
                dep.costs,
                self.outcomes,
                lambda n: is_catch_up(n, k_max),
                noise,
            )

        self.targets = [worker(f"target-{i}", "target", Device(self.loop), dep.target_slots) for i in range(dep.groups)]
        self.drafters = []
        for i in range(dep.drafts):
            # colocated: the draft model runs on its target's device, and they share it
            device = self.targets[i % dep.groups].worker.device if dep.colocated else Device(self.loop)
            self.drafters.append(worker(f"draft-{i}", "draft", device, dep.draft_slots))
        self.pool = DrafterPool(cfg, self.metrics) if self.drafters else None
        for d in self.drafters:
            self.pool.add(d)
        self.schedulers: list[TargetScheduler] = []
        for i, t in enumerate(self.targets):
            home = self.drafters[i % dep.drafts].name if self.drafters else None
            s = TargetScheduler(t.name, t, self.pool, home, cfg, self.metrics, _no_text)  # type: ignore[arg-type]
            s.drafting.ngram = SimNgram(self.outcomes)  # type: ignore[assignment]
            s.link = SimTargetLink(s.link, dep.costs)
            self.schedulers.append(s)
        self.telemetry = (
            TelemetryLoop(lambda: self.targets + self.drafters, lambda: self.schedulers, cfg.rebalance, self.metrics)
            if cfg.rebalance.enabled
            else None
        )
        self.clients = ClosedLoopClients(requests)
        self.records: list[dict[str, Any]] = []
        self.open: dict[str, tuple[Job, dict[str, Any]]] = {}  # by record id: requests not ended yet
        self.rejected = 0
        self.finished = 0
        self.all_done = asyncio.Event()
        self.error: Exception | None = None  # a bad workload, found on arrival

    def restore(self, memory: RouterMemory) -> None:
        for s, cost, pool, share in zip(self.schedulers, memory.costs, memory.pools, memory.wait_shares):
            s.cost, s.balance.pool, s.balance.wait_share = cost, pool, share
        if self.pool is not None:
            self.pool.restore(memory.drafters, self.loop.time())

    def memory(self) -> RouterMemory:
        return RouterMemory(
            costs=[s.cost for s in self.schedulers],
            pools=[s.balance.pool for s in self.schedulers],
            wait_shares=[s.balance.wait_share for s in self.schedulers],
            drafters=self.pool.measurements(self.loop.time()) if self.pool is not None else {},
        )

    # ---- clients ---------------------------------------------------------------------------------
    def start(self) -> None:
        for s in self.schedulers:
            s.start()
        if self.telemetry is not None:
            self.telemetry.start()
        if self.closed:
            for _ in range(min(self.closed, len(self.requests))):
                self._send_next()
        else:
            for i, spec in enumerate(self.requests):
                self.loop.call_at(spec.t, self._arrive, i, spec)

    def _send_next(self) -> None:
        """Closed loop: a client sends its next request as soon as its last one ends."""
        sent = self.clients.send(self.loop.time())
        if sent is not None:
            index, spec, t = sent
            self.loop.call_at(t, self._arrive, index, spec)

    def _arrive(self, index: int, spec: SimRequestSpec) -> None:
        """What the public servicer does with a request that passed its checks: route it to a
        target (Router.pick) and submit it to that target's scheduler."""
        route = pick_target([s.balance.view() for s in self.schedulers], self.cfg.target_choice)
        if route.around:
            self.metrics.rebalance_actions.labels("route_around").inc()
        sched = self.schedulers[route.index]
        params = SamplingParams(max_tokens=spec.output_tokens, ignore_eos=True)
        prompt = [index] + [0] * (spec.prompt_tokens - 1)  # the index: sim_workers.Outcomes
        job = sched.new_job(spec.id, prompt, params, VerifyMode.GREEDY, self.dep.mode, None, None)
        if job.spec != "off":
            drafter = "draft" if job.spec == "draft" else "ngram"
            if drafter not in spec.acceptance:
                self.error = WorkloadError(f"request {spec.id}: no acceptance model for the {drafter} drafter")
                self.all_done.set()
                return
            self.outcomes.add(index, job.key, spec, drafter)
        record = {"id": spec.id, "mode": self.dep.mode, "t_start": job.t_arrival}
        self.records.append(record)
        self.open[job.key] = (job, record)
        try:
            sched.submit(job)
        except QueueFull as exc:
            record.update(error=f"RESOURCE_EXHAUSTED: {exc}", t_end=self.loop.time())
            self.rejected += 1
            self._done(job, record)
            return
        job.events = _Stream(self, job, record)  # type: ignore[assignment]

    def _done(self, job: Job, record: dict[str, Any]) -> None:
        self._fill(job, record)
        self.finished += 1
        if self.finished == len(self.requests):
            self.all_done.set()
        if self.closed:
            self._send_next()

    def _fill(self, job: Job, record: dict[str, Any]) -> None:
        """A request's record as bench serve writes it (once it ended, or at the time limit)."""
        del self.open[job.key]
        st = job.state
        record.update(
            t_first=job.t_first,
            t_last=job.t_last,
            tokens=len(st.generated),
            stats=st.stats.as_dict(),
            finish_reason=st.finish_reason,
        )
        record.setdefault("error", None)

    async def stop(self) -> None:
        """End every task the router started (lanes, background calls, the telemetry loop)."""
        me = asyncio.current_task()
        tasks = [t for t in asyncio.all_tasks() if t is not me]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # ---- results --------------------------------------------------------------------------------
    def result(self) -> SimResult:
        now = self.loop.time()
        unfinished = len(self.open) + len(self.requests) - len(self.records)  # running, or never sent
        for job, record in list(self.open.values()):
            record.update(t_end=now, error="unfinished: the deployment fell behind its arrivals")
            self._fill(job, record)
        wall = max((r["t_end"] for r in self.records), default=0.0)  # from time 0, as bench serve's clock
        split = phase_split({}, parse_metrics(generate_latest(self.metrics.registry).decode())) or {"rounds": 0}
        span = max(now, 1e-9)
        util = {"target": sum(t.worker.busy for t in self.targets) / len(self.targets) / span}
        if self.drafters and not self.dep.colocated:
            util["draft"] = sum(d.worker.busy for d in self.drafters) / len(self.drafters) / span
        summary = summarize(self.records, wall)
        summary["split"] = split
        batches = self.metrics.batch_size.collect()[0].samples
        rows = next((s.value for s in batches if s.name.endswith("_sum")), 0.0)
        rounds = next((s.value for s in batches if s.name.endswith("_count")), 0.0)
        return SimResult(
            summary=summary,
            records=self.records,
            wall_s=wall,
            utilization={k: round(min(v, 1.0), 4) for k, v in util.items()},
            mean_batch=round(rows / rounds, 3) if rounds else 0.0,
            split=split,
            rejected=self.rejected,
            unfinished=unfinished,
            predraft_hit_rate=split.get("predraft_hit_rate"),
            peak_running=max(s.peak_running for s in self.schedulers),
            rebalance_actions=_counters(self.metrics.rebalance_actions),
            memory=self.memory(),
            trees=self._trees(),
        )

    def _trees(self) -> dict[str, Any] | None:
        summary = self.outcomes.tally.summary()
        if summary is None:
            return None
        samples = self.metrics.tree_nodes.collect()[0].samples
        summary["router_nodes_le"] = {
            float(s.labels["le"]): int(s.value) for s in samples if s.name.endswith("_bucket")
        }
        return summary


class _Stream:
    """The client's side of a request's stream, read as each chunk is put: the run records the
    request's end without a task per client."""

    def __init__(self, run: _Run, job: Job, record: dict[str, Any]):
        self.run, self.job, self.record = run, job, record

    def put_nowait(self, event: Any) -> None:
        if isinstance(event, BaseException):
            self.record["error"] = f"{type(event).__name__}: {event}"
        elif event.finish_reason is None:
            return
        self.record["t_end"] = self.run.loop.time()
        self.run._done(self.job, self.record)


def _counters(counter: Any) -> dict[str, float]:
    """A labelled Prometheus counter's non-zero values by label (the router's rebalance actions
    taken; the metrics create every action's series at 0)."""
    out: dict[str, float] = {}
    for fam in counter.collect():
        for sample in fam.samples:
            if sample.name.endswith("_total") and sample.value:
                out[next(iter(sample.labels.values()), "")] = sample.value
    return out


async def _simulate(
    dep: Deployment,
    requests: list[SimRequestSpec],
    seed: int,
    time_limit: float,
    closed: int,
    memory: RouterMemory | None,
) -> SimResult:
    run = _Run(dep, requests, seed, closed)
    if memory is not None:
        run.restore(memory)
    run.start()
    try:
        await asyncio.wait_for(run.all_done.wait(), time_limit)
    except TimeoutError:
        pass
    await run.stop()
    if run.error is not None:
        raise run.error
    return run.result()


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
    loop = VirtualClockLoop()
    try:
        ordered = requests if closed else sorted(requests, key=lambda r: r.t)
        return loop.run_until_complete(_simulate(dep, ordered, seed, time_limit, closed, memory))
    finally:
        loop.close()
