"""What one speculative round exchanges: a draft (tokens and their sparse q) and the verdict.

Torch-free: the gRPC conversion and the router use these types.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Draft", "SparseDist", "VerifyResult"]

SparseDist = tuple[list[int], list[float]]


@dataclass
class Draft:
    tokens: list[int]  # k >= 0 draft tokens
    # Per draft position, the sparse q (ids, probs) the token was sampled from (rejection mode).
    # None (or a position whose token is not in its ids) is verified as a point mass.
    probs: list[SparseDist] | None = None

    @property
    def k(self) -> int:
        return len(self.tokens)


@dataclass
class VerifyResult:
    tokens: list[int]  # accepted draft prefix + one target token; len == num_accepted + 1
    num_accepted: int
