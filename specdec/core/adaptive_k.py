"""Per-sequence adaptive speculation length.

Keeps an exponentially weighted version of the truncated-geometric MLE a = N / (N + R)
(see :func:`specdec.core.speedup.estimate_acceptance`): N = accepted draft tokens, R = rounds that
ended in a rejection, both decayed by ``decay`` per round, seeded with a small prior.  The next k
is ``best_k(a_hat, c, k_max)`` clipped to [k_min, k_max].

k_min defaults to 1: with k = 0 no draft token is ever tested, so acceptance could never be
re-learned and a sequence that had a bad stretch would never speculate again.  One draft token
per round costs only c (a fraction of a target step) and keeps the estimate alive.  Callers that
must turn speculation off (e.g. a compute-bound batch) can pass k_min=0 or override per round.

The engine asks it directly; the router through router/draft_depth.py, which bounds and prices it
per target (depth level) and caps a round's longest draft.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from specdec.core.speedup import best_k

logger = logging.getLogger(__name__)

__all__ = ["AdaptiveK"]


@dataclass
class AdaptiveK:
    k_max: int = 8
    k_init: int | None = None  # None: best_k for the prior acceptance
    k_min: int = 1
    c: float = 0.4  # draft step / target step; update it from measurements
    decay: float = 0.8  # weight kept by the history at each round (memory ~ 1/(1-decay) rounds)
    prior_acceptance: float = 0.6
    prior_weight: float = 2.0  # pseudo-observations behind the prior (decays like real data)
    _acc: float = field(init=False, repr=False)
    _rej: float = field(init=False, repr=False)
    _rounds: int = field(init=False, default=0, repr=False)

    def __post_init__(self) -> None:
        if not 0 <= self.k_min <= self.k_max:
            raise ValueError(f"need 0 <= k_min <= k_max (got {self.k_min}, {self.k_max})")
        if not 0.0 <= self.decay < 1.0:
            raise ValueError(f"decay must be in [0, 1) (got {self.decay})")
        if not 0.0 <= self.prior_acceptance <= 1.0 or self.prior_weight < 0:
            raise ValueError("prior_acceptance must be in [0, 1] and prior_weight >= 0")
        self._acc = self.prior_weight * self.prior_acceptance
        self._rej = self.prior_weight * (1.0 - self.prior_acceptance)

    @property
    def evidence(self) -> tuple[float, float]:
        """(accepted tokens, rejections), decayed, prior included: the MLE's counts."""
        return self._acc, self._rej

    @property
    def acceptance(self) -> float:
        """Current estimate of per-token acceptance."""
        total = self._acc + self._rej
        return self.prior_acceptance if total <= 0 else self._acc / total

    def update(self, drafted: int, accepted: int) -> None:
        """Record one round: ``drafted`` draft tokens sent, ``accepted`` of them accepted."""
        if not 0 <= accepted <= max(drafted, 0):
            raise ValueError(f"accepted={accepted} outside [0, drafted={drafted}]")
        if drafted <= 0:  # a k=0 (or fail-open) round tests nothing
            return
        self._acc = self.decay * self._acc + accepted
        self._rej = self.decay * self._rej + (1.0 if accepted < drafted else 0.0)
        self._rounds += 1

    def next_k(self) -> int:
        if self._rounds == 0 and self.k_init is not None:
            return min(max(self.k_init, self.k_min), self.k_max)
        return best_k(self.acceptance, self.c, self.k_max, self.k_min)
