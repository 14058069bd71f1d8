"""Token trees in the simulator: the tree a simulated draft worker proposes, the path the simulated
target accepts in it, and what the acceptance model expects of it (docs/design.md, "Token trees").

**Shape.** As the draft worker's ``TreeShape`` (specdec/core/tree_drafting.py) grows it: the root's
``width`` best children, then per level the ``expand`` likeliest nodes of the level before (the
draft's own chain first) each add their ``width`` best; ``expand`` 0 is the chain with each
position's runners-up as leaves. The tree is then cut to its ``nodes`` likeliest, own chain first.

**Tokens.** A node's token is its rank among its siblings in the drafter's ranking: 0 (``MATCH``,
sim_workers.py) is the drafter's first choice, 1, 2, ... its runners-up. Siblings differ, so the
router's own check that the accepted tokens are a path of the tree (``Draft.holds``) reads the
sampled path; the target's token after the path is the rank of its token there (``width``: one
the drafter did not rank).

**Acceptance, by depth and rank.** At depth j the first choice is the target's token with the chain
model's chance a_j (``AcceptanceModel.accept_p``); where it is not, each runner-up in rank order
catches ``runner_up`` of the misses left before it, so the child of rank r >= 1 is the target's
token with (1 - a_j) * runner_up * (1 - runner_up)^(r - 1). Past the depth the chain model's draft_p
says the drafter would have stopped at, nothing is accepted, as in a chain. With ``runner_up`` 0 a
tree accepts what its own chain does. A node's score (the log of its path's chance) is what the router's
``TreeSizer`` cuts by; the sizer calibrates scores against what is accepted, as it does a real
drafter's.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from cluster.planning.workload import AcceptanceModel
from specdec.core.draft_options import draft_options_from_dict
from specdec.core.round_types import Draft
from specdec.core.token_tree import depths, draft_order

__all__ = ["SimTrees", "TreeTally", "rank_chance", "draft_tree", "accept_path", "expected_accepted", "chain_expected"]

_FLOOR = 1e-9  # a chance of 0 as a score: scores are finite logs (specdec/rpc/convert.py)


@dataclass(frozen=True)
class SimTrees:
    """What trees the simulated draft worker drafts (its ``--tree-width``, ``--tree-expand`` and
    ``--tree-nodes``) and the extra chance of its runners-up (module docstring)."""

    width: int = 3
    expand: int = 4
    nodes: int = 16
    runner_up: float = 0.0

    def __post_init__(self) -> None:
        if min(self.width, self.nodes) < 1 or self.expand < 0 or not 0.0 <= self.runner_up <= 1.0:
            raise ValueError(f"a simulated tree needs width, nodes >= 1, expand >= 0, runner_up in [0, 1]: {self}")

    @classmethod
    def of_draft_worker(cls, draft_options: dict | None, runner_up: float = 0.0) -> SimTrees | None:
        """The trees a draft worker of these ``draft_options`` drafts (specdec/core/build.py: a
        tree where ``tree_width`` > 1), or None (chains)."""
        o = draft_options_from_dict(draft_options)
        if o.tree_width <= 1:
            return None
        return cls(width=o.tree_width, expand=o.tree_expand, nodes=o.tree_nodes, runner_up=runner_up)


def rank_chance(a: float, rank: int, runner_up: float) -> float:
    """The chance that the drafter's guess of ``rank`` at a node is the target's token there, with
    ``a`` its first choice's."""
    if rank == 0:
        return a
    return (1.0 - a) * runner_up * (1.0 - runner_up) ** (rank - 1)


@dataclass
class _Node:
    rank: int
    parent: int
    depth: int
    logp: float
    own: bool


def _order(node: _Node) -> tuple:
    return draft_order(node.own, node.logp, node.depth)


def draft_tree(shape: SimTrees, accept_p: list[float], depth: int) -> Draft:
    """The tree of ``shape`` and ``depth`` levels, scored with the chances by depth ``accept_p``
    (past its end the last holds)."""

    def children(parent: int, at: int, logp: float, own: bool) -> list[_Node]:
        a = AcceptanceModel.at(accept_p, at - 1)
        return [
            _Node(r, parent, at, logp + math.log(max(rank_chance(a, r, shape.runner_up), _FLOOR)), own and r == 0)
            for r in range(shape.width)
        ]

    if depth <= 0:
        return Draft(tokens=[])
    nodes = children(-1, 1, 0.0, True)
    for level in range(1, depth):
        frontier = [i for i, n in enumerate(nodes) if n.depth == level]
        if shape.expand == 0:  # the chain's forwards only: its runners-up stay leaves
            grow = [i for i in frontier if nodes[i].own]
        else:
            grow = sorted(frontier, key=lambda i: _order(nodes[i]))[: shape.expand]
        for i in grow:
            nodes.extend(children(i, level + 1, nodes[i].logp, nodes[i].own))
    whole = Draft(tokens=[n.rank for n in nodes], parents=[n.parent for n in nodes], scores=[n.logp for n in nodes])
    return whole.keep(sorted(range(len(nodes)), key=lambda i: _order(nodes[i]))[: shape.nodes])


