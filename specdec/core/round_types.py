"""What one speculative round exchanges: a draft (tokens and their sparse q) and the verdict.

Torch-free: the gRPC conversion and the router use these types.
"""

from __future__ import annotations

from dataclasses import dataclass

from specdec.core.token_tree import depths

__all__ = ["Draft", "SparseDist", "VerifyResult"]

SparseDist = tuple[list[int], list[float]]


@dataclass
class Draft:
    tokens: list[int]  # k >= 0 draft tokens
    # Per draft position, the sparse q (ids, probs) the token was sampled from (rejection mode).
    # None (or a position whose token is not in its ids) is verified as a point mass.
    probs: list[SparseDist] | None = None
    # A token tree (specdec/core/token_tree.py): each token's parent among `tokens`, -1 for a child
    # of the last committed token. None: a chain. Trees carry no probs (greedy and seeded modes).
    parents: list[int] | None = None

    @property
    def k(self) -> int:
        return len(self.tokens)

    @property
    def depth(self) -> int:
        """Draft tokens on the longest path: what a round can accept at most."""
        if self.parents is None:
            return len(self.tokens)
        return max(depths(self.parents), default=0)


@dataclass
class VerifyResult:
    tokens: list[int]  # accepted draft prefix + one target token; len == num_accepted + 1
    num_accepted: int
