"""Tensor parallelism in the core: a sharded group's logits equal the unsharded runner's.

The test process is rank 0 (a LeaderRunner over its shard); the other ranks are child processes
running `follow` (specdec.core.tp_group.LocalGroup), joined by gloo on loopback. Each case feeds
the same calls to the group and to an unsharded runner: ragged prefill, batched decode, ragged
multi-token verify, rollback and re-extension, and a freed slot reused by a new sequence.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from specdec.core.lockstep import GroupFailure
from specdec.core.models import load_model
from specdec.core.runner import ModelRunner
from specdec.core.tp import TPError, check_shardable, plan_shard
from specdec.core.tp_group import GroupSpec, LocalGroup

# float32 up to summation order: a shard sums its part of each dot product, the all-reduce the
# parts; in oneDNN's packed GEMMs (specdec/core/packed.py) up to 1.8e-4 apart on SmolLM2's logits.
TOL = 5e-4


# ---- shapes ------------------------------------------------------------------------------------


def test_whole_heads_or_a_clear_error_naming_the_model_and_n():
    check_shardable(12, 2, 8960, 2, "qwen")  # Qwen2.5-Coder-1.5B at TP 2
    check_shardable(9, 3, 1536, 3, "smollm")  # SmolLM2-135M at TP 3
    check_shardable(12, 2, 8960, 4, "qwen")  # fewer KV heads than ranks: replicated
    bad = [
        ((9, 3, 1536, 2), ["smollm2", "tensor_parallel=2", "9 attention heads"]),
        ((12, 2, 8960, 3), ["tensor_parallel=3", "2 KV heads"]),
        ((4, 2, 131, 2), ["MLP width 131"]),
    ]
    for (heads, kv, mlp, n), words in bad:
        with pytest.raises(TPError) as err:
            check_shardable(heads, kv, mlp, n, "smollm2")
        for word in words:
            assert word in str(err.value), (word, str(err.value))
    for n in (0, -1, 1.5, True):
        with pytest.raises(TPError, match="integer >= 1"):
            check_shardable(12, 2, 8960, n, "qwen")


def test_plans_cover_every_head_once_and_replicate_scarce_kv_heads():
    plans = [plan_shard(12, 2, 64, r, 4) for r in range(4)]
    assert [p.heads for p in plans] == [(0, 3), (3, 6), (6, 9), (9, 12)]
    # query heads 0-5 use KV head 0 and 6-11 KV head 1 (group of 6): each rank keeps the one it uses
    assert [p.kv_heads for p in plans] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert [p.mlp for p in plans] == [(0, 16), (16, 32), (32, 48), (48, 64)]
    plans = [plan_shard(4, 2, 128, r, 2) for r in range(2)]
    assert [p.kv_heads for p in plans] == [(0, 1), (1, 2)]


# ---- sharded == unsharded ----------------------------------------------------------------------


def _close(got: list[torch.Tensor], want: list[torch.Tensor], tol: float, what: str) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape, what
        diff = (g - w).abs().max().item() if g.numel() else 0.0
        assert diff <= tol, f"{what}: max abs diff {diff}"


def _same_calls(ref, tp, vocab: int, tol: float) -> None:
    """Run the same calls on the unsharded `ref` and the group's leader `tp`; compare the logits."""
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (40, 30, 50)]

    def both(what, slots, feeds, n_logits):
        _close(tp.forward(slots, feeds, n_logits), ref.forward(slots, feeds, n_logits), tol, what)

    slots = [ref.alloc_slot() for _ in seqs]
    assert [tp.alloc_slot() for _ in seqs] == slots
    cut = [9, 4, 13]
    both("ragged prefill", slots, [s[:c] for s, c in zip(seqs, cut)], cut)
    both("batched decode", slots, [[s[c]] for s, c in zip(seqs, cut)], 1)
    cut = [c + 1 for c in cut]
    add = [6, 2, 4]
    both("ragged verify", slots, [s[c : c + a] for s, c, a in zip(seqs, cut, add)], add)
    cut = [c + a for c, a in zip(cut, add)]
    for r in (ref, tp):  # reject some drafted tokens
        r.rollback(slots[0], cut[0] - 3)
        r.rollback(slots[2], cut[2] - 1)
    cut[0] -= 3
    cut[2] -= 1
    both("re-extension after rollback", slots, [s[c : c + 3] for s, c in zip(seqs, cut)], [3, 1, 2])
    for r in (ref, tp):  # a finished request's slot is reused by a new one
        r.free_slot(slots[1])
        assert r.alloc_slot() == slots[1]
    new = torch.randint(0, vocab, (12,), generator=gen).tolist()
    both("prefill into a reused slot", [slots[1]], [new], 2)
    both("decode after reuse", slots, [[seqs[0][cut[0] + 3]], [new[0]], [seqs[2][cut[2] + 3]]], 1)


CASES = [
    # (model, ranks, lm_head, dtype, runner kwargs, tolerance)
    ("llama", 2, "split", "float32", {}, TOL),
    ("qwen2", 2, "replicated", "float32", {}, TOL),  # GQA and q/k/v biases
    ("smollm2", 3, "split", "float32", {}, TOL),  # 9 heads, 3 KV heads: TP 3, not 2
    ("llama", 2, "split", "float32", {"static_shapes": True}, TOL),  # decode and verify at static shapes
]


def _model_path(name: str, request) -> str:
    if name == "smollm2":
        return str(request.getfixturevalue("smollm_path"))
    return str(request.getfixturevalue("tiny_paths")[name])


