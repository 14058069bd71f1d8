"""Small statistics the benchmarks share."""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from typing import Any


def percentile(values: Sequence[float | None], q: float) -> float | None:
    """Linear-interpolated percentile (q in [0, 100]) of the values that are not None; None if none are."""
    xs = sorted(v for v in values if v is not None)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def bootstrap_band(
    items: Sequence[Any], stat: Callable[[list[Any]], float | None], draws: int = 1000, seed: int = 0
) -> tuple[float, float] | None:
    """The 10th-90th percentile of ``stat`` over ``draws`` resamples of ``items`` (drawn with
    replacement, as many as there are): how far the statistic of a run of this size moves with which
    requests it happened to hold. None with fewer than two items or no statistic."""
    if len(items) < 2:
        return None
    rng = random.Random(seed)
    values = [stat(rng.choices(items, k=len(items))) for _ in range(draws)]
    lo, hi = percentile(values, 10), percentile(values, 90)
    return None if lo is None or hi is None else (lo, hi)
