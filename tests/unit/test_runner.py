"""The runner's logits equal transformers' forward on the same tokens (float32, <= 5e-4)."""

from __future__ import annotations

import pytest
import torch

from specdec.core.quant import Int8Weight
from specdec.core.runner import ContextFull, ModelRunner, RunnerError, SlotsExhausted
from tests.conftest import load_hf

# float32 up to the GEMMs' summation order: the runner's weights are in oneDNN's packed layout
# (specdec/core/packed.py), transformers' go through MKL; up to 1.6e-4 apart on SmolLM2's logits.
TOL = 5e-4


@pytest.fixture(scope="module", params=["llama", "qwen2", "smollm2"])
def model(request, tiny_paths):
    if request.param == "smollm2":
        path = request.getfixturevalue("smollm_path")
    else:
        path = tiny_paths[request.param]
    return load_hf(path)


def _sequences(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def _reference(model, seq: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([seq])).logits[0].float()


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape
    diff = (got - want).abs().max().item()
    assert diff <= TOL, f"max abs diff {diff}"


def test_prefill_decode_verify_rollback(model):
    vocab = model.config.vocab_size
    seqs = _sequences(vocab, [24, 17, 30])
    refs = [_reference(model, s) for s in seqs]
    runner = ModelRunner(model, num_slots=4, max_len=64)
    slots = [runner.alloc_slot() for _ in seqs]

    # Ragged prefill: all logits of each row.
    cut = [9, 4, 13]
    out = runner.forward(slots, [s[:c] for s, c in zip(seqs, cut)], num_logits=cut)
    for o, ref, c in zip(out, refs, cut):
        _close(o, ref[:c])

    # Batched single-token decode.
    out = runner.forward(slots, [[s[c]] for s, c in zip(seqs, cut)])
    for o, ref, c in zip(out, refs, cut):
        _close(o, ref[c : c + 1])
    cut = [c + 1 for c in cut]

    # Ragged multi-token verify (k+1 differs per row).
    add = [6, 2, 4]
    out = runner.forward(slots, [s[c : c + a] for s, c, a in zip(seqs, cut, add)], num_logits=add)
    for o, ref, c, a in zip(out, refs, cut, add):
        _close(o, ref[c : c + a])
    cut = [c + a for c, a in zip(cut, add)]
    assert [runner.lengths[s] for s in slots] == cut

    # Roll back rejected tokens, then re-extend with different tokens: logits follow the new text.
    runner.rollback(slots[0], cut[0] - 3)
    other = seqs[0][: cut[0] - 3] + [(t + 7) % vocab for t in seqs[0][cut[0] - 3 :]]
    other_ref = _reference(model, other)
    out = runner.forward([slots[0]], [other[cut[0] - 3 : cut[0] + 2]], num_logits=5)
    _close(out[0], other_ref[cut[0] - 3 : cut[0] + 2])
    assert runner.slot_tokens[slots[0]] == other[: cut[0] + 2]


def test_mixed_prefill_and_decode_in_one_batch(model):
    vocab = model.config.vocab_size
    a, b = _sequences(vocab, [12, 20], seed=3)
    runner = ModelRunner(model, num_slots=2, max_len=32)
    sa, sb = runner.alloc_slot(), runner.alloc_slot()
    runner.forward([sa], [a[:11]], num_logits=0)
    out = runner.forward([sa, sb], [[a[11]], b], num_logits=[1, 1])
    _close(out[0], _reference(model, a)[11:12])
    _close(out[1], _reference(model, b)[-1:])


def test_slots_and_context_errors(tiny_paths):
    model = load_hf(tiny_paths["llama"])
    runner = ModelRunner(model, num_slots=2, max_len=8)
    s0, s1 = runner.alloc_slot(), runner.alloc_slot()
    with pytest.raises(SlotsExhausted, match="2 KV-cache slots"):
        runner.alloc_slot()
    runner.free_slot(s1)
    assert runner.alloc_slot() == s1
    with pytest.raises(ContextFull, match="exceed the context of 8"):
        runner.forward([s0], [list(range(9))])
    with pytest.raises(RunnerError, match="token ids"):
        runner.forward([s0], [[model.config.vocab_size]])
    with pytest.raises(RunnerError, match="roll"):
        runner.rollback(s0, 3)
    assert runner.lengths[s0] == 0  # failed calls changed nothing


def test_common_prefix_is_what_the_cache_shares(tiny_paths):
    runner = ModelRunner(load_hf(tiny_paths["llama"]), num_slots=1, max_len=16)
    slot = runner.alloc_slot()
    runner.forward([slot], [[5, 6, 7, 8]], num_logits=0)
    assert runner.common_prefix(slot, [5, 6, 7, 8, 9]) == 4  # the cache, and a token it has not seen
    assert runner.common_prefix(slot, (5, 6, 7, 8)) == 4  # any sequence, not only a list
    assert runner.common_prefix(slot, [5, 6]) == 2  # fewer tokens than cached
    assert runner.common_prefix(slot, [5, 6, 9, 8]) == 2  # where they part
    assert runner.common_prefix(slot, [4, 6, 7, 8]) == 0
    assert runner.common_prefix(slot, []) == 0


def test_draft_options_vocab_subset_and_int8(tiny_paths):
    """Cheaper drafters: a vocabulary subset masks the other ids; int8 weights stay close."""
    model = load_hf(tiny_paths["qwen2"])
    seq = _sequences(model.config.vocab_size, [12], seed=9)[0]
    full = ModelRunner(model, num_slots=1, max_len=32)
    subset = list(range(0, model.config.vocab_size, 3))
    sub = ModelRunner(model, num_slots=1, max_len=32, vocab_subset=subset)
    want = full.forward([full.alloc_slot()], [seq], num_logits=4)[0]
    got = sub.forward([sub.alloc_slot()], [seq], num_logits=4)[0]
    inside = torch.zeros(model.config.vocab_size, dtype=torch.bool)
    inside[subset] = True
    _close(got[:, inside], want[:, inside])
    assert torch.isinf(got[:, ~inside]).all()
    # int8 applies to bf16 models (the CPU kernel is slower than dense for float32 activations).
    bf16 = load_hf(tiny_paths["qwen2"], dtype=torch.bfloat16)
    dense = ModelRunner(bf16, num_slots=1, max_len=32)
    quant = ModelRunner(bf16, num_slots=1, max_len=32, weight_quant="int8")
    assert isinstance(quant.layers[0].q, Int8Weight)
    ref = dense.forward([dense.alloc_slot()], [seq], num_logits=4)[0]
    q = quant.forward([quant.alloc_slot()], [seq[:-1]], num_logits=0)  # a prefill takes the dense path
    q = quant.forward([0], [seq[-1:]], num_logits=1)[0]  # a decode step takes the int8 kernel
    rel = (q - ref[-1:]).abs().max() / ref.abs().max()
    assert 0 < rel < 0.1, f"int8 relative error {rel}"
    assert not isinstance(ModelRunner(model, num_slots=1, max_len=32, weight_quant="int8").layers[0].q, Int8Weight)
