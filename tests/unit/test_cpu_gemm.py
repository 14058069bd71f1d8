"""The compiled bf16 GEMM (specdec/core/cpu_gemm.c) gives a row the same bits in any GEMM, and is a GEMM.

The loop runs where the CPU has no bf16 instructions; it is built here on any machine, so these
tests run everywhere: a row alone against the same row among 1 to 40 rows (every tile and
remainder), with one thread and two, with and without a bias, widths that are and are not a multiple
of the vector; the AVX2 build against the plain loops; the results against float64. A GEMM that
rounds a row by the GEMM's size fails the row comparison (docs/design.md, invariant 2).
"""

from __future__ import annotations

import ctypes
import shutil

import pytest
import torch
import torch.nn.functional as F

from specdec.core import cpu_build, cpu_gemm, packed, quant
from specdec.core.runner import ModelRunner
from tests.conftest import load_hf

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs a C compiler (gcc)")


def _build(tmp_path, flags: tuple[str, ...] = cpu_build.FLAGS) -> ctypes.CDLL:
    return cpu_build.load(cpu_build.build(cpu_gemm.SOURCE, shutil.which("gcc"), tmp_path, flags), cpu_gemm.declare)


@pytest.fixture(scope="module")
def lib(tmp_path_factory) -> ctypes.CDLL:
    return _build(tmp_path_factory.mktemp("kernels"))


def _weights(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=gen) * 0.05).bfloat16()
    x = torch.randn(40, k, generator=gen).bfloat16()
    bias = torch.randn(n, generator=gen).bfloat16()
    return w, x, bias


def _rows_break_the_rule(linear, w: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None) -> list[str]:
    """Where `linear` gives a row other bits than alone: among the first m rows (m = 1..40), or in
    the middle of a slice."""
    alone = torch.cat([linear(x[i : i + 1], w, bias) for i in range(len(x))])
    broken = [f"{m} rows" for m in range(1, len(x) + 1) if not torch.equal(linear(x[:m], w, bias), alone[:m])]
    return broken + ([] if torch.equal(linear(x[13:30], w, bias), alone[13:30]) else ["rows 13-29"])


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape", [(8960, 1536), (7, 20), (100, 131)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_a_row_gets_the_same_bits_in_any_gemm(lib, shape, threads):
    w, x, bias = _weights(*shape)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for b in (None, bias):
            assert _rows_break_the_rule(lambda *a: cpu_gemm.linear(*a, lib=lib), w, x, b) == []
    finally:
        torch.set_num_threads(before)


def test_the_comparison_catches_a_gemm_that_rounds_by_its_size(lib):
    """The comparison above can fail: a GEMM that rounds a row another way past 32 rows (as bf16 did
    on an AMX Xeon: tests/unit/test_invariance.py) is caught."""
    w, x, bias = _weights(100, 131)

    def by_size(rows, w, bias):
        out = cpu_gemm.linear(rows.float(), w, bias, lib)
        return (out * (1 + 2**-20) if rows.shape[0] > 32 else out).to(rows.dtype)

    assert _rows_break_the_rule(by_size, w, x.float(), None)[:2] == ["33 rows", "34 rows"]


def test_it_is_the_product(lib):
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(300, 1541, generator=gen).bfloat16()
    x, bias = torch.randn(9, 1541, generator=gen), torch.randn(300, generator=gen)
    want = x.double() @ w.double().T + bias.double()
    got = cpu_gemm.linear(x, w, bias, lib)  # float32 in, float32 out: no bf16 rounding of the result
    assert got.dtype == torch.float32 and got.shape == (9, 300)
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-4)
    assert cpu_gemm.linear(x.bfloat16().view(3, 3, 1541), w, None, lib).shape == (3, 3, 300)


def test_weights_packed_once_give_the_bits_of_plain_ones(monkeypatch, lib):
    """The runner packs its bf16 weights in the loop's panels once (specdec/core/packed.py); they
    hold the weights exactly, and a GEMM over them is the GEMM over the plain weight."""
    monkeypatch.setattr(cpu_gemm, "kernel", lambda: lib)
    w, x, bias = _weights(100, 131)  # 100 columns: the last panel is part padding
    p = packed.pack(w)
    assert p.panels and p.packed.shape == (7, 131, 8, 2) and torch.equal(cpu_gemm.unpack(p.packed, 100), w)
    for b in (None, bias):
        assert torch.equal(quant.linear(x, p, b), cpu_gemm.linear(x, w, b, lib))
    assert torch.equal(quant.linear(x, quant.pack_weight(quant.quantize_int8(w)), bias), quant.linear(x, w, bias))


