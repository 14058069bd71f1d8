"""Which target replica gets a new request.

Reads: every target replica as a :class:`router.views.TargetView` (waiting and running requests,
KV slots, up or not, its depth level from router/draft_depth.py).
Decides: the replica a new request goes to (:func:`pick_target`): up replicas first, then the
least load per slot (queue + batch, :func:`route_score`), saturated (``shallow``) replicas last.

Plain functions; router/server.py applies them. Adding or removing replicas (router/pool_size.py)
only changes the sequence passed in.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pydantic import NonNegativeFloat

from router.views import TargetView
from specdec.rpc.config_model import check_fields
from specdec.rpc.worker_config import strict_from_dict

__all__ = ["TargetChoiceConfig", "Route", "route_score", "pick_target"]


@dataclass(frozen=True)
class TargetChoiceConfig:
    """The router config's ``target_choice`` section.

    saturated_penalty: added to a saturated target's load per slot when routing.
    """

    saturated_penalty: NonNegativeFloat = 1.0

    def __post_init__(self) -> None:
        check_fields(self, "router.target_choice")

    @classmethod
    def from_dict(cls, d: dict | TargetChoiceConfig | None) -> TargetChoiceConfig:
        return d if isinstance(d, cls) else strict_from_dict(cls, d, "router.target_choice")


def route_score(t: TargetView, cfg: TargetChoiceConfig, *, with_level: bool = True) -> float:
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


def pick_target(targets: Sequence[TargetView], cfg: TargetChoiceConfig) -> Route:
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
