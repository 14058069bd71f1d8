"""The CPU's compiled invariant attention (specdec/core/cpu_attention.c) gives a query the same bits
in any forward, and is attention.

A query is compared alone (one position, one row, the shortest span) with the same query inside
forwards that differ in everything else: a batch of rows at other lengths, a verify's or a prefill
chunk's width (several of the loop's tasks), a longer padded span, the cache read in place by slot
against gathered rows, one thread against two, and the library built for each instruction set
(AVX-512, AVX2 and FMA, plain loops). torch's SDPA fails the same comparison, so it can fail
(docs/design.md, invariant 2).
"""

from __future__ import annotations

import logging
import shutil

import pytest
import torch
import torch.nn.functional as F

from specdec.core import cpu_attention, cpu_build
from specdec.core.attention import attention_width, hidden_keys_bias, invariant_attention, padded_span
from specdec.core.runner import ModelRunner
from tests.conftest import load_hf, skip_for_environment

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs a C compiler (gcc)")

SCALE = 0.088


def _cache(slots: int, heads: int, span: int, dim: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(slots, heads, span, dim, generator=gen).bfloat16()
    values = torch.randn(slots, heads, span, dim, generator=gen).bfloat16()
    return keys, values


def _query(heads: int, dim: int, seed: int) -> torch.Tensor:
    return torch.randn(heads, dim, generator=torch.Generator().manual_seed(seed)).bfloat16()


def _alone(attend, query, keys, values, slot: int, position: int) -> torch.Tensor:
    """The query at `position` of slot `slot`, alone in its forward over the shortest span."""
    span = padded_span(position + 1)
    bias = hidden_keys_bias(torch.tensor([[position]]), span)
    out = attend(query[None, :, None], keys[slot : slot + 1, :, :span], values[slot : slot + 1, :, :span], bias, SCALE)
    return out[0, :, 0]


def _c_attend(q, keys, values, bias, scale, slots=None):
    return cpu_attention.attend(q, keys, values, bias, scale, slots)


def _sdpa(q, keys, values, bias, scale, slots=None):
    if slots is not None:
        keys, values = keys[slots, :, : bias.shape[-1]], values[slots, :, : bias.shape[-1]]
    visible = bias[:, 0] == 0
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=visible, scale=scale, enable_gqa=True)
    return out


