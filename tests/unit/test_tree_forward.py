"""A token tree's forward gives every node bitwise the logits of its path decoded as a chain, and
keeps only the accepted path in the cache (specdec/core/tree_forward.py; docs/design.md, "Token
trees")."""

from __future__ import annotations

import pytest
import torch

from specdec.core import cpu_attention
from specdec.core.runner import ContextFull, ModelRunner, RunnerError
from specdec.core.token_tree import chain_parents, depths, leaf_paths, merge_branches, walk, within_depth
from specdec.core.tree_forward import keep_path, tree_forward
from tests.conftest import load_hf

# A root (the last committed token) with three branches of different depths, one sharing a node.
TREE_PARENTS = [-1, 0, 1, 2, 0, 4, 0, 1, 7]


@pytest.fixture(
    scope="module",
    params=[(arch, dtype) for arch in ("llama", "qwen2", "smollm2") for dtype in (torch.bfloat16, torch.float32)],
    ids=lambda p: f"{p[0]}-{str(p[1]).split('.')[-1]}",
)
def model(request, tiny_paths):
    arch, dtype = request.param
    path = request.getfixturevalue("smollm_path") if arch == "smollm2" else tiny_paths[arch]
    return load_hf(path, dtype=dtype)


@pytest.fixture(params=["compiled", "torch"])
def loop(request, monkeypatch):
    """Which attention the process runs: the compiled loop over each slot in place, or torch's over
    each path gathered (a GPU's); the chain's logits come from the same one."""
    if request.param == "compiled" and cpu_attention.kernel() is None:
        pytest.skip("no C compiler: the compiled attention loop is not built")
    if request.param == "torch":
        monkeypatch.setattr(cpu_attention, "kernel", lambda: None)
    return request.param


