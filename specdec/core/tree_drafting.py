"""Draft a token tree with the draft model: a level per forward, the likeliest nodes grown.

A chain stops paying where the draft's next guess is unsure: a round ends at its first miss. A tree
holds the draft's runners-up too, and grows them, so a miss of the first choice can still be a hit
(docs/design.md, "Token trees"). Each level is one forward of the draft model over the `expand`
likeliest nodes of the level before, the chain's own among them (likeliest by the product of the
draft's probabilities along the path, as EAGLE-2 ranks them): a small draft model's forward of a
few rows costs about what one row costs. Every grown node adds its `width` best children. After
`depth` levels the tree is cut to `nodes`: the draft's own chain, then the likeliest (a node is
never likelier than its parent, so what is kept is a tree).

Greedy and seeded requests: their tokens are a function of the logits and the position's noise,
so the target accepts exactly the path that matches its own tokens (specdec/core/verify.py,
`verify_tree`). Sampling requests: a node's children are drawn without replacement from the
draft's sparse q, each carrying it, and verified by recursive rejection
(specdec/core/tree_sampling.py); the first one drawn is the draft's own chain. The draft model's
cache keeps its own chain afterwards: the next round reuses it as far as the target accepted it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdec.core.params import SamplingParams, VerifyMode
from specdec.core.round_types import Draft, SparseDist
from specdec.core.runner import ModelRunner
from specdec.core.sampling import gumbel_noise, process_logits, sparse_topk
from specdec.core.token_tree import draft_order
from specdec.core.tree_forward import keep_path, tree_forward
from specdec.core.tree_sampling import draw_children

__all__ = ["TreeShape", "TreeRow", "grow_trees", "branch_chain", "pick_scores", "ranked"]


@dataclass(frozen=True)
class TreeShape:
    width: int = 3  # children a grown node adds: the draft's best
    expand: int = 4  # nodes grown per level: rows of one draft forward; 0: only the chain's
    #                  forwards, its runners-up as leaves (`branch_chain`)
    nodes: int = 16  # nodes sent to the target at most

    def __post_init__(self):
        if min(self.width, self.nodes) < 1 or self.expand < 0:
            raise ValueError(f"a tree shape needs width and nodes >= 1 and expand >= 0, got {self}")


@dataclass
class TreeRow:
    slot: int
    tokens: list[int]  # committed tokens, all in the slot's cache
    params: SamplingParams
    mode: VerifyMode
    depth: int  # levels to draft: the round's k
    generator: torch.Generator | None = None  # a sampling request's draws
    top_k: int = 16  # a sampling request's q: the draft's top-K, renormalised


@dataclass
class _Node:
    token: int
    parent: int  # index among the row's nodes, -1 for a child of the committed tokens
    depth: int  # 1 for a child of the committed tokens
    logp: float  # log of the draft's probability of the path to it
    own: bool = False  # on the draft's own chain (its first choice at every level)
    cached: int = -1  # its index in the draft runner's tree once forwarded
    q: SparseDist | None = None  # of a sampled tree: the q it was drawn from (its parent's)


def pick_scores(logits: torch.Tensor, params: SamplingParams, mode: VerifyMode, position: int) -> torch.Tensor:
    """What a greedy or seeded draft takes the argmax of: the logits, or the log-probabilities plus
    the position's noise (the target's own rule, specdec/core/verify.py)."""
    if mode is VerifyMode.GREEDY:
        return logits
    logq = process_logits(logits, params)
    return logq + gumbel_noise(params.seed, position, logq.shape[-1], device=logq.device)


def ranked(scores: torch.Tensor, best: int, width: int) -> list[tuple[int, float]]:
    """The `width` best tokens by `scores`, `best` (the argmax, ties as the chain breaks them) first,
    each with the log-probability the softmax of the scores gives it."""
    logp = torch.log_softmax(scores.float(), dim=-1)
    top = torch.topk(scores, min(width, scores.shape[-1])).indices.tolist()
    return [(t, float(logp[t])) for t in [best] + [t for t in top if t != best][: width - 1]]


def _children(
    logits: torch.Tensor, row: TreeRow, position: int, width: int
) -> tuple[list[tuple[int, float]], SparseDist | None]:
    """A node's children, first choice first, each with the log-probability it is ranked by; and
    the q they were drawn from for a sampling request."""
    if row.mode is VerifyMode.REJECTION:
        return sampled_children(logits, row, width)
    scores = pick_scores(logits, row.params, row.mode, position)
    return ranked(scores, int(torch.argmax(scores)), width), None


def sampled_children(logits: torch.Tensor, row: TreeRow, width: int) -> tuple[list[tuple[int, float]], SparseDist]:
    """`width` tokens drawn without replacement from the draft's sparse q, in the order drawn. Each
    is ranked by q's probability of it, made non-increasing along the draws (the running minimum):
    the tree is cut by rank, and a sampled tree may only lose a child's later siblings with it."""
    ids, probs = sparse_topk(process_logits(logits, row.params), row.top_k)
    p_of = dict(zip(ids, probs))
    out, lp = [], 0.0
    for t in draw_children(ids, probs, width, row.generator):
        lp = min(lp, math.log(p_of[t]))
        out.append((t, lp))
    return out, (ids, probs)