def test_int8_panels_are_the_product_of_the_quantized_weights(monkeypatch, lib, tmp_path):
    """A draft model's int8 weights on the loop (where torch's int8 kernel read them at about half
    the memory's speed): (x q^T) scale + bias, the AVX2 build and the plain loops alike, and the
    runner's int8 weights take this path once packed."""
    gen = torch.Generator().manual_seed(3)
    w = (torch.randn(100, 531, generator=gen) * 0.05).bfloat16()  # k in blocks of 256: 2 whole, 1 part
    x, bias = torch.randn(9, 531, generator=gen), torch.randn(100, generator=gen)
    q = quant.quantize_int8(w)
    want = x.double() @ (q.q.double() * q.scale.double()[:, None]).T + bias.double()
    got = cpu_gemm.linear_int8(x, cpu_gemm.pack_int8(q.q), q.scale, bias, lib)
    assert got.dtype == torch.float32 and torch.allclose(got.double(), want, rtol=1e-5, atol=1e-4)
    plain = _build(tmp_path, cpu_build.flags_for("x86-64"))
    assert torch.equal(cpu_gemm.linear_int8(x, cpu_gemm.pack_int8(q.q), q.scale, bias, plain), got)
    monkeypatch.setattr(cpu_gemm, "kernel", lambda: lib)
    packed_q = quant.pack_weight(q)
    assert packed_q.panels is not None and packed_q.dense.panels
    rows = x[:4].bfloat16()  # a draft step's few rows
    assert torch.equal(quant.linear(rows, packed_q), cpu_gemm.linear_int8(rows, packed_q.panels, q.scale, None, lib))


def test_the_build_without_avx2_gives_the_same_bits(lib, tmp_path):
    plain = _build(tmp_path, cpu_build.flags_for("x86-64"))
    w, x, bias = _weights(257, 1543, seed=2)
    assert torch.equal(cpu_gemm.linear(x, w, bias, plain), cpu_gemm.linear(x, w, bias, lib))


def test_it_runs_where_the_cpu_has_no_bf16_instructions(monkeypatch, lib):
    """`kernel()` builds the loop exactly where oneDNN has no bf16 kernels, and the runner's linear
    then goes through it for bf16 weights only."""
    cpu_gemm.kernel.cache_clear()
    try:
        native = torch.ops.mkldnn._is_mkldnn_bf16_supported()
        assert (cpu_gemm.kernel() is None) == native
    finally:
        cpu_gemm.kernel.cache_clear()
    monkeypatch.setattr(cpu_gemm, "kernel", lambda: lib)
    w, x, bias = _weights(64, 96)
    assert torch.equal(quant.linear(x, w, bias), cpu_gemm.linear(x, w, bias, lib))
    assert not cpu_gemm.takes(w.float())
    assert torch.equal(quant.linear(x.float(), w.float()), F.linear(x.float(), w.float()))


def test_a_runner_on_the_loop_keeps_a_row_independent_of_the_forward(monkeypatch, lib, tiny_paths):
    """A bf16 runner whose GEMMs are the loop (as on a CPU without bf16 instructions): a prompt's
    logits in one forward beside other rows equal its logits fed one token at a time."""
    monkeypatch.setattr(cpu_gemm, "kernel", lambda: lib)
    model = load_hf(tiny_paths["qwen2"], dtype=torch.bfloat16)
    runner = ModelRunner(model, num_slots=3, max_len=64, pack_weights=False)
    prompt = [5, 9, 14, 3, 27, 8, 11]
    slot = runner.alloc_slot()
    one_by_one = torch.cat([runner.forward([slot], [[t]])[0] for t in prompt])
    runner.rollback(slot, 0)
    others = [runner.alloc_slot(), runner.alloc_slot()]
    runner.forward(others, [[1, 2, 3], [4]], num_logits=0)
    batched = runner.forward([others[0], slot, others[1]], [[6, 7], prompt, [8, 9, 10, 11]], num_logits=[1, 7, 2])
    assert torch.equal(batched[1], one_by_one)
