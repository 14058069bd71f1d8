"""Small statistics the benchmarks share."""

from __future__ import annotations

import math
from collections.abc import Sequence


def percentile(values: Sequence[float | None], q: float) -> float | None:
    """Linear-interpolated percentile (q in [0, 100]) of the values that are not None; None if none are."""
    xs = sorted(v for v in values if v is not None)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)