def branch_chain(chain: list[int], ranks: list[list[tuple[int, float]]], size: int) -> Draft:
    """A chain with each position's runners-up as leaves beside it, cut to the `size` likeliest
    nodes. No draft forward more than the chain's: the runners-up come from its own logits, each
    position's ranking led by the chain's token (`ranked`)."""
    nodes: list[_Node] = []
    parent, logp = -1, 0.0
    for depth, (token, ranking) in enumerate(zip(chain, ranks), start=1):
        if ranking[0][0] != token:  # not the ranking it was drafted by: keep the chain
            return Draft(tokens=list(chain))
        level = len(nodes)
        nodes.extend(_Node(t, parent, depth, logp + lp, own=j == 0) for j, (t, lp) in enumerate(ranking))
        parent, logp = level, nodes[level].logp
    return _cut(nodes, size)


def grow_trees(runner: ModelRunner, rows: Sequence[TreeRow], root_logits: Sequence[torch.Tensor], shape: TreeShape):
    """Draft a tree per row from the logits after its committed tokens; returns the drafts."""
    nodes: list[list[_Node]] = []
    for row, logits in zip(rows, root_logits):
        first, q = _children(logits, row, len(row.tokens), shape.width) if row.depth > 0 else ([], None)
        nodes.append([_Node(t, -1, 1, lp, own=j == 0, q=q) for j, (t, lp) in enumerate(first)])
    runner_tree: list[list[int]] = [[] for _ in rows]  # parents of the nodes forwarded, per row
    for level in range(1, max((r.depth for r in rows), default=0)):
        grow = []
        for b, row in enumerate(rows):
            if level < row.depth:
                frontier = [i for i, n in enumerate(nodes[b]) if n.depth == level]
                grow.append(sorted(frontier, key=lambda i: _rank(nodes[b][i]))[: shape.expand])
            else:
                grow.append([])
        active = [b for b in range(len(rows)) if grow[b]]
        if not active:
            break
        feeds, parents = [], []
        for b in active:
            feeds.append([nodes[b][i].token for i in grow[b]])
            parents.append([])
            for i in grow[b]:
                parent = nodes[b][i].parent
                parents[-1].append(-1 if parent < 0 else nodes[b][parent].cached)
                nodes[b][i].cached = len(runner_tree[b])
                runner_tree[b].append(parents[-1][-1])
        logits = tree_forward(runner, [rows[b].slot for b in active], feeds, parents)
        for b, row_logits in zip(active, logits):
            row = rows[b]
            for i, node_logits in zip(grow[b], row_logits):
                parent = nodes[b][i]
                ranking, q = _children(node_logits, row, len(row.tokens) + parent.depth, shape.width)
                for j, (t, lp) in enumerate(ranking):
                    nodes[b].append(_Node(t, i, parent.depth + 1, parent.logp + lp, own=parent.own and j == 0, q=q))
    drafts = []
    for row, row_nodes, tree in zip(rows, nodes, runner_tree):
        drafts.append(_cut(row_nodes, shape.nodes))
        if tree:  # the draft model's cache keeps its own chain, as far as it was forwarded
            keep_path(runner, row.slot, [n.cached for n in row_nodes if n.own and n.cached >= 0])
    return drafts


def _rank(node: _Node) -> tuple:
    return draft_order(node.own, node.logp, node.depth)


def _cut(nodes: list[_Node], size: int) -> Draft:
    """The `size` first nodes by `_rank`, as a draft."""
    probs = [n.q for n in nodes] if nodes and nodes[0].q is not None else None
    whole = Draft(
        tokens=[n.token for n in nodes], probs=probs, parents=[n.parent for n in nodes], scores=[n.logp for n in nodes]
    )
    return whole.keep(sorted(range(len(nodes)), key=lambda i: _rank(nodes[i]))[:size])
