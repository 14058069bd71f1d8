"""What one speculative round exchanges: a draft (tokens and their sparse q) and the verdict.

Torch-free: the gRPC conversion and the router use these types.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
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
    # of the last committed token. None: a chain. A tree with probs is a sampled tree: each node's
    # q is its parent's, the siblings drawn from it without replacement in their order
    # (specdec/core/tree_sampling.py); greedy and seeded trees carry no probs.
    parents: list[int] | None = None
    # Per tree node, the log of the draft's probability of the path to it (how likely the target is
    # to accept it): what the round's tree size is chosen by (specdec/core/tree_size.py).
    scores: list[float] | None = None

    @property
    def k(self) -> int:
        return len(self.tokens)

    @property
    def depth(self) -> int:
        """Draft tokens on the longest path: what a round can accept at most."""
        if self.parents is None:
            return len(self.tokens)
        return max(depths(self.parents), default=0)

    def holds(self, accepted: Sequence[int]) -> bool:
        """Whether `accepted` is a prefix of the chain, or the tokens of a path of the tree from its root."""
        if self.parents is None:
            return list(accepted) == self.tokens[: len(accepted)]
        node = -1
        for t in accepted:
            node = next((i for i, p in enumerate(self.parents) if p == node and self.tokens[i] == t), None)
            if node is None:
                return False
        return True

    def keep(self, nodes: Iterable[int]) -> Draft:
        """Keep only the given nodes (of a tree: those whose parent is kept too; of a sampled tree,
        also whose earlier siblings are, as each was drawn given them), renumbered; in place, so
        whoever holds the draft (a timing wrapper) sees what is verified. Returns it."""
        wanted = set(nodes)
        sampled = self.parents is not None and self.probs is not None
        index: dict[int, int] = {}
        cut_under: set[int] = set()  # parents of a sampled tree that lost a child: later ones go too
        for i in range(len(self.tokens)):
            parent = -1 if self.parents is None else self.parents[i]
            if i in wanted and (parent < 0 or parent in index) and parent not in cut_under:
                index[i] = len(index)
            elif sampled:
                cut_under.add(parent)
        kept = list(index)
        if self.parents is not None:
            self.parents = [-1 if self.parents[i] < 0 else index[self.parents[i]] for i in kept]
        self.tokens = [self.tokens[i] for i in kept]
        self.probs = None if self.probs is None else [self.probs[i] for i in kept]
        self.scores = None if self.scores is None else [self.scores[i] for i in kept]
        return self


@dataclass
class VerifyResult:
    tokens: list[int]  # accepted draft prefix + one target token; len == num_accepted + 1
    num_accepted: int