def _children(draft: Draft) -> dict[int, dict[int, int]]:
    """Per node (-1: the root), its children by token (rank)."""
    out: dict[int, dict[int, int]] = {}
    for i, (t, p) in enumerate(zip(draft.tokens, draft.parents or ())):
        out.setdefault(p, {})[t] = i
    return out


def accept_path(
    draft: Draft, accept_p: list[float], drafted: int, shape: SimTrees, rng: random.Random
) -> tuple[list[int], int]:
    """The target's walk of the tree, drawn: the accepted tokens (ranks, root first) and the
    target's token after them. ``drafted``: the depth the drafter would have reached (the chain
    model's draft_p draw), past which nothing is accepted."""
    kids = _children(draft)
    node, path = -1, []
    while True:
        a = AcceptanceModel.at(accept_p, len(path))
        want = 0 if rng.random() < a else _runner_up_rank(shape, rng)
        nxt = kids.get(node, {}).get(want)
        if nxt is None or len(path) >= drafted:
            return path, want if nxt is None else shape.width
        path.append(want)
        node = nxt


def _runner_up_rank(shape: SimTrees, rng: random.Random) -> int:
    """Where the first choice missed: the runner-up that catches it, else ``width`` (unranked)."""
    for rank in range(1, shape.width):
        if rng.random() < shape.runner_up:
            return rank
    return shape.width


def expected_accepted(
    draft: Draft, accept_p: list[float], draft_p: list[float], runner_up: float
) -> tuple[float, float]:
    """Mean and variance of the tokens a tree accepts under the model: a node is accepted with its
    path's chance (each step's rank chance and the drafter's reaching that depth); two nodes both
    are only where one is the other's ancestor, so E[A^2] = sum over nodes of P(node) (2 depth - 1)."""
    parents = draft.parents or []
    depth = depths(parents)
    p: list[float] = []
    for i, (rank, parent) in enumerate(zip(draft.tokens, parents)):
        j = depth[i] - 1
        step = rank_chance(AcceptanceModel.at(accept_p, j), rank, runner_up)
        step *= AcceptanceModel.at(draft_p, j)
        p.append(step * (1.0 if parent < 0 else p[parent]))
    mean = sum(p)
    square = sum(q * (2 * d - 1) for q, d in zip(p, depth))
    return mean, max(0.0, square - mean * mean)


def chain_expected(accept_p: list[float], draft_p: list[float], depth: int) -> float:
    """The tokens a chain of ``depth`` first choices accepts on average under the model."""
    reach, total = 1.0, 0.0
    for j in range(depth):
        reach *= AcceptanceModel.at(accept_p, j) * AcceptanceModel.at(draft_p, j)
        total += reach
    return total


@dataclass
class TreeTally:
    """What the tree rounds of a simulation accepted, beside what the acceptance model expects of
    the trees verified and of a chain as deep as each: what a planner reads trees' worth from."""

    rounds: int = 0
    nodes: int = 0
    accepted: int = 0
    expected: float = 0.0
    variance: float = 0.0
    chain_expected: float = 0.0

    def add(self, nodes: int, accepted: int, expected: tuple[float, float], chain_expected: float) -> None:
        self.rounds += 1
        self.nodes += nodes
        self.accepted += accepted
        self.expected += expected[0]
        self.variance += expected[1]
        self.chain_expected += chain_expected

    def summary(self) -> dict[str, float] | None:
        if not self.rounds:
            return None
        n = self.rounds
        return {
            "rounds": n,
            "nodes_mean": round(self.nodes / n, 3),
            "accepted_mean": self.accepted / n,
            "expected_mean": self.expected / n,
            "expected_sd_of_mean": math.sqrt(self.variance) / n,  # the sampled mean's spread
            "chain_expected_mean": self.chain_expected / n,
        }
