"""``specdec plan``: the cheapest deployment of a device catalog that meets the objectives.

A deployment is target groups (device type x TP degree x count), draft replicas (device type, or
on the target's own GPU, x count), a k policy and a max batch. Each candidate runs through the
simulator (:mod:`cluster.planning.simulator`: the router's own policy) with roofline costs
(:mod:`cluster.planning.costs`) at the workload's arrival rate. The search, as Vidur's capacity
search does for its configurations, looks per configuration for the fewest groups that meet the
objectives, starting from an analytic estimate of one group's capacity; configurations whose
cheapest possible cost already exceeds the best found are not simulated.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from cluster.planning.ahead import Ahead
from cluster.planning.catalog import Catalog, Device, ModelShape
from cluster.planning.costs import RooflineCosts, fits, memory_needed_gb
from cluster.planning.sim_trees import SimTrees
from cluster.planning.simulator import Deployment, SimResult, simulate
from cluster.planning.workload import AcceptanceModel, LengthDist, SimRequestSpec, poisson_requests
from router.config import RouterConfig
from specdec.core.request_state import KPolicy
from specdec.core.speedup import expected_tokens

log = logging.getLogger(__name__)

__all__ = ["SLO", "PlanWorkload", "SearchSpace", "Candidate", "Evaluation", "PlanResult", "plan", "PlanError"]

COLOCATED = "colocated"  # the draft model on the target group's own GPU
K_POLICIES = ("adaptive", "k4", "off")


class PlanError(ValueError):
    """A question the planner cannot answer (bad input); the message says why."""


@dataclass(frozen=True)
class SLO:
    ttft_p99_ms: float | None = None
    tpot_p99_ms: float | None = None
    min_throughput_tok_s: float | None = None

    def describe(self) -> str:
        parts = []
        if self.ttft_p99_ms:
            parts.append(f"p99 TTFT <= {self.ttft_p99_ms:g} ms")
        if self.tpot_p99_ms:
            parts.append(f"p99 TPOT <= {self.tpot_p99_ms:g} ms")
        if self.min_throughput_tok_s:
            parts.append(f"throughput >= {self.min_throughput_tok_s:g} tok/s")
        return ", ".join(parts) or "keep up with the arrivals"


@dataclass
class PlanWorkload:
    rate: float  # requests / s
    prompt: LengthDist
    output: LengthDist
    acceptance: dict[str, list[AcceptanceModel]]  # by drafter ("draft")
    requests: int = 300
    seed: int = 0
    trace: list[SimRequestSpec] | None = None  # replaces the Poisson arrivals when given
    trees: SimTrees | None = None  # the draft model drafts token trees of this shape (sim_trees.py)

    def make(self, rate: float | None = None) -> list[SimRequestSpec]:
        if self.trace is not None and rate is None:
            return self.trace
        rate = rate or self.rate
        return poisson_requests(self.requests, rate, self.prompt, self.output, self.acceptance, self.seed)

    @property
    def mean_acceptance(self) -> float:
        models = self.acceptance.get("draft") or []
        if not models:
            return 0.0
        return sum(AcceptanceModel.at(m.accept_p, 0) for m in models) / len(models)


@dataclass
class SearchSpace:
    target_devices: list[str] | None = None  # None: every device in the catalog
    tp: list[int] | None = None  # None: every degree the model's heads allow, up to the device's max_tp
    draft_devices: list[str] | None = None  # None: colocated + the two cheapest devices the draft fits on
    k_policies: tuple[str, ...] = ("adaptive", "off")
    max_batches: tuple[int, ...] = (32, 128)
    draft_ratios: tuple[float, ...] = (1.0,)  # draft replicas per target group (on their own devices)
    max_groups: int = 64
    runners_up: int = 3


@dataclass(frozen=True)
class Candidate:
    target_device: str
    tp: int
    groups: int
    draft_device: str | None  # a device name, COLOCATED, or None (no draft model)
    drafts: int
    k_policy: str
    max_batch: int
    draft_ratio: float = 1.0  # draft replicas per group: drafts = ceil(groups x ratio)

    def with_groups(self, groups: int) -> Candidate:
        drafts = max(1, math.ceil(groups * self.draft_ratio)) if self.drafts else 0
        return dataclasses.replace(self, groups=groups, drafts=drafts)

    def label(self) -> str:
        t = f"{self.groups} x {self.target_device} TP{self.tp}"
        if self.draft_device is None:
            d = "no draft"
        elif self.draft_device == COLOCATED:
            d = "draft on the target GPUs"
        else:
            d = f"{self.drafts} x {self.draft_device} draft"
        return f"{t}, {d}, k {self.k_policy}, batch {self.max_batch}"

    def gpus(self) -> dict[str, int]:
        out = {self.target_device: self.groups * self.tp}
        if self.draft_device not in (None, COLOCATED):
            out[self.draft_device] = out.get(self.draft_device, 0) + self.drafts
        return out


@dataclass
class Evaluation:
    candidate: Candidate
    ok: bool
    reasons: list[str]
    cost_per_hour: float
    metrics: dict[str, Any] = field(default_factory=dict)

    same_as: str | None = None  # a larger max batch than a run that never filled it: that run's result

    @property
    def cost_per_mtok(self) -> float | None:
        """Price per million output tokens: at the offered token rate when the deployment keeps up
        (its throughput over a finite run also counts the run's ramp and drain), else at its throughput."""
        m = self.metrics
        tput = m.get("offered_tok_s") if m.get("offered_tok_s") and not m.get("unfinished") else None
        tput = tput or m.get("throughput_tok_s")
        return round(self.cost_per_hour / (tput * 3600.0) * 1e6, 4) if tput else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "deployment": dataclasses.asdict(self.candidate),
            "label": self.candidate.label(),
            "gpus": self.candidate.gpus(),
            "ok": self.ok,
            "reasons": self.reasons,
            "cost_per_hour": round(self.cost_per_hour, 3),
            "cost_per_million_tokens": self.cost_per_mtok,
            "metrics": self.metrics,
        }


