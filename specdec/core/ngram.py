"""Prompt-lookup (n-gram) drafter: no model, proposes tokens copied from earlier in the sequence.

For each sequence (prompt + generated tokens) find the earliest occurrence of its longest suffix
n-gram (n from max_ngram down to min_ngram) and propose the tokens that followed it. The earliest,
as vLLM's n-gram proposer takes it: text being copied (code rewritten from the prompt) continues
the original, where a recent occurrence is often a short local echo. On HumanEval it raised the
tokens per round at k 4 from 4.03 to 4.45 (docs/results.md, "Beside vLLM's CPU build").

The copy is LZ77-style: when the continuation runs into the end of the sequence, the
proposal keeps copying its own output with the same period, so a repeated pattern (e.g. a run of
spaces) still yields k tokens.

Every draft carries point-mass distributions probs = [([tok], [1.0]), ...]: the proposal is
deterministic, and verifying it against a point mass keeps rejection sampling exactly lossless.

Search runs in C: token ids are packed as 4-byte words and ``bytes.find`` finds the suffix;
matches not aligned to a word boundary are skipped.  A few thousand tokens take microseconds.
"""

from __future__ import annotations

import logging
from array import array
from collections.abc import Sequence

from specdec.core.round_types import Draft

logger = logging.getLogger(__name__)

__all__ = ["NgramDrafter"]

_W = 4  # bytes per packed token id


def _pack(tokens: Sequence[int]) -> bytes:
    return array("I", tokens).tobytes()


class NgramDrafter:
    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram (got {min_ngram}, {max_ngram})")
        if array("I").itemsize != _W:  # pragma: no cover - every supported platform has 4-byte 'I'
            raise RuntimeError("array('I') is not 4 bytes on this platform")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def find(self, tokens: Sequence[int]) -> tuple[int, int] | None:
        """(start of the earliest match, n) for the longest matching suffix n-gram."""
        length = len(tokens)
        if length < 2:
            return None
        hay = _pack(tokens)
        for n in range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1):
            pat = hay[(length - n) * _W :]
            # A match must start at token i <= length - n - 1 (strictly before the suffix itself).
            start, end = 0, (length - 1) * _W
            while True:
                b = hay.find(pat, start, end)
                if b < 0:
                    break
                if b % _W == 0:
                    return b // _W, n
                start = b + 1  # misaligned hit: look further right
        return None

    def propose_one(self, tokens: Sequence[int], k: int) -> Draft:
        if k <= 0:
            return Draft(tokens=[], probs=[])
        hit = self.find(tokens)
        if hit is None:
            return Draft(tokens=[], probs=[])
        i, n = hit
        length = len(tokens)
        # Predict x[L + j] = x[L + j - period]: the continuation of the match at i, period >= 1.
        period = length - n - i
        out: list[int] = []
        for j in range(k):
            pos = length + j - period
            # Past the end of the sequence the copy continues from its own proposal.
            out.append(int(tokens[pos]) if pos < length else out[pos - length])
        return Draft(tokens=out, probs=[([t], [1.0]) for t in out])

    def propose(self, sequences: Sequence[Sequence[int]], ks: Sequence[int]) -> list[Draft]:
        """One draft per sequence with up to ``ks[b]`` tokens (empty when nothing matches)."""
        if len(sequences) != len(ks):
            raise ValueError("sequences and ks must have the same length")
        return [self.propose_one(seq, k) for seq, k in zip(sequences, ks)]
