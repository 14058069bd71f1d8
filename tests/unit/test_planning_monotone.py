"""A profile's timings made monotone (cluster/planning/monotone.py), and its cells timed in
interleaved passes (cluster/planning/profiler.py): the two guards against a shared machine's
speed windows giving the simulator a grid where more work costs less."""

from __future__ import annotations

import pytest

from cluster.planning.monotone import isotonic, monotone_grid
from cluster.planning.profiler import _Budget, _passes


def _non_decreasing(xs: list[float]) -> bool:
    return all(a <= b for a, b in zip(xs, xs[1:]))


def test_isotonic_averages_the_cells_that_disagree_and_keeps_the_rest():
    assert isotonic([1.0, 2.0, 3.0]) == [1.0, 2.0, 3.0]
    # A dip (a 4-token verify timed in a fast window): the two cells meet at their mean.
    assert isotonic([153.0, 132.0, 152.0, 182.0]) == pytest.approx([142.5, 142.5, 152.0, 182.0])
    out = isotonic([5.0, 1.0, 1.0, 9.0, 2.0])
    assert _non_decreasing(out) and sum(out) == pytest.approx(18.0)  # the least-squares fit keeps the mean


def test_monotone_grid_is_monotone_along_rows_and_columns():
    # The grid of a profile that switched the simulated router's speculation off (seen in the
    # accuracy test): batch 1 [153, 132, 152, 182], batch 4 [140, 187, 258, 460].
    raw = [[153.0, 132.5, 152.7, 182.5], [140.3, 186.8, 258.4, 460.1]]
    grid = monotone_grid(raw)
    assert all(_non_decreasing(row) for row in grid)
    assert all(_non_decreasing([row[j] for row in grid]) for j in range(4))
    assert grid[1][3] == pytest.approx(460.1) and grid[1][2] == pytest.approx(258.4)  # untouched where sane
    assert monotone_grid([[1.0, 2.0], [3.0, 4.0]]) == [[1.0, 2.0], [3.0, 4.0]]


def test_passes_time_every_cell_once_per_pass_in_turn():
    order: list[str] = []

    def time_once(key: str) -> float:
        order.append(key)
        return 1.0

    samples = {"a": [1.0], "b": [1.0], "c": [1.0]}
    _passes(samples, time_once, repeat=3, budget=_Budget(60.0, lambda _: None), what="grid")
    assert order == ["a", "b", "c", "a", "b", "c"]  # interleaved, not a, a, b, b, c, c
    assert all(len(v) == 3 for v in samples.values())
    # No time left: the first pass's single timings stand.
    samples = {"a": [1.0]}
    _passes(samples, time_once, repeat=3, budget=_Budget(0.0, lambda _: None), what="grid")
    assert samples == {"a": [1.0]}
