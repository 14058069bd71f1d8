"""A token tree: several guesses at the next tokens, verified by the target in one forward.

A tree is a list of tokens in topological order with, for each, the index of its parent in that
list, or -1 for a child of the last committed token (the root). A chain of k tokens is the tree
with parents [-1, 0, 1, ..., k - 2]. Torch-free: drafts, the verifier and the gRPC layer share it
(docs/design.md, "Token trees").
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "chain_parents",
    "check_parents",
    "depths",
    "within_depth",
    "merge_branches",
    "leaf_paths",
    "walk",
    "draft_order",
]


def chain_parents(k: int) -> list[int]:
    return list(range(-1, k - 1))


def check_parents(parents: Sequence[int], size: int) -> None:
    """Refuse what is not a tree in topological order: a parent is -1 or an earlier node."""
    if len(parents) != size:
        raise ValueError(f"a tree of {size} tokens needs {size} parents, got {len(parents)}")
    for i, p in enumerate(parents):
        if not -1 <= p < i:
            raise ValueError(f"node {i}: parent {p} is neither -1 nor an earlier node")


def depths(parents: Sequence[int]) -> list[int]:
    """Depth of each node: 1 for a child of the root (the token right after the committed ones)."""
    out: list[int] = []
    for p in parents:
        out.append(1 if p < 0 else out[p] + 1)
    return out


def within_depth(parents: Sequence[int], k: int) -> list[int]:
    """The nodes at depth <= k (a drafter may propose deeper than the round's k)."""
    return [i for i, d in enumerate(depths(parents)) if d <= k]


def merge_branches(
    tokens: list[int], parents: list[int], branches: Sequence[tuple[int, Sequence[int]]]
) -> tuple[list[int], list[int]]:
    """Add each branch (an attach point: a node index or -1, and the tokens that follow it) to the
    tree, sharing the nodes it already has (a trie): a guess the tree holds costs nothing."""
    tokens, parents = list(tokens), list(parents)
    children: dict[int, dict[int, int]] = {}
    for i, (t, p) in enumerate(zip(tokens, parents)):
        children.setdefault(p, {}).setdefault(t, i)
    for at, branch in branches:
        node = at
        for t in branch:
            nxt = children.setdefault(node, {}).get(t)
            if nxt is None:
                nxt = len(tokens)
                tokens.append(t)
                parents.append(node)
                children[node][t] = nxt
            node = nxt
    return tokens, parents


def leaf_paths(parents: Sequence[int]) -> list[list[int]]:
    """Every root-to-leaf path (node indices, shallowest first), leaves in index order."""
    has_child = {p for p in parents if p >= 0}
    paths = []
    for leaf in range(len(parents)):
        if leaf in has_child:
            continue
        path, node = [], leaf
        while node >= 0:
            path.append(node)
            node = parents[node]
        paths.append(path[::-1])
    return paths


def walk(tokens: Sequence[int], parents: Sequence[int], target_token) -> tuple[list[int], int]:
    """The longest path whose every token is the target's own next token.

    `target_token(node)` is the target's token after the committed tokens and the path to `node`
    (node -1: right after the committed tokens). Returns the accepted nodes, root first, and the
    target's token after them (the correction or the bonus)."""
    children: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        children.setdefault(p, []).append(i)
    path: list[int] = []
    node = -1
    while True:
        want = target_token(node)
        nxt = next((c for c in children.get(node, ()) if tokens[c] == want), None)
        if nxt is None:
            return path, want
        path.append(nxt)
        node = nxt


def draft_order(own: bool, logp: float, depth: int) -> tuple:
    """The order a drafter keeps and grows a tree's nodes in: its own chain first (a tree then never
    accepts less than the chain would), then the likeliest (a node's parent is at least as likely:
    what is kept is a tree), then the shallowest (specdec/core/tree_drafting.py; the simulator's
    draft worker grows its trees by it too)."""
    return (not own, -logp, depth)