@pytest.mark.parametrize(
    "name,ranks,lm_head,dtype,kwargs,tol", CASES, ids=[f"{c[0]}-tp{c[1]}-{c[2]}{'-static' * bool(c[4])}" for c in CASES]
)
def test_sharded_logits_equal_unsharded(request, name, ranks, lm_head, dtype, kwargs, tol):
    path = _model_path(name, request)
    spec = GroupSpec(path, ranks, dtype=dtype, num_slots=4, max_len=40, lm_head=lm_head, runner_kwargs=kwargs)
    loaded = load_model(path, dtype=dtype)
    ref = spec.build_runner(loaded.model)
    with LocalGroup(spec, threads=1) as group:
        tp = group.start(spec.build_runner(loaded.model))
        assert tp.num_kv_heads < ref.num_kv_heads or ranks > ref.num_kv_heads
        assert tp.k_cache.shape[2] == tp.num_kv_heads  # the cache holds only this rank's KV heads
        assert tp.k_cache.shape[3] == ref.k_cache.shape[3]  # whole key blocks, as the invariant attention reads
        _same_calls(ref, tp, loaded.model.config.vocab_size, tol)


def test_int8_draft_runner_with_a_vocabulary_subset_shards(tiny_paths):
    """The drafters' cheaper runner (int8 weights, bf16, frequency-ranked vocabulary subset) on two
    ranks: the same int8 matmuls summed in another order, so bf16-close, and an argmax that is the
    reference's best token or within that closeness of it (a near-tie may fall either way: it did
    on an AMX Xeon)."""
    path = str(tiny_paths["llama"])
    kwargs = {"weight_quant": "int8", "vocab_subset": list(range(0, 259, 2))}  # odd ids are left out
    spec = GroupSpec(path, 2, dtype="bfloat16", num_slots=2, max_len=64, runner_kwargs=kwargs)
    loaded = load_model(path, dtype="bfloat16")
    ref = spec.build_runner(loaded.model)
    with LocalGroup(spec, threads=1) as group:
        tp = group.start(spec.build_runner(loaded.model))
        assert type(tp.layers[0].q).__name__ == "Int8Weight"
        s = ref.alloc_slot()
        assert tp.alloc_slot() == s
        prompt = list(range(60, 80))
        calls = [(prompt, 3), ([81], 1), ([82, 83, 84], 3), ("rollback", 0), ([90, 91], 2)]
        for feed, k in calls:  # prefill, decode, verify, rollback, re-extension
            if feed == "rollback":
                ref.rollback(s, len(prompt) + 1)
                tp.rollback(s, len(prompt) + 1)
                continue
            got, want = tp.forward([s], [feed], k)[0], ref.forward([s], [feed], k)[0]
            assert torch.isinf(got[:, 1::2]).all() and torch.isinf(want[:, 1::2]).all()
            assert torch.equal(got.isfinite(), want.isfinite())
            finite = want.isfinite()
            scale = want[finite].abs().max().item()
            assert (got[finite] - want[finite]).abs().max().item() <= 0.03 * scale
            picked = want.gather(-1, got.argmax(-1, keepdim=True)).squeeze(-1)
            assert (picked >= want.max(-1).values - 0.03 * scale).all()


def test_a_hung_rank_is_found_by_the_timeout(tiny_paths):
    """A follower that stops answering (SIGSTOP) fails the next forward within the group timeout,
    and the group stays down (it restarts as a unit, not piecemeal)."""
    path = str(tiny_paths["llama"])
    # 10 s: long beside a loaded machine's stalls of a running rank, short beside the bound below
    spec = GroupSpec(path, 2, num_slots=2, max_len=64, timeout_s=10.0)
    loaded = load_model(path)
    group = LocalGroup(spec, threads=1)
    try:
        tp = group.start(spec.build_runner(loaded.model))
        s = tp.alloc_slot()
        tp.forward([s], [[1, 2, 3]], 1)
        os.kill(group.procs[0].pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(GroupFailure):
            tp.forward([s], [[4]], 1)
        assert time.monotonic() - t0 < 30
        assert tp.broken and tp.wait_done(0)
        with pytest.raises(GroupFailure, match="down"):
            tp.forward([s], [[5]], 1)
    finally:
        for p in group.procs:
            p.kill()
        group.close()


def test_a_tensor_parallel_group_runs_each_forward_in_the_mode_asked(tiny_paths):
    """Rank 0 tells the other ranks which forward to run (the two pad their GEMMs differently: mixed
    modes would all-reduce tensors of other sizes), and two ranks stay row-invariant (a sum of two
    partial results is the same in either order)."""
    path = str(tiny_paths["qwen2"])
    spec = GroupSpec(path, 2, dtype="bfloat16", num_slots=3, max_len=64, lm_head="split")
    model = load_model(path, dtype="bfloat16").model
    seq = torch.randperm(model.config.vocab_size, generator=torch.Generator().manual_seed(2))[:20].tolist()
    ref = ModelRunner(model, num_slots=1, max_len=64)
    want = ref.forward([ref.alloc_slot()], [seq], 20, invariant=False)[0]
    with LocalGroup(spec, threads=1) as group:
        tp = group.start(spec.build_runner(model))
        a, b, c = (tp.alloc_slot() for _ in range(3))
        fast = tp.forward([c], [seq], 20, invariant=False)[0]
        assert (fast - want).abs().max().item() < 0.05 * want.abs().max().item()
        decoded = torch.cat([tp.forward([a], [[t]], invariant=True)[0] for t in seq])
        verified = torch.cat(
            [
                tp.forward([b], [seq[:7]], 7, invariant=True)[0],
                tp.forward([b, c], [seq[7:], [1, 2]], [13, 2], invariant=True)[0],
            ]
        )
        assert torch.equal(verified, decoded)
