"""How big each pool is: when to add or drain a draft or target replica.

Reads: every target and drafter as the other decisions see them (:class:`router.views.TargetView`,
:class:`router.views.DrafterView`: queue, batch, slots, device load, draft-wait share), the
replicas launching and draining, and the time.
Decides: per pool and telemetry sample, at most one action (:func:`plan_pool`): grow by one,
drain one, or nothing. Plain functions: no I/O, no asyncio, the time is an argument, so the
capacity simulator can run them unchanged. router/autoscaler.py applies the decisions through an
actuator (cluster/ places new replicas as Ray actors, asking Ray's autoscaler for nodes).

* Draft pool grows when targets wait on drafts (a draft-wait share of the round above
  ``draft_wait_share_up``: waiting longer than verifying) while the drafters are saturated (device
  load at least ``drafter_busy``, or every KV slot taken), or when it has no drafter at all while
  requests run (scaled to zero).
* Target pool grows when the queue outgrows what the replicas drain: more than
  ``scale_up_queue`` waiting requests per replica.
* A pool shrinks by one when it has stayed underused for ``scale_down_after_s``: the replica with
  the least work is drained (no new work; its in-flight requests finish) and then removed.

Hysteresis: growing needs ``up_samples`` pressured samples in a row; shrinking needs the pool
underused for a whole window, and "underused" sits well below "pressured" (separate thresholds).
After any action on a pool, ``cooldown_s`` passes before the next. Replica counts stay within
``[min_replicas, max_replicas]``; below the minimum (a replica lost) the pool grows at once.
Replicas still launching count toward the size, so a slow node launch never doubles a request.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from pydantic import NonNegativeFloat, NonNegativeInt, PositiveInt, StrictBool

from router.views import DrafterView, TargetView
from specdec.rpc.config_model import Fraction, check_fields
from specdec.rpc.worker_config import strict_from_dict

__all__ = [
    "PoolLimits",
    "PoolSizeConfig",
    "PoolObservation",
    "ScaleState",
    "ScaleAction",
    "draft_observation",
    "target_observation",
    "plan_pool",
]

POOLS = ("draft", "target")


@dataclass(frozen=True)
class PoolLimits:
    """Bounds of one pool's replica count."""

    min_replicas: NonNegativeInt = 1
    max_replicas: NonNegativeInt = 1

    def __post_init__(self) -> None:
        check_fields(self, "router.scaling")
        if not self.min_replicas <= self.max_replicas:
            raise ValueError(f"need 0 <= min_replicas <= max_replicas (got {self.min_replicas}, {self.max_replicas})")


@dataclass(frozen=True)
class PoolSizeConfig:
    """The router config's ``scaling`` section (off unless ``enabled``).

    draft / target: :class:`PoolLimits` of each pool.
    scale_up_queue: waiting requests per target replica above which the target pool grows.
    draft_wait_share_up: targets' share of round time spent waiting on drafts above which drafts
      are short (0.5: waiting as long as verifying).
    drafter_busy: a drafter's device load at or above this is saturated.
    up_samples: pressured samples in a row before growing (hysteresis).
    low_load / low_occupancy: a pool is underused while its mean device load is below
      ``low_load`` (an unknown load counts as busy while it has work) and its mean share of KV slots
      in use below ``low_occupancy``, with nobody waiting.
    scale_down_after_s: underused this long in a row -> drain one replica.
    cooldown_s: seconds between two actions on one pool.
    drain_timeout_s: a draining replica is removed after this even if requests remain (they fail
      over losslessly: the router replays their committed tokens).
    launch_timeout_s: a replica (and the node it needs) that has not answered after this is given
      up: logged and counted, never waited on forever.
    """

    enabled: StrictBool = False
    draft: PoolLimits = field(default_factory=lambda: PoolLimits(0, 4))
    target: PoolLimits = field(default_factory=lambda: PoolLimits(1, 2))
    scale_up_queue: NonNegativeFloat = 2.0
    draft_wait_share_up: Fraction = 0.5
    drafter_busy: Fraction = 0.8
    up_samples: PositiveInt = 2
    low_load: Fraction = 0.2
    low_occupancy: Fraction = 0.25
    scale_down_after_s: NonNegativeFloat = 60.0
    cooldown_s: NonNegativeFloat = 10.0
    drain_timeout_s: NonNegativeFloat = 60.0
    launch_timeout_s: NonNegativeFloat = 300.0

    def __post_init__(self) -> None:
        for pool in POOLS:
            v = getattr(self, pool)
            if isinstance(v, dict):
                object.__setattr__(self, pool, PoolLimits(**v))
        check_fields(self, "router.scaling")

    def limits(self, pool: str) -> PoolLimits:
        return getattr(self, pool)

    @classmethod
    def from_dict(cls, d: dict | PoolSizeConfig | None) -> PoolSizeConfig:
        return d if isinstance(d, PoolSizeConfig) else strict_from_dict(cls, d, "router.scaling")


@dataclass(frozen=True)
class PoolObservation:
    """One pool at one telemetry sample, as :func:`plan_pool` needs it.

    serving: replicas taking new work (draining ones excluded); pending: replicas launching;
    draining: replicas finishing their requests. pressured / underused: this sample's evidence;
    why: a few words for the log. victim: the replica to drain if the pool shrinks.
    """

    pool: str
    serving: int
    pending: int = 0
    draining: int = 0
    pressured: bool = False
    underused: bool = False
    why: str = ""
    victim: str | None = None