def _tokens(vocab: int, n: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _chain_logits(model, prompt: list[int], path_tokens: list[int], invariant: bool = True) -> torch.Tensor:
    """The logits of `path_tokens` appended one forward per token (a decode loop)."""
    runner = ModelRunner(model, num_slots=1, max_len=128, invariant_numerics=invariant)
    slot = runner.alloc_slot()
    runner.forward([slot], [prompt], num_logits=0)
    return torch.cat([runner.forward([slot], [[t]])[0] for t in path_tokens])


def _tree_in_cache(model):
    """A runner whose slot holds a 30-token prompt and TREE_PARENTS' tree after it."""
    vocab = model.config.vocab_size
    prompt, tree = _tokens(vocab, 30, 5), _tokens(vocab, len(TREE_PARENTS), 6)
    runner = ModelRunner(model, num_slots=1, max_len=128)
    slot = runner.alloc_slot()
    runner.forward([slot], [prompt], num_logits=0)
    tree_forward(runner, [slot], [tree], [TREE_PARENTS])
    return runner, slot, prompt, tree


def test_every_node_has_its_chain_logits(model, loop):
    vocab = model.config.vocab_size
    prompts = [_tokens(vocab, 21, 1), _tokens(vocab, 70, 2)]  # the second crosses a key block
    trees = [_tokens(vocab, len(TREE_PARENTS), 3), _tokens(vocab, 4, 4)]
    parents = [TREE_PARENTS, chain_parents(4)]
    runner = ModelRunner(model, num_slots=2, max_len=128)
    slots = [runner.alloc_slot() for _ in prompts]
    runner.forward(slots, prompts, num_logits=0)
    logits = tree_forward(runner, slots, trees, parents)
    for prompt, tree, par, got in zip(prompts, trees, parents, logits):
        assert got.shape == (len(tree), vocab)
        for path in leaf_paths(par):
            want = _chain_logits(model, prompt, [tree[i] for i in path])
            assert torch.equal(got[path], want), f"path {path}"


def test_keep_path_leaves_the_chain_in_the_cache(model):
    vocab = model.config.vocab_size
    runner, slot, prompt, tree = _tree_in_cache(model)
    path = [0, 1, 7, 8]  # root, then a branch whose nodes sit apart from their depths
    keep_path(runner, slot, path)
    assert runner.lengths[slot] == len(prompt) + len(path)
    assert runner.slot_tokens[slot] == prompt + [tree[i] for i in path]
    nxt = _tokens(vocab, 1, 7)
    got = runner.forward([slot], [nxt])[0]
    assert torch.equal(got, _chain_logits(model, prompt, [tree[i] for i in path] + nxt)[-1:])


def test_a_wrong_place_in_the_cache_is_caught(tiny_paths):
    """The check above can fail: keys kept at tree places instead of chain places give other logits."""
    model = load_hf(tiny_paths["llama"])
    runner, slot, prompt, tree = _tree_in_cache(model)
    path = [0, 1, 7, 8]
    runner.trees.pop(slot)  # the lengths of the path, without moving its keys
    runner.lengths[slot] = len(prompt) + len(path)
    got = runner.forward([slot], [[1]])[0]
    assert not torch.equal(got, _chain_logits(model, prompt, [tree[i] for i in path] + [1])[-1:])


def test_a_drafters_tree_has_its_chain_logits_where_the_loop_runs(model):
    """A drafter's fast forward: on a CPU the compiled loop is its attention too, which has one
    order of arithmetic, so its tree's nodes get the fast chain's bits as well (torch's fast
    attention, SDPA, promises nothing of the kind; a drafter's numbers need not hold)."""
    if cpu_attention.kernel() is None:
        pytest.skip("no C compiler: the compiled attention loop is not built")
    vocab = model.config.vocab_size
    prompt, tree = _tokens(vocab, 50, 10), _tokens(vocab, len(TREE_PARENTS), 11)
    runner = ModelRunner(model, num_slots=1, max_len=128, invariant_numerics=False)
    slot = runner.alloc_slot()
    runner.forward([slot], [prompt], num_logits=0)
    got = tree_forward(runner, [slot], [tree], [TREE_PARENTS])[0]
    for path in leaf_paths(TREE_PARENTS):
        assert torch.equal(got[path], _chain_logits(model, prompt, [tree[i] for i in path], invariant=False))


def test_a_tree_grown_level_by_level_has_the_same_logits(model, loop):
    """A drafter adds a level per forward, its nodes' parents in earlier calls."""
    vocab = model.config.vocab_size
    prompt, tree = _tokens(vocab, 40, 8), _tokens(vocab, len(TREE_PARENTS), 9)
    runner = ModelRunner(model, num_slots=2, max_len=128)
    whole, grown = runner.alloc_slot(), runner.alloc_slot()
    runner.forward([whole, grown], [prompt, prompt], num_logits=0)
    want = tree_forward(runner, [whole], [tree], [TREE_PARENTS])[0]
    got = [tree_forward(runner, [grown], [tree[a:b]], [TREE_PARENTS[a:b]])[0] for a, b in ((0, 1), (1, 5), (5, 9))]
    assert torch.equal(torch.cat(got), want)
    with pytest.raises(RunnerError, match="token tree"):
        runner.forward([grown], [[1]])
    with pytest.raises(RunnerError, match="roll"):
        runner.rollback(grown, len(prompt) + 2)
    with pytest.raises(RunnerError, match="not a path"):
        keep_path(runner, grown, [0, 2])
    assert runner.common_prefix(grown, prompt + tree) == len(prompt)
    runner.rollback(grown, len(prompt))  # back to the chain: the tree is gone
    assert runner.forward([grown], [[tree[0]]])[0].shape == (1, vocab)


def test_bad_trees_are_refused(tiny_paths):
    runner = ModelRunner(load_hf(tiny_paths["llama"]), num_slots=1, max_len=16)
    slot = runner.alloc_slot()
    with pytest.raises(RunnerError, match="parent"):
        tree_forward(runner, [slot], [[1, 2, 3]], [[-1, 2, 0]])
    with pytest.raises(ContextFull):
        tree_forward(runner, [slot], [list(range(17))], [chain_parents(17)])
    assert runner.lengths[slot] == 0


def test_tree_helpers():
    assert depths(TREE_PARENTS) == [1, 2, 3, 4, 2, 3, 2, 3, 4]
    assert leaf_paths(TREE_PARENTS) == [[0, 1, 2, 3], [0, 4, 5], [0, 6], [0, 1, 7, 8]]
    tokens = [10, 11, 12, 13, 14, 15, 16, 17, 18]
    assert within_depth(TREE_PARENTS, 2) == [0, 1, 4, 6]
    merged = merge_branches([10, 11], [-1, 0], [(-1, [10, 11, 12]), (0, [20]), (-1, [30])])
    assert merged == ([10, 11, 12, 20, 30], [-1, 0, 1, 0, -1])
    # The target says 10, 17 (not 11), then 18, then 5: the path 0 -> 7 -> 8 is taken, 5 follows.
    tokens = [10, 11, 12, 13, 14, 15, 16, 17, 18]
    after = {-1: 10, 0: 17, 7: 18, 8: 5}
    tree_parents = [-1, 0, 1, 2, 0, 4, 0, 0, 7]
    assert walk(tokens, tree_parents, after.__getitem__) == ([0, 7, 8], 5)
