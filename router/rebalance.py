"""The rebalancer's policy: plain functions over telemetry, queues, batch, acceptance and measured
costs, returning actions (DESIGN.md "Rebalancing and scaling").

Nothing here does I/O, holds a lock, or knows asyncio or gRPC: inputs and outputs are small frozen
dataclasses, and the time is an argument. The router applies the decisions (router/drafter_pool.py,
router/scheduler.py, router/rebalancer.py, router/server.py); the capacity simulator (cluster/)
calls the same functions over simulated state. Every action has hysteresis (a margin or separate
enter/leave thresholds held for several samples) and a cooldown; the router logs and counts each
one (``specdec_rebalance_actions_total{action}``).

Actions:

* Draft assignment (:func:`assign_drafter`): drafters are one pool shared by every target. A new
  request goes where its target's other requests draft, else to an idle drafter, else to a
  shared one (a round waits for every drafter its requests use), and among those to the one with
  the most headroom (:func:`placement_cost`: measured seconds per draft step, a call in flight,
  device load, KV occupancy); only drafters a move would not take it away from at once count. A
  request stays on its drafter (its KV cache is there) unless that drafter is down
  (``failover``) or its measured cost is ``move_margin`` times the best one's (``draft_move``),
  at most once per ``move_cooldown_s`` after a move.
* Depth by device load (:func:`plan_depth`, :func:`depth_plan`): an underused target (low load,
  drafts not on the critical path) goes ``deep`` (longer drafts, pre-drafting); a saturated one
  ``shallow`` (shorter drafts, no pre-drafting). Saturated means the compute units are full: GPM SM
  activity where offered; otherwise a high load *and* a measured verify cost that grows with the
  tokens verified. A busy device alone is not saturated: NVML utilization counts time in which any
  kernel ran, and a memory-bound target busy all the time still verifies k + 1 tokens for the
  price of one. Whatever the level, a pre-draft takes only a drafter's spare time
  (:func:`predraft_room`).
* Speculation off per request (`router/speculation_switch.py`): AUTO requests stop speculating when the
  measured goodput B tau / T(B (k + 1)) (+ draft wait) says plain decoding is faster, and start
  again when speculation is faster again: speculation is never kept where it loses.
* Routing (:func:`pick_target`): a request goes to the target replica with the least load per slot
  (queue + batch), saturated replicas last.

Adding or removing replicas (autoscaling) only changes the sequences passed in.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "RebalanceConfig",
    "DrafterView",
    "Assignment",
    "placement_cost",
    "priced_drafter",
    "guessed_price",
    "is_guess",
    "assign_drafter",
    "TargetView",
    "DepthState",
    "DepthPlan",
    "plan_depth",
    "depth_plan",
    "predraft_room",
    "Route",
    "route_score",
    "pick_target",
]

LEVELS = ("shallow", "normal", "deep")
REF_K = 4  # draft length at which drafters' step times are compared


@dataclass(frozen=True)
class RebalanceConfig:
    """The router config's ``rebalance`` section.

    enabled: False = static pairing (each target drafts on its own drafter, depth by acceptance
      only, no speculation switch): what the router did before the rebalancer.
    period_s: how often the router polls worker telemetry and re-plans depth.
    latency_weight: EWMA weight of each new round in a drafter's measured seconds per step.
    stale_s / forget_s: requests move only between drafters measured within ``stale_s``; new
      requests are placed by a drafter's last measurement until it is ``forget_s`` old, then by
      the pool's median (a drafter that recovered meanwhile gets requests again).
    move_margin / move_cooldown_s: a request moves off its drafter only when its cost is more than
      ``move_margin`` times the best drafter's, and at most once per ``move_cooldown_s``.
    util_weight / hot_utilization: a drafter's placement cost grows by ``util_weight`` x its device
      load, and by up to 1 more as the load goes from ``hot_utilization`` to 1 (busy with other work).
    low_utilization / high_utilization / band: a target is underused below ``low``, saturated
      above ``high``; it leaves a level only ``band`` past the threshold (hysteresis).
    growth_saturated: without GPM, saturated also needs each extra verified token to cost at least
      this share of a one-token verify (measured: the scheduler's verify line).
    depth_samples / depth_cooldown_s: a level changes after this many telemetry samples in a row
      ask for it, at most once per cooldown.
    deep_wait_share: ``deep`` only while rounds spend less than this share waiting for drafts (an
      idle target waiting on a slow drafter must not get longer drafts).
    deep_extra_k / deep_cost_scale: ``deep`` raises k_min by this much and scales the draft cost
      the adaptive k sees by this factor (longer drafts); ``shallow`` halves k_max.
    spec_off_margin / spec_on_margin / spec_cooldown_s: AUTO requests switch speculation off when
      that raises the round's goodput by more than ``spec_off_margin`` (small: speculation must
      not stay where it loses), back on only for more than ``spec_on_margin`` (the wide band keeps
      noise from flipping them), each request at most once per cooldown; nothing switches before
      the target's pooled acceptance rests on ``spec_min_evidence`` tested draft tokens.
    saturated_penalty: added to a saturated target's load per slot when routing.
    """

    enabled: bool = True
    period_s: float = 1.0
    latency_weight: float = 0.3
    stale_s: float = 10.0
    forget_s: float = 60.0
    move_margin: float = 1.5
    move_cooldown_s: float = 2.0
    util_weight: float = 0.5
    hot_utilization: float = 0.9
    low_utilization: float = 0.35
    high_utilization: float = 0.9
    band: float = 0.1
    growth_saturated: float = 0.15
    depth_samples: int = 3
    depth_cooldown_s: float = 5.0
    deep_wait_share: float = 0.25
    deep_extra_k: int = 1
    deep_cost_scale: float = 0.5
    spec_off_margin: float = 0.02
    spec_on_margin: float = 0.15
    spec_min_evidence: float = 20.0
    spec_cooldown_s: float = 2.0
    saturated_penalty: float = 1.0

    def __post_init__(self) -> None:
        positive = ("period_s", "stale_s", "forget_s", "move_margin", "latency_weight")
        for key in positive:
            if not float(getattr(self, key)) > 0:
                raise ValueError(f"router.rebalance.{key} must be > 0")
        if self.move_margin < 1.0:
            raise ValueError("router.rebalance.move_margin must be >= 1 (it is a ratio of costs)")
        if not 0.0 <= self.low_utilization < self.high_utilization <= 1.0:
            raise ValueError("router.rebalance: need 0 <= low_utilization < high_utilization <= 1")
        if not isinstance(self.depth_samples, int) or self.depth_samples < 1:
            raise ValueError("router.rebalance.depth_samples must be an integer >= 1")
        non_negative = ("move_cooldown_s", "depth_cooldown_s", "spec_cooldown_s", "band", "util_weight")
        for key in (*non_negative, "spec_off_margin", "spec_on_margin"):
            if float(getattr(self, key)) < 0:
                raise ValueError(f"router.rebalance.{key} must be >= 0")

    @classmethod
    def from_dict(cls, d: dict | RebalanceConfig | None) -> RebalanceConfig:
        if isinstance(d, RebalanceConfig):
            return d
        d = dict(d or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"router.rebalance: unknown keys {unknown} (known: {sorted(known)})")
        return cls(**d)


# ---- draft assignment ----------------------------------------------------------------------------


@dataclass(frozen=True)
class DrafterView:
    """One drafter as the policy sees it.

    step_s: measured seconds per draft step of a round on it, queueing included, at a reference
      draft length (raised while a call runs late); None = never measured. age_s: its age.
    fixed_s: the part of a call's wait that does not grow with k (RPC, queueing): a Propose of k
      steps waits about fixed_s + k x (step_s - fixed_s / k_ref); 0 until calls of different k.
    run_step_s: seconds per draft step a Propose ran on the worker, queueing excluded (EWMA);
      None = not measured. queue_s: how long a Propose waited before it ran, over a long memory.
    in_flight: Propose calls queued or running on it now (from every target).
    load: device load share from telemetry (DeviceSample.load), None = unknown.
    jobs / slots: requests it drafts for, and its KV slots (None = unbounded, e.g. n-gram).
    mates: of ``jobs``, those on the same target as the request being placed.
    prefill_token_s: measured seconds per token of its prefill (EWMA); None = not measured.
    placement: where it computes (WorkerInfo.placement); a target with the same one shares its device.
    """

    name: str
    up: bool = True
    step_s: float | None = None
    age_s: float = 0.0
    fixed_s: float = 0.0
    run_step_s: float | None = None
    queue_s: float = 0.0
    in_flight: int = 0
    load: float | None = None
    jobs: int = 0
    slots: int | None = None
    mates: int = 0
    prefill_token_s: float | None = None
    placement: str = ""

    @property
    def has_room(self) -> bool:
        return self.slots is None or self.jobs < self.slots

    @property
    def others(self) -> int:
        """Of ``jobs``, those on other targets than the request being placed."""
        return self.jobs - self.mates

    @property
    def per_step_s(self) -> float | None:
        """Seconds each draft step adds (the device's speed, without RPC and queueing)."""
        return None if self.step_s is None else max(0.0, self.step_s - self.fixed_s / REF_K)

    def price(self) -> tuple[float, float]:
        """(fixed, per step) seconds the speculation switch prices a draft here at: the run time
        per step plus the long-memory queueing, once runs are measured; else the wait line. A
        Propose queued behind a draft prefill waits several times its run, and pricing that
        spike switched whole batches off (bench/NOTES.md, fourth session)."""
        if self.run_step_s is not None:
            return self.queue_s, self.run_step_s
        return self.fixed_s, self.per_step_s or 0.0


@dataclass(frozen=True)
class Assignment:
    """Where a request's next drafts come from. action: keep | place | move | failover | none."""

    drafter: str | None
    action: str
    reason: str = ""


def _known_step(d: DrafterView, within_s: float) -> float | None:
    return d.step_s if d.step_s is not None and d.age_s <= within_s else None


def priced_drafter(own: str | None, views: dict[str, DrafterView], cfg: RebalanceConfig) -> DrafterView | None:
    """The drafter whose cost a request's speculation decision prices: its own (``own``), unless
    the pool would move it (beyond ``move_margin`` of the best one) or it has no fresh measurement:
    the best fresh one. With no measurement younger than ``stale_s``, the last one is a guess whose
    price halves every further ``stale_s`` (:func:`guessed_price`); never measured: None (free).
    With speculation off nothing measures a drafter again, so an old slow figure (a Propose that
    queued behind a prompt's draft prefill) must not keep speculation off for good; and one that
    lost by far is tried again later than one that lost narrowly (a back-off)."""
    fresh = [v for v in views.values() if _known_step(v, cfg.stale_s) is not None]
    best = min(fresh, key=lambda v: v.step_s, default=None)
    mine = views.get(own) if own is not None else None
    if mine is not None and _known_step(mine, cfg.stale_s) is not None:
        return best if mine.step_s > cfg.move_margin * best.step_s else mine
    if best is not None:
        return best
    if mine is None or mine.step_s is None:
        mine = min((v for v in views.values() if v.step_s is not None), key=lambda v: v.step_s, default=None)
    return None if mine is None else guessed_price(mine, cfg)


def guessed_price(v: DrafterView, cfg: RebalanceConfig) -> DrafterView:
    """A measurement ``age_s`` old, priced at half its cost for every ``stale_s`` past ``stale_s``
    (its prefill price too: one measured while the drafter was slow must not keep a request that
    would catch it up off for good)."""
    f = 0.5 ** (max(0.0, v.age_s - cfg.stale_s) / cfg.stale_s)
    run = v.run_step_s * f if v.run_step_s is not None else None
    prefill = v.prefill_token_s * f if v.prefill_token_s is not None else None
    return dataclasses.replace(
        v, step_s=v.step_s * f, fixed_s=v.fixed_s * f, run_step_s=run, queue_s=v.queue_s * f, prefill_token_s=prefill
    )


def is_guess(v: DrafterView | None, cfg: RebalanceConfig) -> bool:
    """Whether a price is a guess (never measured, or measured more than ``stale_s`` ago): at
    most one request switches speculation on by a guess (router/speculation_switch.py)."""
    return v is None or _known_step(v, cfg.stale_s) is None


def _fallback_step(drafters: Sequence[DrafterView], cfg: RebalanceConfig) -> float:
    known = sorted(s for d in drafters if d.up and (s := _known_step(d, cfg.forget_s)) is not None)
    return known[len(known) // 2] if known else 1.0


def _load_factor(d: DrafterView, cfg: RebalanceConfig) -> float:
    """1 + util_weight x load, plus up to 1 more as the load goes from hot_utilization to 1 (hot:
    busy with other work). Continuous, so noise around a threshold cannot flip a decision."""
    load = min(max(d.load or 0.0, 0.0), 1.0)
    hot = max(0.0, load - cfg.hot_utilization) / max(1e-9, 1.0 - cfg.hot_utilization)
    return 1.0 + cfg.util_weight * load + hot


def placement_cost(d: DrafterView, drafters: Sequence[DrafterView], cfg: RebalanceConfig) -> float:
    """Expected wait for a new request's draft step on ``d``: its step time (the pool's median
    when unmeasured or forgotten) x 1.5 while a call is in flight there (the router coalesces the
    waiting ones: a new request waits for about half the running call, then goes in the next) x the
    device-load factor x (1 + half the share of its KV slots taken: requests placed in the same
    round see nothing in flight yet, and this spreads them instead of piling them on the
    marginally cheapest drafter)."""
    step = _known_step(d, cfg.forget_s)
    step = step if step is not None else _fallback_step(drafters, cfg)
    occupancy = d.jobs / d.slots if d.slots else 0.0
    return step * (1.0 + 0.5 * min(d.in_flight, 1)) * _load_factor(d, cfg) * (1.0 + 0.5 * occupancy)


def move_cost(d: DrafterView, cfg: RebalanceConfig, within_s: float | None = None) -> float | None:
    """The cost used to decide moves: how long a draft step runs there (:attr:`DrafterView.
    run_step_s`; before any is measured, :attr:`DrafterView.per_step_s`). Queueing and the device
    load are left out on purpose: both follow the placement (moving requests onto a drafter makes
    it queue and busy), so chasing them made requests oscillate (1,025 moves of 200 requests in a
    planner run, bench/NOTES.md); placement weighs them instead. A device slowed by other work
    runs its Proposes slower, which this sees. None = not measured within ``within_s`` (default
    ``stale_s``)."""
    if _known_step(d, cfg.stale_s if within_s is None else within_s) is None:
        return None
    speed = d.run_step_s if d.run_step_s is not None else d.per_step_s
    return max(speed, 1e-6)


def _sharing(d: DrafterView) -> int:
    """Placement's first key: a drafter that drafts only for the request's own target (0), an
    idle one (1), one shared with other targets (2), one that drafts only for others (3). A
    round waits for the slowest of the drafters its requests use, so a target whose requests
    spread over two drafters waits for both, each busy with other targets' rounds too (the
    rebalancer then lost 18 % to static pairing with equal drafters: bench/NOTES.md)."""
    if d.mates:
        return 0 if not d.others else 2
    return 1 if not d.others else 3


def assign_drafter(
    current: str | None,
    drafters: Sequence[DrafterView],
    *,
    moved_at: float | None,
    now: float,
    cfg: RebalanceConfig,
) -> Assignment:
    """Where request drafts next: stay on ``current`` unless it is down or clearly worse.

    ``moved_at``: when the request last moved (None = never), for the cooldown.
    """
    up = [d for d in drafters if d.up]
    if not up:
        return Assignment(None, "none", "no drafter is up")
    by_name = {d.name: d for d in up}
    cur = by_name.get(current) if current is not None else None
    roomy = [d for d in up if d.has_room or d is cur]
    if not roomy:
        return Assignment(None, "none", "every drafter's KV slots are taken")
    if current is None:
        # only where a move would not take it away: within the margin of the best measured (a
        # drafter measured slow stays out until its measurement is forgotten)
        costs = {d.name: move_cost(d, cfg, cfg.forget_s) for d in roomy}
        measured = [c for c in costs.values() if c is not None]
        limit = cfg.move_margin * min(measured) if measured else math.inf
        fit = [d for d in roomy if costs[d.name] is None or costs[d.name] <= limit]
        best = min(fit, key=lambda d: (_sharing(d), placement_cost(d, up, cfg), d.jobs, d.name))
        return Assignment(best.name, "place", "most headroom")
    best = min(roomy, key=lambda d: (_sharing(d), placement_cost(d, up, cfg), d.jobs, d.name))
    if cur is None:
        return Assignment(best.name, "failover", f"{current} is down")
    if moved_at is not None and now - moved_at < cfg.move_cooldown_s:
        return Assignment(cur.name, "keep", "cooldown")
    c_cur = move_cost(cur, cfg)
    measured = [(c, d) for d in roomy if d is not cur and (c := move_cost(d, cfg)) is not None]
    if c_cur is None or not measured:
        return Assignment(cur.name, "keep", "not measured")
    c_best, target = min(measured, key=lambda x: (x[0], x[1].name))
    if c_cur > cfg.move_margin * c_best:
        return Assignment(target.name, "move", f"{cur.name} costs {c_cur / c_best:.1f}x {target.name}")
    return Assignment(cur.name, "keep", "")


# ---- depth by device load ------------------------------------------------------------------------


@dataclass(frozen=True)
class TargetView:
    """One target replica as the policy sees it.

    load: DeviceSample.load (NVML kernel-time share on a GPU, the worker's busy fraction on CPU);
    sm_active: GPM SM activity where offered; None = unknown / not offered.
    verify_growth: measured cost of one more verified token relative to a one-token verify
      (0 while memory-bound); None = not measured yet.
    draft_wait_share: share of its recent round time spent waiting for drafts.
    level: its depth level now (routing puts ``shallow`` = saturated replicas last).
    """

    name: str
    up: bool = True
    waiting: int = 0
    running: int = 0
    capacity: int = 1
    load: float | None = None
    sm_active: float | None = None
    verify_growth: float | None = None
    draft_wait_share: float = 0.0
    level: str = "normal"

    def saturation(self, cfg: RebalanceConfig) -> float | None:
        """How full the compute units are, in [0, 1]: GPM SM activity where offered; else the load
        when the measured verify cost grows with tokens (compute-bound), 0 when it does not."""
        if self.sm_active is not None:
            return self.sm_active
        if self.load is None or self.verify_growth is None:
            return None
        return self.load if self.verify_growth >= cfg.growth_saturated else 0.0


@dataclass(frozen=True)
class DepthState:
    """A target's depth level and the evidence gathered for a change (returned by :func:`plan_depth`)."""

    level: str = "normal"
    changed_at: float = -math.inf
    want: str = "normal"  # what the latest samples asked for
    streak: int = 0  # how many samples in a row asked for ``want``


def _wanted_level(v: TargetView, level: str, cfg: RebalanceConfig) -> str:
    if v.load is None:
        return level  # no telemetry: no evidence either way
    hi = cfg.high_utilization - (cfg.band if level == "shallow" else 0.0)
    sat = v.saturation(cfg)
    if sat is not None and sat >= hi:
        return "shallow"
    lo = cfg.low_utilization + (cfg.band if level == "deep" else 0.0)
    if v.load <= lo and v.draft_wait_share <= cfg.deep_wait_share and v.running > 0:
        return "deep"  # (an idle target is not underused: it has nothing to verify)
    return "normal"


def plan_depth(v: TargetView, state: DepthState, now: float, cfg: RebalanceConfig) -> DepthState:
    """One telemetry sample's update of a target's depth level (``level != state.level``: an action)."""
    want = _wanted_level(v, state.level, cfg)
    streak = state.streak + 1 if want == state.want else 1
    if want != state.level and streak >= cfg.depth_samples and now - state.changed_at >= cfg.depth_cooldown_s and v.up:
        return DepthState(level=want, changed_at=now, want=want, streak=streak)
    return DepthState(level=state.level, changed_at=state.changed_at, want=want, streak=streak)


@dataclass(frozen=True)
class DepthPlan:
    """What a depth level means for an adaptive request: k within [k_lo, k_hi], the draft cost the
    adaptive k sees scaled by ``cost_scale``, pre-drafting forced on/off (None = as configured)."""

    k_lo: int
    k_hi: int
    cost_scale: float = 1.0
    predraft: bool | None = None


def depth_plan(level: str, k_min: int, k_max: int, cfg: RebalanceConfig) -> DepthPlan:
    if level == "deep":
        return DepthPlan(min(k_min + cfg.deep_extra_k, k_max), k_max, cfg.deep_cost_scale, True)
    if level == "shallow":
        return DepthPlan(k_min, max(k_min, k_max // 2), 1.0, False)
    return DepthPlan(k_min, k_max)


def predraft_room(d: DrafterView | None, verify_s: float | None) -> int | None:
    """Draft steps a pre-draft may take on drafter ``d`` while its target verifies for ``verify_s``
    (None: no limit measured yet; 0: no pre-draft). A pre-draft must use the drafter's spare time:
    none on a drafter other targets draft on (their rounds would queue behind it), and no more
    steps than the verify hides (past it, a miss's redraft waits for it). With both pre-drafting on
    a shared or slow drafter lost to it off: skew bench 41 against 57 tok/s (bench/NOTES.md)."""
    if d is None or d.others:
        return 0
    if verify_s is None or d.run_step_s is None or d.run_step_s <= 0:
        return None
    return int(verify_s / d.run_step_s)


# ---- routing -------------------------------------------------------------------------------------


def route_score(t: TargetView, cfg: RebalanceConfig, *, with_level: bool = True) -> float:
    """Load per slot a new request would find, plus ``saturated_penalty`` on a saturated replica."""
    score = (t.waiting + t.running + 1) / max(1, t.capacity)
    if with_level and t.level == "shallow":
        score += cfg.saturated_penalty
    return score


@dataclass(frozen=True)
class Route:
    """Where a new request goes (an index into the replicas), and whether that avoided a saturated
    replica the load alone would have picked (the ``route_around`` action)."""

    index: int
    around: bool = False


def pick_target(targets: Sequence[TargetView], cfg: RebalanceConfig) -> Route:
    """The replica a new request goes to: up replicas first, least :func:`route_score`."""
    if not targets:
        raise ValueError("no target replica to pick from")

    def best(with_level: bool) -> int:
        return min(
            range(len(targets)),
            key=lambda i: (not targets[i].up, route_score(targets[i], cfg, with_level=with_level), i),
        )

    i = best(True)
    return Route(i, around=i != best(False))
