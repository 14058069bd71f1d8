"""The runner's forward over token trees: every node of every row in one forward, each node's
logits bitwise those of the same tokens decoded one after another.

A slot's tree grows past its chain (the cached tokens): node i sits at position ``base + depth(i) -
1`` (its parent's position plus one; a root node's parent is the chain's last token) and sees the
chain and its own ancestors only. A forward adds nodes whose parents are earlier nodes, of this
call or of an earlier one (a drafter grows its tree a level per forward). The weight GEMMs run over
the new nodes packed, as a ragged forward runs over tokens, and round each node as any other row
count does (attention.py's padding rule).

The attention is where a tree could change the numbers. On a CPU the compiled loop
(cpu_attention.c) folds over a query's visible keys in the order of their places and skips hidden
ones, and a node's ancestors come before it in tree order: so each slot is one attention row read in
place, each node seeing the chain and the places of its ancestors and itself, and a node meets the
keys a chain would give it in the same order. torch's invariant attention (a GPU's) sums over the
places of a key span, hidden keys as exact zeros, so there a node must find its ancestors at the
places a chain would hold them, ``base + depth``: each root-to-leaf path is attended as a row of
its own, its keys gathered into a chain (the slot's chain, then the path's nodes), each node in
the first path that holds it (docs/design.md, "Token trees").

The nodes' keys and values are stored in the slot at ``base + i`` (tree order), and the runner
remembers the tree (``runner.trees``) until `keep_path` moves one path into chain order, in place,
and forgets the rest, or a rollback to the chain drops it. No other forward of the slot runs before.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from specdec.core import cpu_attention
from specdec.core.attention import attention_width, gemm_rows, hidden_keys_bias, invariant_attention, padded_span
from specdec.core.token_tree import check_parents, depths, leaf_paths

if TYPE_CHECKING:
    from specdec.core.runner import ModelRunner

__all__ = ["tree_forward", "keep_path"]


def tree_forward(
    runner: ModelRunner,
    slots: Sequence[int],
    tokens: Sequence[Sequence[int]],
    parents: Sequence[Sequence[int]],
    invariant: bool | None = None,
) -> list[torch.Tensor]:
    """Add each row's nodes to its slot's tree and return their logits [nodes, vocab] (float32).

    ``parents[b][i]``: -1, or the index of node i's parent in the slot's whole tree (the nodes of
    earlier calls first, then this call's)."""
    from specdec.core.runner import ContextFull, RunnerError

    invariant = runner.invariant_numerics if invariant is None else invariant
    if not slots or len(slots) != len(tokens) or len(tokens) != len(parents) or len(set(slots)) != len(slots):
        raise RunnerError("tree_forward needs one tree per distinct slot")
    bases, trees = [], []
    for slot, row, par in zip(slots, tokens, parents):
        base, old = runner.trees.get(slot, (runner.lengths[slot], []))
        whole = list(old) + list(par)
        if not row:
            raise RunnerError(f"slot {slot}: no tree nodes")
        try:
            check_parents(whole, len(whole))
        except ValueError as exc:
            raise RunnerError(f"slot {slot}: {exc}") from None
        if base + len(whole) > runner.max_len:
            raise ContextFull(f"slot {slot}: {base} + {len(whole)} tree nodes exceed the context of {runner.max_len}")
        if min(row) < 0 or max(row) >= runner.vocab_size:
            raise RunnerError(f"token ids must be in [0, {runner.vocab_size})")
        bases.append(base)
        trees.append(whole)

    dev = runner.device
    n = sum(len(r) for r in tokens)
    rows = gemm_rows(n, runner.dtype) if invariant else n
    firsts = [len(whole) - len(row) for whole, row in zip(trees, tokens)]  # this call's first node
    offsets = [sum(len(r) for r in tokens[:b]) for b in range(len(tokens))]
    node_pos = [base + d - 1 for base, whole, first in zip(bases, trees, firsts) for d in depths(whole)[first:]]
    ids = torch.zeros(rows, dtype=torch.long)
    ids[:n] = torch.as_tensor([t for row in tokens for t in row], dtype=torch.long)
    positions = torch.zeros(rows, dtype=torch.long)
    positions[:n] = torch.as_tensor(node_pos, dtype=torch.long)
    ids, positions = ids.to(dev), positions.to(dev)
    store_slot = torch.as_tensor([s for s, row in zip(slots, tokens) for _ in row], dtype=torch.long, device=dev)
    store_at = torch.as_tensor(
        [base + first + i for base, first, row in zip(bases, firsts, tokens) for i in range(len(row))], device=dev
    )

    nodes = _Nodes(list(slots), bases, trees, firsts, offsets, n)
    if cpu_attention.runs_on(dev):
        attention = _slot_order_attention(runner, nodes)
    else:
        attention = _path_attention(runner, nodes, invariant)

    def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # The new nodes' keys and values go to their places in the slots, then the attention.
        runner.k_cache[layer][store_slot, :, store_at] = k[:n]
        runner.v_cache[layer][store_slot, :, store_at] = v[:n]
        out = attention(layer, q[:n])
        return F.pad(out, (0, 0, 0, rows - n)) if rows > n else out

    x = runner._layers(runner.embedding(ids), positions, invariant, attend)
    logits = runner._logits(x, list(range(n)), [len(r) for r in tokens], invariant)
    for slot, base, whole, row in zip(slots, bases, trees, tokens):
        runner.lengths[slot] = base + len(whole)
        runner.slot_tokens[slot].extend(int(t) for t in row)
        runner.trees[slot] = (base, whole)
    return logits


@dataclass
class _Nodes:
    """A tree forward's rows: per slot, its chain's length (base), its whole tree's parents, this
    call's first node and where its nodes start among the n packed ones."""

    slots: list[int]
    bases: list[int]
    trees: list[list[int]]
    firsts: list[int]
    offsets: list[int]
    n: int


Attention = Callable[[int, torch.Tensor], torch.Tensor]  # (layer, q [n, H, D]) -> [n, H * D]


def _slot_order_attention(runner: ModelRunner, nodes: _Nodes) -> Attention:
    """The compiled loop's attention (a CPU's), the cache read in place: one attention row per slot,
    each node's query seeing the slot's chain and the places of its ancestors and itself. The loop
    folds over a query's visible keys in the order of their places and skips the hidden ones, and
    an ancestor's index is below its child's, so a node meets the keys of the chain and of its path
    in the order and with the values a chain decoded one token at a time gives it: the same bits
    (tests/unit/test_tree_forward.py), in either numerics (the loop has one)."""
    dev, n = runner.device, nodes.n
    width = max(len(whole) - first for whole, first in zip(nodes.trees, nodes.firsts))
    span = padded_span(max(base + len(whole) for base, whole in zip(nodes.bases, nodes.trees)))
    bias = torch.full((len(nodes.slots), width, span), float("-inf"))
    q_index = torch.full((len(nodes.slots), width), n, dtype=torch.long)  # n: a zero row (padding)
    out_index = torch.empty(n, dtype=torch.long)
    seen: list[tuple[int, int, int]] = []  # (row, query, key place) of each node's own path
    for b, (base, whole, first, off) in enumerate(zip(nodes.bases, nodes.trees, nodes.firsts, nodes.offsets)):
        bias[b, :, :base] = 0.0  # every node sees the chain
        for col, i in enumerate(range(first, len(whole))):
            node = i
            while node >= 0:  # itself and its ancestors
                seen.append((b, col, base + node))
                node = whole[node]
        cols = len(whole) - first
        q_index[b, :cols] = torch.arange(off, off + cols)
        out_index[off : off + cols] = torch.arange(b * width, b * width + cols)
    bias[tuple(torch.tensor(seen).T)] = 0.0
    bias, q_index, out_index = bias[:, None, None].to(dev), q_index.to(dev), out_index.to(dev)
    slot_t = torch.as_tensor(nodes.slots, dtype=torch.long, device=dev)
    scale = runner.head_dim**-0.5

    def attention(layer: int, q: torch.Tensor) -> torch.Tensor:
        queries = F.pad(q, (0, 0, 0, 0, 0, 1))[q_index].transpose(1, 2)  # [slots, H, width, D]
        out = invariant_attention(queries, runner.k_cache[layer], runner.v_cache[layer], bias, scale, slots=slot_t)
        return out.transpose(1, 2).reshape(len(nodes.slots) * width, -1)[out_index]

    return attention


def _path_attention(runner: ModelRunner, nodes: _Nodes, invariant: bool) -> Attention:
    """The attention of a forward's tree nodes as torch computes it (a GPU's, a CPU's without the
    compiled loop): each root-to-leaf path among the new nodes a row of its own, its keys gathered
    into chain order."""
    dev, n = runner.device, nodes.n
    # One attention row per path to a leaf among the new nodes: its keys the slot's chain and the
    # path's nodes in chain order, its queries the new nodes it is the first path to hold.
    path_slot, path_base, path_nodes, path_queries = [], [], [], []
    for slot, base, whole, first, off in zip(nodes.slots, nodes.bases, nodes.trees, nodes.firsts, nodes.offsets):
        done: set[int] = set()
        for path in leaf_paths(whole):
            if path[-1] < first:
                continue
            path_slot.append(slot)
            path_base.append(base)
            path_nodes.append(path)
            path_queries.append([(j, off + i - first) for j, i in enumerate(path) if i >= first and i not in done])
            done.update(path)
    width = max(len(q) for q in path_queries)
    if invariant:
        width = attention_width(width, runner.num_heads, runner.num_kv_heads, dev)
    span = padded_span(max(base + len(path) for base, path in zip(path_base, path_nodes)))
    # Where each path's key j is in its slot's cache: the chain, then the path's nodes; the places
    # past the path read the chain's first key, hidden from every query (an exact zero weight).
    key_at = torch.zeros(len(path_slot), span, dtype=torch.long)
    for p, (base, path) in enumerate(zip(path_base, path_nodes)):
        key_at[p, : base + len(path)] = torch.as_tensor(list(range(base)) + [base + i for i in path])
    key_slot, key_at = torch.as_tensor(path_slot, device=dev)[:, None], key_at.to(dev)
    q_index = torch.full((len(path_slot), width), n, dtype=torch.long)  # n: a zero row (padding)
    q_pos = torch.zeros(len(path_slot), width, dtype=torch.long)
    out_index = torch.empty(n, dtype=torch.long)
    for p, (base, queries) in enumerate(zip(path_base, path_queries)):
        for col, (depth0, node) in enumerate(queries):
            q_index[p, col] = node
            q_pos[p, col] = base + depth0
            out_index[node] = p * width + col
        q_pos[p, len(queries) :] = base  # padding queries: see the chain and the path's first node
    q_index, q_pos, out_index = q_index.to(dev), q_pos.to(dev), out_index.to(dev)
    bias = hidden_keys_bias(q_pos, span) if invariant else None
    visible = None if invariant else (torch.arange(span, device=dev) <= q_pos[:, :, None])[:, None]

    def attention(layer: int, q: torch.Tensor) -> torch.Tensor:
        kc, vc = runner.k_cache[layer], runner.v_cache[layer]
        keys = kc[key_slot, :, key_at].transpose(1, 2)  # [paths, Hkv, span, D], one gather per layer
        vals = vc[key_slot, :, key_at].transpose(1, 2)
        queries = F.pad(q, (0, 0, 0, 0, 0, 1))[q_index].transpose(1, 2)  # [paths, H, width, D]
        if invariant:
            out = invariant_attention(queries, keys, vals, bias, runner.head_dim**-0.5)
        else:
            out = F.scaled_dot_product_attention(
                queries, keys, vals, attn_mask=visible, enable_gqa=queries.shape[1] != keys.shape[1]
            )
        return out.transpose(1, 2).reshape(len(path_slot) * width, -1)[out_index]

    return attention


def keep_path(runner: ModelRunner, slot: int, path: Sequence[int]) -> None:
    """Keep the tree nodes `path` (each the parent of the next, the first a root node) as the
    chain's next tokens and forget the rest of the slot's tree. The moves go from higher to lower
    places in path order (a node's index is at least its depth), so none overwrites one still to
    move."""
    from specdec.core.runner import RunnerError

    base, whole = runner.trees.get(slot, (runner.lengths[slot], []))
    if any(whole[i] != (path[j - 1] if j else -1) for j, i in enumerate(path) if 0 <= i < len(whole)) or any(
        not 0 <= i < len(whole) for i in path
    ):
        raise RunnerError(f"slot {slot}: {list(path)} is not a path of its token tree")
    cached = runner.slot_tokens[slot]
    kept = [cached[base + i] for i in path]
    for depth0, i in enumerate(path):
        if i != depth0:
            runner.k_cache[:, slot, :, base + depth0] = runner.k_cache[:, slot, :, base + i]
            runner.v_cache[:, slot, :, base + depth0] = runner.v_cache[:, slot, :, base + i]
    runner.trees.pop(slot, None)
    runner.lengths[slot] = base + len(path)
    del cached[base:]
    cached.extend(kept)
