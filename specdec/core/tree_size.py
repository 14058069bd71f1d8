"""How many nodes of the drafted trees a round verifies, from measured costs (torch-free).

A node more in the verify is a chance more of a token, and a row more in the target's forward. On
the 2-core CPU a bf16 verify of 4 tokens costs 1.17 decode steps, 8 1.41 and 16 1.85
(docs/results.md, "Token trees"); a GPU is flatter. So the round keeps the nodes that
raise its expected tokens per second, Sequoia's rule with costs measured as the engine runs:

* **gain**: a node is on the accepted path with about the draft's probability of its path; the
  ratio of tokens accepted to the sum of those probabilities over recent rounds calibrates them.
* **cost**: the verify's seconds by the tokens it held (a running mean per width); a width not yet
  measured is taken to cost no more than its measured neighbours suggest, so it gets tried once
  and is then judged by its own measurement.

Nodes are added likeliest first over the whole batch (a node's parent is always likelier, so what
is kept is a tree) while ``(rows + expected tokens) / (draft seconds + verify seconds)`` grows.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from specdec.core.round_types import Draft

__all__ = ["TreeSizer"]

_EMA = 0.2
_CALIBRATION = (0.2, 1.5)


class TreeSizer:
    def __init__(self) -> None:
        self.verify_s: dict[int, float] = {}  # verify tokens -> running mean of seconds
        self.predicted, self.accepted = 1.0, 1.0  # running sums of expected and accepted tokens

    @property
    def calibration(self) -> float:
        return min(max(self.accepted / self.predicted, _CALIBRATION[0]), _CALIBRATION[1])

    def verify_cost(self, width: int) -> float | None:
        """Seconds of a verify of `width` tokens: measured, else interpolated between the measured
        widths around it, else (optimistically, so that it gets tried) the nearest narrower one's or
        the nearest wider one's scaled down by width. None before any measurement."""
        if width in self.verify_s:
            return self.verify_s[width]
        below = max((w for w in self.verify_s if w < width), default=None)
        above = min((w for w in self.verify_s if w > width), default=None)
        if below is not None and above is not None:
            lo, hi = self.verify_s[below], self.verify_s[above]
            return lo + (hi - lo) * (width - below) / (above - below)
        if below is not None:
            return self.verify_s[below]
        return None if above is None else self.verify_s[above] * width / above

    def cut(self, drafts: Sequence[Draft], draft_s: float) -> list[Draft]:
        """Each tree draft cut to the nodes worth verifying (in place); chains unchanged. The rows
        that are not tree nodes (a request's own, a chain's tokens) are verified whatever is cut."""
        nodes = sorted(  # likeliest first; among equals the earlier node (a sampled tree's earlier draw)
            ((p, b, i) for b, d in enumerate(drafts) if d.scores for i, p in enumerate(map(math.exp, d.scores))),
            key=lambda n: (-n[0], n[1], n[2]),
        )
        if not nodes:
            return list(drafts)
        cal, width = self.calibration, sum(1 + (0 if d.scores else d.k) for d in drafts)
        best_rate, expected, keep = -1.0, 0.0, 0
        base_tokens = len(drafts)
        for n, (p, _, _) in enumerate(nodes, start=1):
            expected += cal * p
            cost = self.verify_cost(width + n)
            if cost is None:  # nothing measured yet: verify everything once
                keep = len(nodes)
                break
            rate = (base_tokens + expected) / (draft_s + cost)
            if rate > best_rate:
                best_rate, keep = rate, n
        kept = {(b, i) for _, b, i in nodes[:keep]}
        return [d.keep([i for bb, i in kept if bb == b]) if d.scores else d for b, d in enumerate(drafts)]

    def observe_round(self, drafts: Sequence[Draft], accepted: Sequence[int], verify_s: float) -> None:
        """A round verified `drafts` (as cut) in `verify_s`; `accepted`: each one's accepted tokens."""
        self.observe(
            sum(d.k + 1 for d in drafts),
            verify_s,
            sum(expected_tokens(d) for d in drafts if d.scores),
            sum(n for d, n in zip(drafts, accepted) if d.scores),
        )

    def observe(self, width: int, verify_s: float, expected: float, accepted: int) -> None:
        """A round verified `width` tokens in `verify_s`; its trees expected `expected` accepted
        tokens (the kept nodes' probabilities) and got `accepted`."""
        old = self.verify_s.get(width)
        self.verify_s[width] = verify_s if old is None else old + _EMA * (verify_s - old)
        if expected > 0:
            self.predicted = self.predicted * (1 - _EMA) + expected * _EMA
            self.accepted = self.accepted * (1 - _EMA) + accepted * _EMA


def expected_tokens(draft: Draft) -> float:
    return sum(math.exp(s) for s in draft.scores or ())
