"""Which drafter serves a request, and what its drafts cost (docs/design.md "Rebalancing and
scaling").

Reads: every drafter as a :class:`router.views.DrafterView` (measured seconds per draft step, run
time and queueing, calls in flight, device load, KV slots, which targets it drafts for), the
request's current drafter and when it last moved, and the time.
Decides: where a request drafts next (:func:`assign_drafter`: keep, place, move or fail over), and
which drafter's cost a request's speculation decision prices (:func:`priced_drafter`,
:func:`is_guess`; router/speculation_off.py weighs it).

Drafters are one pool shared by every target. A new request goes where its target's other
requests draft, else to an idle drafter, else to a shared one (a round waits for every drafter its
requests use), and among those to the one with the most headroom (:func:`placement_cost`); only
drafters a move would not take it away from at once count. A request stays on its drafter (its KV
cache is there) unless that drafter is down (``failover``) or its measured cost is ``move_margin``
times the best one's (``draft_move``), at most once per ``move_cooldown_s`` after a move. The
request's own drafter must have been measured lately (``stale_s``); the one it moves to may be
idle, its last measurement standing until ``forget_s``.

Plain functions: no I/O, no asyncio, the time is an argument. router/drafter_pool.py applies them
(and measures the drafters with ``latency_weight``); the capacity simulator runs the same pool.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated

from pydantic import Field, NonNegativeFloat, PositiveFloat

from router.views import DrafterView
from specdec.rpc.config_model import Fraction, check_fields
from specdec.rpc.worker_config import strict_from_dict

__all__ = [
    "DrafterChoiceConfig",
    "Assignment",
    "placement_cost",
    "move_cost",
    "priced_drafter",
    "guessed_price",
    "is_guess",
    "assign_drafter",
]


@dataclass(frozen=True)
class DrafterChoiceConfig:
    """The router config's ``drafter_choice`` section.

    latency_weight: EWMA weight of each new round in a drafter's measured seconds per step.
    stale_s / forget_s: a request moves off its drafter only on a measurement of it within
      ``stale_s`` (its own rounds keep that fresh), and onto a drafter measured within
      ``forget_s`` (an idle drafter is not measured again: its last figure stands until then, so
      requests on a drafter that slowed can move to one that has nothing to do); new requests are
      placed by a drafter's last measurement until it is ``forget_s`` old, then by the pool's
      median (a drafter that recovered meanwhile gets requests again).
    move_margin / move_cooldown_s: a request moves off its drafter only when its cost is more than
      ``move_margin`` times the best drafter's, and at most once per ``move_cooldown_s``.
    util_weight / hot_utilization: a drafter's placement cost grows by ``util_weight`` x its device
      load, and by up to 1 more as the load goes from ``hot_utilization`` to 1 (busy with other work).
    """

    latency_weight: PositiveFloat = 0.3
    stale_s: PositiveFloat = 10.0
    forget_s: PositiveFloat = 60.0
    move_margin: Annotated[float, Field(ge=1.0)] = 1.5  # a ratio of costs
    move_cooldown_s: NonNegativeFloat = 2.0
    util_weight: NonNegativeFloat = 0.5
    hot_utilization: Fraction = 0.9

    def __post_init__(self) -> None:
        check_fields(self, "router.drafter_choice")

    @classmethod
    def from_dict(cls, d: dict | DrafterChoiceConfig | None) -> DrafterChoiceConfig:
        return d if isinstance(d, cls) else strict_from_dict(cls, d, "router.drafter_choice")


@dataclass(frozen=True)
class Assignment:
    """Where a request's next drafts come from. action: keep | place | move | failover | none."""

    drafter: str | None
    action: str
    reason: str = ""


def _known_step(d: DrafterView, within_s: float) -> float | None:
    return d.step_s if d.step_s is not None and d.age_s <= within_s else None


def priced_drafter(own: str | None, views: dict[str, DrafterView], cfg: DrafterChoiceConfig) -> DrafterView | None:
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


def guessed_price(v: DrafterView, cfg: DrafterChoiceConfig) -> DrafterView:
    """A measurement ``age_s`` old, priced at half its cost for every ``stale_s`` past ``stale_s``
    (its prefill price too: one measured while the drafter was slow must not keep a request that
    would catch it up off for good)."""
    f = 0.5 ** (max(0.0, v.age_s - cfg.stale_s) / cfg.stale_s)
    run = v.run_step_s * f if v.run_step_s is not None else None
    prefill = v.prefill_token_s * f if v.prefill_token_s is not None else None
    return dataclasses.replace(
        v, step_s=v.step_s * f, fixed_s=v.fixed_s * f, run_step_s=run, queue_s=v.queue_s * f, prefill_token_s=prefill
    )


def is_guess(v: DrafterView | None, cfg: DrafterChoiceConfig) -> bool:
    """Whether a price is a guess (never measured, or measured more than ``stale_s`` ago): at
    most one request switches speculation on by a guess (router/speculation_off.py)."""
    return v is None or _known_step(v, cfg.stale_s) is None


def _fallback_step(drafters: Sequence[DrafterView], cfg: DrafterChoiceConfig) -> float:
    known = sorted(s for d in drafters if d.up and (s := _known_step(d, cfg.forget_s)) is not None)
    return known[len(known) // 2] if known else 1.0


def _load_factor(d: DrafterView, cfg: DrafterChoiceConfig) -> float:
    """1 + util_weight x load, plus up to 1 more as the load goes from hot_utilization to 1 (hot:
    busy with other work). Continuous, so noise around a threshold cannot flip a decision."""
    load = min(max(d.load or 0.0, 0.0), 1.0)
    hot = max(0.0, load - cfg.hot_utilization) / max(1e-9, 1.0 - cfg.hot_utilization)
    return 1.0 + cfg.util_weight * load + hot


def placement_cost(d: DrafterView, drafters: Sequence[DrafterView], cfg: DrafterChoiceConfig) -> float:
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


def move_cost(d: DrafterView, cfg: DrafterChoiceConfig, within_s: float | None = None) -> float | None:
    """The cost used to decide moves: how long a draft step runs there (:attr:`DrafterView.
    run_step_s`; before any is measured, :attr:`DrafterView.per_step_s`). Queueing and the device
    load are left out on purpose: both follow the placement (moving requests onto a drafter makes
    it queue and busy), so chasing them made requests oscillate (1,025 moves of 200 requests in one
    `specdec plan` simulation); placement weighs them instead. A device slowed by other work
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
    rebalancer then lost 18 % to static pairing with equal drafters)."""
    if d.mates:
        return 0 if not d.others else 2
    return 1 if not d.others else 3


def assign_drafter(
    current: str | None,
    drafters: Sequence[DrafterView],
    *,
    moved_at: float | None,
    now: float,
    cfg: DrafterChoiceConfig,
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
    measured = [(c, d) for d in roomy if d is not cur and (c := move_cost(d, cfg, cfg.forget_s)) is not None]
    if c_cur is None or not measured:
        return Assignment(cur.name, "keep", "not measured")
    c_best, target = min(measured, key=lambda x: (x[0], x[1].name))
    if c_cur > cfg.move_margin * c_best:
        return Assignment(target.name, "move", f"{cur.name} costs {c_cur / c_best:.1f}x {target.name}")
    return Assignment(cur.name, "keep", "")