def _mixed_forward(attend, keys, values, queries, in_place: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Three rows in one forward of width 12: slot 2 verifying at 290-301, slot 0 at 40-51, slot 3
    a single decode at 120 (its other columns padding at position 0); the span padded one block past
    the longest row. Returns (inside, alone) for each real query."""
    heads, dim = keys.shape[1] * 6, keys.shape[-1]
    slots, starts, widths, width = [2, 0, 3], [290, 40, 120], [12, 12, 1], 12
    positions = torch.zeros(3, width, dtype=torch.long)
    q = torch.zeros(3, heads, width, dim, dtype=torch.bfloat16)
    for row, (start, n) in enumerate(zip(starts, widths)):
        positions[row, :n] = torch.arange(start, start + n)
        for t in range(n):
            q[row, :, t] = queries[(row, t)]
    span = padded_span(302) + 64
    bias = hidden_keys_bias(positions, span)
    slot_t = torch.tensor(slots)
    if in_place:
        out = attend(q, keys, values, bias, SCALE, slot_t)
    else:
        out = attend(q, keys[slot_t, :, :span].contiguous(), values[slot_t, :, :span].contiguous(), bias, SCALE)
    pairs = []
    for row, (slot, start, n) in enumerate(zip(slots, starts, widths)):
        for t in range(n):
            pairs.append((out[row, :, t], _alone(attend, queries[(row, t)], keys, values, slot, start + t)))
    return pairs


def _queries(heads: int, dim: int) -> dict:
    return {(row, t): _query(heads, dim, 100 * row + t) for row in range(3) for t in range(12)}


@pytest.mark.parametrize("in_place", [True, False], ids=["cache read in place", "rows gathered"])
@pytest.mark.parametrize("threads", [1, 2])
def test_a_query_gets_the_same_bits_in_any_forward(in_place, threads):
    keys, values = _cache(4, 2, 512, 128)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        pairs = _mixed_forward(_c_attend, keys, values, _queries(12, 128), in_place)
    finally:
        torch.set_num_threads(before)
    assert len(pairs) == 25
    assert all(torch.equal(inside, alone) for inside, alone in pairs)


def test_sdpa_fails_the_same_comparison():
    keys, values = _cache(4, 2, 512, 128)
    pairs = _mixed_forward(_sdpa, keys, values, _queries(12, 128), in_place=True)
    assert not all(torch.equal(inside, alone) for inside, alone in pairs)


def test_a_prefill_chunk_gives_each_position_the_bits_of_its_decode():
    """A 300-token chunk (many of the loop's tasks of POSITIONS positions, each of a different
    width of visible keys) against each position decoded alone."""
    keys, values = _cache(1, 2, 320, 64)
    q = torch.randn(1, 8, 300, 64, generator=torch.Generator().manual_seed(3)).bfloat16()
    out = cpu_attention.attend(q, keys, values, hidden_keys_bias(torch.arange(300)[None], 320), SCALE)
    for t in (0, 1, 7, 8, 63, 64, 150, 299):
        assert torch.equal(out[0, :, t], _alone(_c_attend, q[0, :, t], keys, values, 0, t)), t


def test_keys_a_query_does_not_see_add_nothing_even_nan():
    keys, values = _cache(1, 2, 256, 128)
    q = torch.randn(1, 12, 2, 128, generator=torch.Generator().manual_seed(4)).bfloat16()
    bias = hidden_keys_bias(torch.tensor([[100, 101]]), 256)
    clean = cpu_attention.attend(q, keys, values, bias, SCALE)
    keys[:, :, 102:], values[:, :, 102:] = float("nan"), float("nan")
    assert torch.equal(cpu_attention.attend(q, keys, values, bias, SCALE), clean)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_other_cache_dtypes_get_the_bits_of_their_rows_alone(dtype):
    keys, values = (t.to(dtype) for t in _cache(3, 2, 256, 64))
    q = torch.randn(2, 8, 1, 64, generator=torch.Generator().manual_seed(6)).to(dtype)
    bias = hidden_keys_bias(torch.tensor([[100], [30]]), 128)
    both = cpu_attention.attend(q, keys, values, bias, SCALE, torch.tensor([2, 0]))
    assert both.dtype == dtype
    assert torch.equal(both[0, :, 0], _alone(_c_attend, q[0, :, 0], keys, values, 2, 100))
    assert torch.equal(both[1, :, 0], _alone(_c_attend, q[1, :, 0], keys, values, 0, 30))


def test_it_is_attention():
    """Within float32's rounding of the float64 softmax attention, grouped heads included."""
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(2, 8, 4, 64, generator=gen)
    keys, values = torch.randn(2, 2, 128, 64, generator=gen), torch.randn(2, 2, 128, 64, generator=gen)
    positions = torch.tensor([[10, 11, 12, 13], [90, 91, 92, 93]])
    bias = hidden_keys_bias(positions, 128)
    got = cpu_attention.attend(q, keys, values, bias, SCALE)
    scores = (q.double() * SCALE) @ keys.double().repeat_interleave(4, dim=1).transpose(-1, -2) + bias[:, 0].double()
    want = scores.softmax(-1) @ values.double().repeat_interleave(4, dim=1)
    assert (got.double() - want).abs().max() < 1e-5


# x86-64-v2: the plain loops; x86-64-v3: the AVX2 and FMA intrinsics (where the CPU runs them);
# native: AVX-512's where the CPU has it, else AVX2's again.
@pytest.mark.parametrize("march", ["x86-64-v2", "x86-64-v3"])
def test_each_instruction_set_gives_the_same_bits(tmp_path, monkeypatch, march):
    """The intrinsics and the plain loops do the same operations in the same order."""
    if march not in cpu_build.cpu_levels():
        skip_for_environment(f"the CPU does not run {march} code: that build cannot run here")
    keys, values = _cache(4, 2, 512, 128)
    queries = _queries(12, 128)
    native = [inside for inside, _ in _mixed_forward(_c_attend, keys, values, queries, in_place=True)]
    source = cpu_build.build(cpu_attention.SOURCE, shutil.which("gcc"), tmp_path, cpu_build.flags_for(march))
    other = cpu_build.load(source, cpu_attention.declare)
    monkeypatch.setattr(cpu_attention, "kernel", lambda: other)
    again = [inside for inside, _ in _mixed_forward(_c_attend, keys, values, queries, in_place=True)]
    assert all(torch.equal(a, b) for a, b in zip(native, again))


def test_the_runner_path_takes_the_compiled_loop_and_checks_shapes(monkeypatch):
    keys, values = _cache(2, 2, 256, 128)
    q = torch.randn(2, 12, 2, 128).bfloat16()
    bias = hidden_keys_bias(torch.tensor([[50, 51], [70, 71]]), 128)
    slots = torch.tensor([1, 0])
    both = invariant_attention(q, keys, values, bias, SCALE, slots=slots)
    assert torch.equal(both, cpu_attention.attend(q, keys, values, bias, SCALE, slots))
    # The loop takes one query per row as it is (attention_width: no padding to torch's GEMM rule),
    # with the bits that query has beside another.
    one = invariant_attention(q[:, :, :1], keys, values, bias[..., :1, :], SCALE, slots=slots)
    assert torch.equal(one, both[:, :, :1])
    assert attention_width(1, 12, 2, torch.device("cpu")) == 1
    with pytest.raises(ValueError, match="multiple of"):
        invariant_attention(q, keys, values, bias[..., :100], SCALE, slots=slots)  # a span of 100 keys
    monkeypatch.setattr(cpu_attention, "kernel", lambda: None)  # torch's path: its padding rule
    assert attention_width(1, 12, 2, torch.device("cpu")) == 2
    with pytest.raises(ValueError, match="multiple of"):
        invariant_attention(q[:, :, :1], keys, values, bias[..., :1, :], SCALE, slots=slots)


@pytest.fixture
def fresh_kernel():
    cpu_attention.kernel.cache_clear()
    yield
    cpu_attention.kernel.cache_clear()


def test_switched_off_or_without_a_compiler_the_torch_path_runs(fresh_kernel, monkeypatch, caplog, tmp_path):
    monkeypatch.setenv(cpu_build.ENV_SWITCH, "0")
    assert cpu_attention.kernel() is None and not cpu_attention.supports(torch.zeros(1))
    cpu_attention.kernel.cache_clear()
    monkeypatch.delenv(cpu_build.ENV_SWITCH)
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    with caplog.at_level(logging.WARNING, logger="specdec.core.cpu_build"):
        assert cpu_attention.kernel() is None
    assert "torch ops instead" in caplog.text


def test_a_failed_build_says_why_and_leaves_nothing(tmp_path):
    with pytest.raises(cpu_build.KernelBuildError, match="could not build"):
        cpu_build.build(cpu_attention.SOURCE, shutil.which("gcc"), tmp_path, ("-fno-such-flag", "-shared"))
    assert list(tmp_path.iterdir()) == []


def test_a_cpu_runner_builds_the_kernel_at_start(fresh_kernel, tiny_paths, caplog):
    """Built (or found in the cache) when a CPU runner is made, a drafter's too (its fast forward
    takes the loop as well), not in its first request's forward; the log says which attention the
    process runs."""
    model = load_hf(tiny_paths["llama"], dtype=torch.bfloat16)
    assert cpu_attention.kernel.cache_info().currsize == 0
    with caplog.at_level(logging.INFO, logger="specdec.core.cpu_build"):
        ModelRunner(model, num_slots=1, max_len=32, invariant_numerics=False)
    assert cpu_attention.kernel.cache_info().currsize == 1
    assert "the CPU's attention runs compiled" in caplog.text
