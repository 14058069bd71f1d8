"""How deep to draft: each request's draft length, the pre-draft's, and the longest a round
carries (docs/design.md "Rebalancing and scaling").

Reads: a target's device load, SM activity, measured verify growth and draft-wait share (a
:class:`router.views.TargetView`, one telemetry sample at a time), the router's k policy
(``k_policy``: k, k_min, k_max), each request's :class:`specdec.core.request_state.RequestState`
and the target's :class:`specdec.core.request_state.CostMeter`, the drafter a pre-draft would run
on, and the round's requests as the speculation switch sees them.
Decides:

* the target's depth level (:func:`plan_depth`) and what it means (:func:`depth_plan`): an
  underused target (low load, drafts not on the critical path) goes ``deep`` (longer drafts,
  pre-drafting); a saturated one ``shallow`` (shorter drafts, no pre-drafting). Saturated
  (:func:`saturation`) means the compute units are full: GPM SM activity where offered; otherwise
  a high load *and* a measured verify cost that grows with the tokens verified. A busy device
  alone is not saturated: NVML utilization counts time in which any kernel ran, and a
  memory-bound target busy all the time still verifies k + 1 tokens for the price of one;
* a request's k for its next round (:func:`want_k`) within that plan: the per-request math is the
  core's, shared with the engine (:func:`specdec.core.speedup.best_k` through
  :class:`specdec.core.adaptive_k.AdaptiveK`, bounded by
  :meth:`specdec.core.request_state.RequestState.next_k`);
* the pre-draft's length (:func:`predraft_k`) within the drafter's spare time
  (:func:`predraft_room`);
* the longest draft of a round (:func:`round_k_cap`): a round waits for its slowest draft;
* when a drafter is catching up rather than drafting (:func:`is_catch_up`).

Whether a request speculates at all under load is router/speculation_off.py's decision. Plain
functions: no I/O, no asyncio, the time is an argument; router/target_balance.py and
router/drafting.py apply them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

from pydantic import NonNegativeFloat, NonNegativeInt, PositiveInt

from router.speculation_off import SpecJob, VerifyCost, round_goodput
from router.views import DrafterView, TargetView
from specdec.core.request_state import CostMeter, RequestState
from specdec.rpc.config_model import Fraction, check_fields
from specdec.rpc.worker_config import strict_from_dict

__all__ = [
    "DraftDepthConfig",
    "DepthState",
    "DepthPlan",
    "saturation",
    "plan_depth",
    "depth_plan",
    "policy_k",
    "want_k",
    "predraft_room",
    "predraft_k",
    "round_k_cap",
    "capped",
    "is_catch_up",
]


@dataclass(frozen=True)
class DraftDepthConfig:
    """The router config's ``draft_depth`` section (the depth level by device load).

    low_utilization / high_utilization / band: a target is underused below ``low``, saturated
      above ``high``; it leaves a level only ``band`` past the threshold (hysteresis).
    growth_saturated: without GPM, saturated also needs each extra verified token to cost at least
      this share of a one-token verify (measured: the scheduler's verify line).
    samples / cooldown_s: a level changes after this many telemetry samples in a row ask for it,
      at most once per cooldown.
    deep_wait_share: ``deep`` only while rounds spend less than this share waiting for drafts (an
      idle target waiting on a slow drafter must not get longer drafts).
    deep_extra_k / deep_cost_scale: ``deep`` raises k_min by this much and scales the draft cost
      the adaptive k sees by this factor (longer drafts); ``shallow`` halves k_max.
    """

    low_utilization: Fraction = 0.35
    high_utilization: Fraction = 0.9
    band: NonNegativeFloat = 0.1
    growth_saturated: float = 0.15
    samples: PositiveInt = 3
    cooldown_s: NonNegativeFloat = 5.0
    deep_wait_share: float = 0.25
    deep_extra_k: NonNegativeInt = 1
    deep_cost_scale: float = 0.5

    def __post_init__(self) -> None:
        check_fields(self, "router.draft_depth")
        if not self.low_utilization < self.high_utilization:
            raise ValueError("router.draft_depth: need low_utilization < high_utilization")

    @classmethod
    def from_dict(cls, d: dict | DraftDepthConfig | None) -> DraftDepthConfig:
        return d if isinstance(d, cls) else strict_from_dict(cls, d, "router.draft_depth")


# ---- depth level by device load ------------------------------------------------------------------


@dataclass(frozen=True)
class DepthState:
    """A target's depth level and the evidence gathered for a change (returned by :func:`plan_depth`)."""

    level: str = "normal"
    changed_at: float = -math.inf
    want: str = "normal"  # what the latest samples asked for
    streak: int = 0  # how many samples in a row asked for ``want``


def saturation(v: TargetView, cfg: DraftDepthConfig) -> float | None:
    """How full the target's compute units are, in [0, 1]: GPM SM activity where offered; else the
    load when the measured verify cost grows with tokens (compute-bound), 0 when it does not."""
    if v.sm_active is not None:
        return v.sm_active
    if v.load is None or v.verify_growth is None:
        return None
    return v.load if v.verify_growth >= cfg.growth_saturated else 0.0


def _wanted_level(v: TargetView, level: str, cfg: DraftDepthConfig) -> str:
    if v.load is None:
        return level  # no telemetry: no evidence either way
    hi = cfg.high_utilization - (cfg.band if level == "shallow" else 0.0)
    sat = saturation(v, cfg)
    if sat is not None and sat >= hi:
        return "shallow"
    lo = cfg.low_utilization + (cfg.band if level == "deep" else 0.0)
    if v.load <= lo and v.draft_wait_share <= cfg.deep_wait_share and v.running > 0:
        return "deep"  # (an idle target is not underused: it has nothing to verify)
    return "normal"


def plan_depth(v: TargetView, state: DepthState, now: float, cfg: DraftDepthConfig) -> DepthState:
    """One telemetry sample's update of a target's depth level (``level != state.level``: an action)."""
    want = _wanted_level(v, state.level, cfg)
    streak = state.streak + 1 if want == state.want else 1
    if want != state.level and streak >= cfg.samples and now - state.changed_at >= cfg.cooldown_s and v.up:
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


def depth_plan(level: str, k_min: int, k_max: int, cfg: DraftDepthConfig) -> DepthPlan:
    if level == "deep":
        return DepthPlan(min(k_min + cfg.deep_extra_k, k_max), k_max, cfg.deep_cost_scale, True)
    if level == "shallow":
        return DepthPlan(k_min, max(k_min, k_max // 2), 1.0, False)
    return DepthPlan(k_min, k_max)


# ---- a request's draft length --------------------------------------------------------------------


def policy_k(state: RequestState) -> int:
    """The k a request's policy would choose now, before the bounds of its remaining tokens and the
    context (what a pre-draft is sized by)."""
    return state.adaptive.next_k() if state.adaptive is not None else state.fixed_k


def want_k(spec: str, state: RequestState, max_context: int, cost: CostMeter, plan: DepthPlan | None = None) -> int:
    """Draft tokens for a request's next round: none when off, else the request's k policy
    (:meth:`RequestState.next_k`) with the measured cost of a draft token (model drafts only;
    n-gram drafts cost the router next to nothing), scaled and bounded by the target's depth plan.
    Whether an AUTO request speculates at all is asked first (router/speculation_off.py)."""
    if spec == "off":
        return 0
    scale, k_range = (plan.cost_scale, (plan.k_lo, plan.k_hi)) if plan is not None else (1.0, None)
    return state.next_k(max_context, cost.per_token * scale if spec == "draft" else None, k_range)


def predraft_room(d: DrafterView | None, verify_s: float | None) -> int | None:
    """Draft steps a pre-draft may take on drafter ``d`` while its target verifies for ``verify_s``
    (None: no limit measured yet; 0: no pre-draft). A pre-draft must use the drafter's spare time:
    none on a drafter other targets draft on (their rounds would queue behind it), and no more
    steps than the verify hides (past it, a miss's redraft waits for it). With both pre-drafting on
    a shared or slow drafter lost to it off: 41 against 57 tok/s with `specdec bench rebalance`
    (tests/unit/test_draft_depth.py, test_a_predraft_takes_only_a_drafters_spare_time)."""
    if d is None or d.others:
        return 0
    if verify_s is None or d.run_step_s is None or d.run_step_s <= 0:
        return None
    return int(verify_s / d.run_step_s)


def predraft_k(
    policy_k: int, generated: int, k: int, max_tokens: int, tokens: int, max_context: int, room: int | None = None
) -> int:
    """Length of the pre-draft for round r+1, drafted while round r (``k`` draft tokens) verifies on
    the guess that all of it is accepted plus the target's bonus token (0: no pre-draft). It drafts
    that guess and its own tokens, so it runs its length + 1 steps: at most ``room``
    (:func:`predraft_room`; None: no bound)."""
    remaining = max_tokens - (generated + k + 1) - 1
    fit = policy_k if room is None else room - 1
    return max(0, min(policy_k, fit, remaining, max_context - (tokens + k + 1)))


def is_catch_up(new_tokens: int, k_max: int) -> bool:
    """Whether a drafter sent ``new_tokens`` it has not seen is catching up rather than drafting a
    step: more than a round commits (k_max drafts + the target's bonus token), as after a prompt's
    tail, a move, or rounds decoded with speculation off. Such a call prefills them, and its time
    says nothing of a draft step."""
    return new_tokens > k_max + 1


# ---- the longest draft of a round ----------------------------------------------------------------


def capped(jobs: Sequence[SpecJob], cap: int | None) -> list[SpecJob]:
    """``jobs`` with every draft length at most ``cap`` (None: as they are)."""
    if cap is None:
        return list(jobs)
    return [dataclasses.replace(j, k=min(j.k, cap)) if j.k > cap else j for j in jobs]


def round_k_cap(jobs: Sequence[SpecJob], cost: VerifyCost | None, margin: float) -> int | None:
    """The longest draft the round should carry (None: no cap). A round waits for its slowest
    draft, so one request's long draft (its own acceptance is high) makes every request of the
    round wait for it; each request's k is chosen as if it drafted alone. The cap is the one
    under which the round's goodput with every request speculating is highest, taken only when it
    beats no cap by more than ``margin`` (the speculation switch's ``off_margin``: a cap, like a
    switch, must clearly pay)."""
    if cost is None:
        return None
    longest = max((j.k for j in jobs), default=0)
    if longest <= 1:
        return None
    flags = [False] * len(jobs)
    g_none = round_goodput(jobs, flags, cost)
    best, best_g = None, g_none
    for cap in range(1, longest):  # every round: priced in place, no capped copies
        g = round_goodput(jobs, flags, cost, cap)
        if g > best_g:
            best, best_g = cap, g
    return best if best_g > g_none * (1.0 + margin) else None