@dataclass
class PlanResult:
    best: Evaluation | None
    runners_up: list[Evaluation]
    rejected: list[Evaluation]
    evaluated: list[Evaluation]
    question: dict[str, Any]
    answer: str  # one sentence: the deployment, or why there is none
    _planner: Any = field(default=None, repr=False)

    def sweep(self, evaluations: list[Evaluation], rates: list[float]) -> dict[str, list[dict[str, Any]]]:
        """Each deployment simulated again at each arrival rate (latency vs rate): its metrics per rate."""
        out = {}
        for ev in evaluations:
            out[ev.candidate.label()] = [
                self._planner.evaluate(ev.candidate, rate)[0].metrics | {"rate": rate} for rate in rates
            ]
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "question": self.question,
            "answer": self.answer,
            "best": self.best.to_dict() if self.best else None,
            "runners_up": [e.to_dict() for e in self.runners_up],
            "rejected": [e.to_dict() for e in self.rejected],
        }


class _Planner:
    def __init__(
        self,
        catalog: Catalog,
        target: ModelShape,
        draft: ModelShape | None,
        workload: PlanWorkload,
        slo: SLO,
        space: SearchSpace,
        router: RouterConfig,
        progress: Callable[[str], None],
        jobs: int = 1,
    ):
        self.cat, self.target, self.draft = catalog, target, draft
        self.wl, self.slo, self.space, self.router = workload, slo, space, router
        self.progress = progress
        self.context = int(workload.prompt.mean + workload.output.mean) + 1
        self.max_context = max(2 * self.context, 2048)
        self.requests = workload.make()
        self.needed_tok_s = workload.rate * workload.output.mean
        self.sims = 0
        # a candidate's simulation is a pure function of it and the workload's seed
        self.simulations = Ahead(self._simulate, jobs)
        self._unbound: dict[tuple, tuple[int, Evaluation]] = {}  # runs whose max batch never bound

    # ---- the configurations --------------------------------------------------------------------
    def _draft_options(self, tdev: Device) -> list[str | None]:
        if self.draft is None:
            return [None]
        names = self.space.draft_devices
        if names is None:
            fitting = [d for d in self.cat.devices.values() if fits(self.draft, d, 1, 1, self.max_context)]
            names = [COLOCATED] + [d.name for d in sorted(fitting, key=lambda d: d.price_per_hour)[:2]]
        return names

    def _draft_choices(self, names: list[str | None]) -> list[tuple[str | None, float]]:
        """(draft device, replicas per group): a colocated draft is one per group by construction."""
        out: list[tuple[str | None, float]] = []
        for name in names:
            ratios = (1.0,) if name in (None, COLOCATED) else self.space.draft_ratios
            out += [(name, r) for r in ratios]
        return out

    def _router(self, k_policy: str, max_batch: int) -> RouterConfig:
        kp = self.router.k_policy
        if k_policy == "k4":
            kp = KPolicy(k=4, adaptive=False, k_min=kp.k_min, k_max=kp.k_max, cost_ratio=kp.cost_ratio)
        mode = "off" if k_policy == "off" else self.router.default_mode
        return dataclasses.replace(self.router, k_policy=kp, default_mode=mode, max_batch=max_batch)

    def _cost(self, c: Candidate) -> float:
        return sum(self.cat.device(name).price_per_hour * n for name, n in c.gpus().items())

    def _groups_needed(self, tdev: Device, tp: int, batch: int, k_policy: str) -> int:
        """Fewest groups that could carry the load: each second of arrivals brings its prefill work
        plus its tokens to decode at full batch (an optimistic bound: no draft wait, every group at
        85 % busy, speculation at k = 4 unless off)."""
        k = 0 if k_policy == "off" or self.draft is None else 4
        costs = RooflineCosts(self.target, tdev, tp, None, None, self.cat)
        step = costs.verify_s(batch, k + 1, self.context) + costs.router_s(batch) + costs.verify_rpc_s
        tok_per_s = batch * expected_tokens(min(self.wl.mean_acceptance, 0.99), k) / step
        prefill = self.wl.rate * costs.prefill_s(1, max(1, int(self.wl.prompt.mean)))
        needed = max(self.needed_tok_s, self.slo.min_throughput_tok_s or 0.0)
        return max(1, math.ceil((prefill + needed / tok_per_s) / 0.85))

    # ---- evaluating one ------------------------------------------------------------------------
    def evaluate_cached(self, c: Candidate) -> Evaluation:
        """As :meth:`evaluate` at the workload's rate, reusing a run of the same deployment with a
        smaller max batch that never filled it (a larger cap cannot change that run)."""
        key = dataclasses.astuple(dataclasses.replace(c, max_batch=0))
        hit = self._unbound.get(key)
        if hit is not None and hit[0] <= c.max_batch:
            prev = hit[1]
            same = f"the run with batch {prev.candidate.max_batch} (it never filled it)"
            return Evaluation(c, prev.ok, list(prev.reasons), self._cost(c), dict(prev.metrics), same)
        ev, peak_running = self.simulations.result(c)
        self.sims += 1
        if peak_running < c.max_batch and (hit is None or c.max_batch < hit[0]):
            self._unbound[key] = (c.max_batch, ev)
        return ev

    def _simulate(self, c: Candidate) -> tuple[Evaluation, int]:
        """What the search keeps of a candidate's run: its evaluation and its peak batch."""
        ev, res = self.evaluate(c)
        return ev, res.peak_running

    def evaluate(self, c: Candidate, rate: float | None = None) -> tuple[Evaluation, SimResult]:
        tdev = self.cat.device(c.target_device)
        ddev = None
        if c.draft_device is not None:
            ddev = tdev if c.draft_device == COLOCATED else self.cat.device(c.draft_device)
        draft = self.draft if c.draft_device is not None else None
        costs = RooflineCosts(self.target, tdev, c.tp, draft, ddev, self.cat)
        per_draft = math.ceil(c.groups / c.drafts) if c.drafts else 1
        dep = Deployment(
            costs=costs,
            router=self._router(c.k_policy, c.max_batch),
            groups=c.groups,
            drafts=c.drafts if draft is not None else 0,
            target_slots=c.max_batch,
            draft_slots=c.max_batch * per_draft,
            max_context=self.max_context,
            colocated=c.draft_device == COLOCATED,
            mode="auto",
            trees=self.wl.trees,
        )
        reqs = self.requests if rate is None else self.wl.make(rate)
        res = simulate(dep, reqs, seed=self.wl.seed)
        s = res.summary
        metrics = {
            "throughput_tok_s": s["throughput_tok_s"],
            "requests_per_s": s["requests_per_s"],
            "ttft_ms_p50": s["ttft_ms_p50"],
            "ttft_ms_p99": s["ttft_ms_p99"],
            "tpot_ms_p50": s["tpot_ms_p50"],
            "tpot_ms_p99": s["tpot_ms_p99"],
            "utilization": res.utilization,
            "mean_batch": res.mean_batch,
            "k_mean": s["k_mean"],
            "acceptance": s["acceptance"],
            "unfinished": res.unfinished,
            "rejected": res.rejected,
            "offered_tok_s": round(sum(r.output_tokens for r in reqs) / max(max(r.t for r in reqs), 1e-9), 3),
        }
        reasons = self._check(metrics, len(reqs))
        return Evaluation(c, not reasons, reasons, self._cost(c), metrics), res

    def _check(self, m: dict[str, Any], n: int) -> list[str]:
        reasons = []
        if m["unfinished"] or m["rejected"]:
            reasons.append(
                f"falls behind the arrivals: {m['unfinished'] + m['rejected']} of {n} requests not served in time"
            )
        slo = self.slo
        if slo.ttft_p99_ms and (m["ttft_ms_p99"] is None or m["ttft_ms_p99"] > slo.ttft_p99_ms):
            reasons.append(f"p99 TTFT {m['ttft_ms_p99']:.0f} ms > {slo.ttft_p99_ms:g} ms")
        if slo.tpot_p99_ms and (m["tpot_ms_p99"] is None or m["tpot_ms_p99"] > slo.tpot_p99_ms):
            reasons.append(f"p99 TPOT {m['tpot_ms_p99']:.1f} ms > {slo.tpot_p99_ms:g} ms")
        if slo.min_throughput_tok_s and (m["throughput_tok_s"] or 0) < slo.min_throughput_tok_s:
            reasons.append(f"throughput {m['throughput_tok_s']:.0f} tok/s < {slo.min_throughput_tok_s:g}")
        return reasons

    # ---- the search ----------------------------------------------------------------------------
    def bases(self) -> tuple[list[tuple[Candidate, float]], list[Evaluation]]:
        """(a candidate with its lower-bound group count, its cost bound) per configuration, and the
        configurations that do not fit in memory."""
        out, misfits = [], []
        devices = self.space.target_devices or list(self.cat.devices)
        for name in devices:
            tdev = self.cat.device(name)
            tps = [t for t in self.target.tp_degrees(tdev.max_tp) if not self.space.tp or t in self.space.tp]
            for tp in tps:
                for batch in self.space.max_batches:
                    if not fits(self.target, tdev, tp, batch, self.max_context):
                        need = memory_needed_gb(self.target, tp, batch, self.max_context)
                        c = Candidate(name, tp, 1, None, 0, "-", batch)
                        why = f"does not fit: {need:.0f} GB per GPU needed, {tdev.memory_gb:g} GB x 0.9 usable"
                        misfits.append(Evaluation(c, False, [why], self._cost(c)))
                        continue
                    for kp in self.space.k_policies:
                        drafts = [None] if kp == "off" else self._draft_options(tdev)
                        for dname, ratio in self._draft_choices(drafts):
                            if dname == COLOCATED and self.draft is not None:
                                both = memory_needed_gb(self.target, tp, batch, self.max_context)
                                both += memory_needed_gb(self.draft, 1, batch, self.max_context)
                                if both > 0.9 * tdev.memory_gb:
                                    continue
                            g = self._groups_needed(tdev, tp, batch, kp)
                            c = Candidate(name, tp, 1, dname, 1 if dname else 0, kp, batch, ratio).with_groups(g)
                            out.append((c, self._cost(c)))
        return sorted(out, key=lambda x: x[1]), misfits

    def run(self) -> tuple[list[Evaluation], list[Evaluation]]:
        bases, misfits = self.bases()
        evaluated: list[Evaluation] = []
        ok_costs: list[float] = []
        for i, (c, bound) in enumerate(bases):
            keep = sorted(ok_costs)[: self.space.runners_up + 1]
            limit = keep[-1] if len(keep) > self.space.runners_up else math.inf
            if bound >= limit:
                evaluated.append(Evaluation(c, False, [f"not simulated: costs at least ${bound:.2f}/h"], bound))
                continue
            self.simulations.ahead([c] + [b for b, cost in bases[i + 1 :] if cost < limit])
            self.progress(f"[{i + 1}/{len(bases)}] {c.label()}")
            prev: Evaluation | None = None
            while c.groups <= self.space.max_groups:
                ev = self.evaluate_cached(c)
                evaluated.append(ev)
                if ev.ok:
                    ok_costs.append(ev.cost_per_hour)
                    break
                if prev is not None and not _more_groups_help(prev, ev):
                    ev.reasons.append(f"more groups do not help (from {prev.candidate.groups} to {c.groups})")
                    break
                prev = ev
                nxt = c.with_groups(c.groups + 1)
                if self._cost(nxt) >= limit:
                    break
                self.simulations.ahead([nxt])
                c = nxt
        return evaluated, misfits


