"""Measured forward times made monotone: a forward over more rows or more tokens never costs less.

A profile's cells are medians of a few timings on a machine whose speed can drift by up to 2x
within seconds (a shared VM does), so a grid can come out with a 4-token verify cheaper
than a 1-token one. The simulator prices rounds from the grid and the router's verify-cost line is
fitted through those prices, and one such dip tilts the line enough to switch speculation off where
the service, fitting the same line through many real rounds, keeps it on. Isotonic regression (pool
adjacent violators) is the least-squares monotone fit: it averages the cells that disagree
instead of trusting either.
"""

from __future__ import annotations

__all__ = ["isotonic", "monotone_grid"]


def isotonic(values: list[float]) -> list[float]:
    """The non-decreasing sequence nearest to ``values`` in least squares (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [mean, count]
    for v in values:
        blocks.append([float(v), 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            m2, n2 = blocks.pop()
            m1, n1 = blocks[-1]
            blocks[-1] = [(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2]
    out: list[float] = []
    for mean, count in blocks:
        out.extend([mean] * int(count))
    return out


def monotone_grid(rows: list[list[float]], rounds: int = 20) -> list[list[float]]:
    """``rows[i][j]`` non-decreasing along each row and each column: isotonic fits of the rows and
    the columns in turn until neither changes anything (each pass only averages cells, so it
    settles; ``rounds`` bounds it)."""
    grid = [list(map(float, r)) for r in rows]
    for _ in range(rounds):
        before = [list(r) for r in grid]
        grid = [isotonic(r) for r in grid]
        columns = [isotonic([r[j] for r in grid]) for j in range(len(grid[0]))] if grid else []
        grid = [[columns[j][i] for j in range(len(columns))] for i in range(len(grid))]
        if grid == before:
            break
    return grid