@dataclass(frozen=True)
class ScaleState:
    """A pool's scaling memory between samples (returned by :func:`plan_pool`)."""

    streak: int = 0  # pressured samples in a row
    low_since: float | None = None  # start of the current underused window
    acted_at: float = -math.inf


@dataclass(frozen=True)
class ScaleAction:
    """action: scale_up_draft | scale_up_target | drain_draft | drain_target."""

    action: str
    pool: str
    reason: str
    victim: str | None = None


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def _victim(views: Sequence[tuple[str, float]]) -> str | None:
    """The replica with the least work (ties: the last one, the newest)."""
    best = None
    for name, work in views:
        if best is None or work <= best[1]:
            best = (name, work)
    return best[0] if best else None


def draft_observation(
    targets: Sequence[TargetView],
    drafters: Sequence[DrafterView],
    cfg: PoolSizeConfig,
    *,
    pending: int = 0,
    draining: Sequence[str] = (),
) -> PoolObservation:
    """The draft pool's evidence: targets waiting on drafts with every serving drafter saturated."""
    serving = [d for d in drafters if d.up and d.name not in draining]
    live = [t for t in targets if t.up]
    wait = max((t.draft_wait_share for t in live), default=0.0)
    busy = [d for d in serving if (d.load is not None and d.load >= cfg.drafter_busy) or not d.has_room]
    short = wait > cfg.draft_wait_share_up
    work = sum(t.waiting + t.running for t in live)
    # no drafter at all (a pool scaled to zero) while requests run: they decode without drafts; one
    # launching already answers that (else each cooldown launches another, node and all)
    pressured = (short and bool(serving) and len(busy) == len(serving)) or (not serving and not pending and work > 0)
    loads = [d.load if d.load is not None else float(d.in_flight > 0) for d in serving]
    occupancy = [d.jobs / d.slots for d in serving if d.slots]
    underused = bool(serving) and not short and _mean(loads) < cfg.low_load and _mean(occupancy) < cfg.low_occupancy
    why = (
        f"draft wait {wait:.0%} of rounds, {len(busy)}/{len(serving)} drafters saturated"
        if serving
        else f"no drafter while {work} request(s) wait or run"
    )
    victim = _victim([(d.name, d.jobs + d.in_flight) for d in serving])
    return PoolObservation("draft", len(serving), pending, len(draining), pressured, underused, why, victim)


def target_observation(
    targets: Sequence[TargetView], cfg: PoolSizeConfig, *, pending: int = 0, draining: Sequence[str] = ()
) -> PoolObservation:
    """The target pool's evidence: queue per serving replica against ``scale_up_queue``."""
    serving = [t for t in targets if t.up and t.name not in draining]
    waiting = sum(t.waiting for t in serving)
    per = waiting / max(1, len(serving))
    occupancy = _mean([t.running / max(1, t.capacity) for t in serving])
    loads = [t.load if t.load is not None else t.running / max(1, t.capacity) for t in serving]
    underused = bool(serving) and waiting == 0 and _mean(loads) < cfg.low_load and occupancy < cfg.low_occupancy
    why = f"{waiting} waiting on {len(serving)} replica(s) ({per:.1f} each), {occupancy:.0%} of slots in use"
    victim = _victim([(t.name, t.waiting + t.running) for t in serving])
    pressured = per > cfg.scale_up_queue
    return PoolObservation("target", len(serving), pending, len(draining), pressured, underused, why, victim)


def plan_pool(
    obs: PoolObservation, state: ScaleState, now: float, cfg: PoolSizeConfig
) -> tuple[ScaleState, ScaleAction | None]:
    """One sample's decision for one pool: the new state and at most one action."""
    lim = cfg.limits(obs.pool)
    size = obs.serving + obs.pending  # launching replicas count: no second request for the same need
    streak = state.streak + 1 if obs.pressured else 0
    low_since = (state.low_since if state.low_since is not None else now) if obs.underused else None
    cooled = now - state.acted_at >= cfg.cooldown_s
    if size < lim.min_replicas:  # a replica was lost: restore the minimum, no hysteresis
        act = ScaleAction(f"scale_up_{obs.pool}", obs.pool, f"{size} replica(s) < min_replicas {lim.min_replicas}")
        return ScaleState(0, None, now), act
    if streak >= cfg.up_samples and cooled and size < lim.max_replicas:
        return ScaleState(0, None, now), ScaleAction(f"scale_up_{obs.pool}", obs.pool, obs.why)
    if (
        low_since is not None
        and now - low_since >= cfg.scale_down_after_s
        and cooled
        and obs.pending == 0
        and obs.draining == 0
        and obs.serving > lim.min_replicas
        and obs.victim is not None
    ):
        reason = f"underused for {now - low_since:.0f} s ({obs.why})"
        return ScaleState(0, None, now), ScaleAction(f"drain_{obs.pool}", obs.pool, reason, obs.victim)
    return ScaleState(streak, low_since, state.acted_at), None