def _distinct(evaluations: list[Evaluation]) -> list[Evaluation]:
    """Drop a deployment that differs from an earlier one only by a max batch that never bound
    (the same run, the same figures)."""
    seen, out = set(), []
    for e in evaluations:
        m = e.metrics
        key = (
            dataclasses.astuple(dataclasses.replace(e.candidate, max_batch=0)),
            m.get("tpot_ms_p99"),
            m.get("ttft_ms_p99"),
        )
        if key not in seen:
            seen.add(key)
            out.append(e)
    return out


def _more_groups_help(before: Evaluation, after: Evaluation) -> bool:
    """Whether one more group improved what failed: a deployment that falls behind gains capacity;
    latencies that stay put (a group already runs its requests alone) will not improve further."""
    if any(r.startswith(("falls behind", "throughput")) for r in after.reasons):
        return True
    for key, tag in (("ttft_ms_p99", "p99 TTFT"), ("tpot_ms_p99", "p99 TPOT")):
        if any(r.startswith(tag) for r in after.reasons):
            b, a = before.metrics.get(key), after.metrics.get(key)
            if b and a and a < 0.97 * b:
                return True
    return False


def plan(
    catalog: Catalog,
    target: str,
    draft: str | None,
    workload: PlanWorkload,
    slo: SLO,
    space: SearchSpace | None = None,
    router: RouterConfig | None = None,
    progress: Callable[[str], None] = lambda _: None,
    jobs: int = 1,
) -> PlanResult:
    space = space or SearchSpace()
    target_shape = catalog.model(target)
    draft_shape = catalog.model(draft) if draft and draft not in ("none", "ngram") else None
    if draft_shape is None:
        space = dataclasses.replace(space, k_policies=("off",))
    if workload.rate <= 0 and workload.trace is None:
        raise PlanError("the arrival rate must be > 0")
    if draft_shape is not None and not workload.acceptance.get("draft"):
        raise PlanError("planning with a draft model needs its acceptance: --acceptance A or --profile")
    p = _Planner(catalog, target_shape, draft_shape, workload, slo, space, router or RouterConfig(), progress, jobs)
    question = {
        "target": target,
        "draft": draft,
        "rate": workload.rate,
        "requests": len(p.requests),
        "prompt_tokens_mean": round(workload.prompt.mean, 1),
        "output_tokens_mean": round(workload.output.mean, 1),
        "slo": dataclasses.asdict(slo),
        "catalog": catalog.source,
        "efficiency": dataclasses.asdict(catalog.efficiency),
    }
    names = space.target_devices or list(catalog.devices)
    searched = [catalog.device(n) for n in names]
    largest = max(searched, key=lambda d: d.memory_gb * d.max_tp)
    groups = [(d, t) for d in searched for t in target_shape.tp_degrees(d.max_tp)]
    if not any(fits(target_shape, d, t, 1, p.max_context) for d, t in groups):
        need = memory_needed_gb(target_shape, 1, 1, p.max_context)
        answer = (
            f"no deployment: {target} needs about {need:.0f} GB (weights and one sequence's KV cache), more than any "
            f"group of the devices searched holds (largest: {largest.max_tp} x {largest.name}, "
            f"{largest.max_tp * largest.memory_gb * 0.9:.0f} GB usable)"
        )
        return PlanResult(None, [], [], [], question, answer, p)
    try:
        evaluated, misfits = p.run()
    finally:
        p.simulations.close()
    ok = _distinct(sorted((e for e in evaluated if e.ok and e.same_as is None), key=lambda e: e.cost_per_hour))
    failed = [e for e in evaluated if not e.ok]
    question["simulations"] = p.sims
    if ok:
        best = ok[0]
        answer = f"{best.candidate.label()}: ${best.cost_per_hour:.2f}/h, ${best.cost_per_mtok:.3f} per million tokens"
        return PlanResult(best, ok[1 : 1 + space.runners_up], failed + misfits, evaluated, question, answer, p)
    closest = min(failed, key=lambda e: len(e.reasons), default=None)
    answer = f"no deployment in the search meets {slo.describe()} at {workload.rate:g} requests/s"
    if closest is not None:
        answer += f"; the closest ({closest.candidate.label()}) fails: {'; '.join(closest.reasons)}"
    return PlanResult(None, [], failed + misfits, evaluated, question, answer, p)
