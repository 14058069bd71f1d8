"""Sampled token trees: children drawn without replacement, verified by recursive rejection.

A sampling request's tree holds, at each grown node, several tokens drawn one after another
*without replacement* from the draft's sparse q there (Gumbel top-k: the order of the keys
log q + Gumbel is the order of the draws). Every child carries that q in ``Draft.probs``, and
children are stored in the order they were drawn.

The verifier walks down from the root (Sequoia, Algorithm 2; SpecInfer's multi-step sampling with
the draws' own distributions): at a node with the target's distribution p it starts from r = p and
tries the children in their order. The i-th child x was drawn from q_i, q with the earlier
children removed and renormalised; it is accepted with probability min(1, r(x) / q_i(x)), and the
walk goes on from it. Otherwise r becomes norm(max(0, r - q_i)) and the next child is tried. When
every child is rejected, the token is drawn from r and the round ends; after an accepted leaf, the
bonus token is drawn from the target's p after it.

Why the output is the target's: at each stage, a token drawn from q_i, accepted with probability
min(1, r / q_i), is y with probability min(q_i(y), r(y)); a rejection has probability
1 - sum min(q_i, r) and continues with norm(max(0, r - q_i)); the two add to r(y) whatever q_i is,
as long as the child really was drawn from q_i. So the stage's output is r, by induction from the
last stage (a draw from r), and the first stage's r is p (docs/design.md, "Token trees";
`tests/unit/test_tree_sampling.py` checks it by chi-square, and that dropping the "without
replacement" from q_i is caught). A child that is not in its q_i (a drafter that does not follow
the scheme, or a tree sent without distributions) is verified as a point mass on it, which is exact
for a token chosen by any rule that does not look at the target.

Which children are kept (the tree's size) may depend on anything the drafter knows, but a kept
child's earlier siblings must be kept too: a child is only drawn from q_i given the draws before it
(`Draft.keep` keeps that closure).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from specdec.core.round_types import Draft, SparseDist, VerifyResult
from specdec.core.sampling import draw_from_probs, draw_uniforms

if TYPE_CHECKING:
    import torch

__all__ = ["draw_children", "sibling_q", "verify_sampled_tree"]


def draw_children(ids: Sequence[int], probs: Sequence[float], n: int, generator) -> list[int]:
    """Up to `n` distinct ids drawn one after another without replacement from the sparse
    distribution (normalised by its sum), in the order drawn: the `n` largest log p + Gumbel keys."""
    us = draw_uniforms(len(ids), generator)
    keys = []
    for t, p, u in zip(ids, probs, us):
        if p > 0:
            g = -math.log(-math.log(max(u, 1e-300)))
            keys.append((math.log(p) + g, t))
    keys.sort(reverse=True)
    return [t for _, t in keys[:n]]


def sibling_q(q: SparseDist, drawn: Sequence[int]) -> SparseDist:
    """q_i: the distribution the next child was drawn from, q without the children drawn before it,
    renormalised (empty when they took all of q's mass)."""
    ids, probs = q
    taken = set(drawn)
    rest = [(t, p) for t, p in zip(ids, probs) if t not in taken and p > 0]
    total = math.fsum(p for _, p in rest)
    if not total > 0:
        return [], []
    return [t for t, _ in rest], [p / total for _, p in rest]


def _dense(q: SparseDist, like: torch.Tensor) -> torch.Tensor:
    import torch

    out = torch.zeros_like(like)
    if q[0]:
        out[torch.tensor(q[0], dtype=torch.long)] = torch.tensor(q[1], dtype=like.dtype)
    return out


def _stage_q(q: SparseDist, drawn: Sequence[int], x: int, like: torch.Tensor) -> torch.Tensor:
    """The dense q_i of a child with token x: its sibling q, or a point mass on x where x is not in it."""
    qi = sibling_q(q, drawn)
    if x in qi[0] and qi[1][qi[0].index(x)] > 0:
        return _dense(qi, like)
    return _dense(([x], [1.0]), like)


def verify_sampled_tree(
    logp: torch.Tensor, draft: Draft, generator: torch.Generator | None
) -> tuple[VerifyResult, list[int]]:
    """Verify a sampled tree: `logp` [1 + nodes, V], the target's processed log-probabilities,
    row 0 after the committed tokens and row 1 + i after node i. Returns the verdict and the
    accepted nodes, root first."""
    if draft.probs is not None and len(draft.probs) != len(draft.tokens):
        raise ValueError("verify_sampled_tree: a sampled tree needs one distribution per node, or none")
    no_q: SparseDist = ([], [])  # a tree sent without distributions: every node a point mass
    children: dict[int, list[int]] = {}
    for i, parent in enumerate(draft.parents or ()):
        children.setdefault(parent, []).append(i)
    path: list[int] = []
    node = -1
    while True:
        r = logp[node + 1].double().exp()
        r = r / r.sum()
        drawn: list[int] = []
        for child in children.get(node, ()):
            x = draft.tokens[child]
            qi = _stage_q(no_q if draft.probs is None else draft.probs[child], drawn, x, r)
            (u,) = draw_uniforms(1, generator)
            if u * float(qi[x]) < float(r[x]):  # accept with probability min(1, r(x) / q_i(x))
                path.append(child)
                node = child
                break
            residual = (r - qi).clamp_(min=0)
            if float(residual.sum()) > 1e-12:  # else r == q_i up to rounding: r stands
                r = residual / residual.sum()
            drawn.append(x)
        else:
            (u,) = draw_uniforms(1, generator)
            last = draw_from_probs(r, u)
            accepted = [draft.tokens[i] for i in path]
            return VerifyResult(tokens=accepted + [last], num_accepted=len(accepted)), path
