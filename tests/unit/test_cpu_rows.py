"""The RMS norm and the rotary embedding as compiled loops (specdec/core/cpu_rows.c).

The rotary embedding must give torch's bits; the norm its own fixed order, so a row's result is the
same alone, among other rows and at any row stride, and each instruction set gives the same bits.
The runner takes them on a CPU; its logits stay within a rounding of torch's ops.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from specdec.core import cpu_build, cpu_rows
from specdec.core.layer_ops import rotate_half
from specdec.core.runner import ModelRunner
from tests.conftest import load_hf, skip_for_environment

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs a C compiler (gcc)")

DTYPES = [torch.bfloat16, torch.float32]


def _build(directory, flags=cpu_build.FLAGS):
    return cpu_build.load(cpu_build.build(cpu_rows.SOURCE, shutil.which("gcc"), directory, flags), cpu_rows.declare)


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    return _build(tmp_path_factory.mktemp("kernels"))


@pytest.fixture
def compiled(monkeypatch, lib):
    monkeypatch.setattr(cpu_rows, "kernel", lambda: lib)


def _torch_rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_rotary_embedding_gives_torchs_bits(compiled, dtype):
    g = torch.Generator().manual_seed(0)
    rows, heads, dim = 5, 6, 64
    # q as the runner has it: a view into the joint q/k/v GEMM's output, rows apart by its width.
    joint = torch.randn(rows, heads * dim + 3 * dim, generator=g).to(dtype)
    q = joint[:, : heads * dim].view(rows, heads, dim)
    cos, sin = (torch.randn(rows, 1, dim, generator=g).to(dtype) for _ in range(2))
    want = q * cos + rotate_half(q) * sin
    tail = joint[:, heads * dim :].clone()
    got = cpu_rows.rotary_(q, cos, sin)
    assert got.data_ptr() == joint.data_ptr() and torch.equal(got, want)
    assert torch.equal(joint[:, heads * dim :], tail)  # nothing past q is touched


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_norm_is_torchs_within_a_rounding_and_a_row_is_its_own(compiled, dtype):
    g = torch.Generator().manual_seed(1)
    n = 1541  # not a multiple of the loop's 8 lanes
    x = (torch.randn(7, n + 5, generator=g) * 3).to(dtype)[:, :n]  # rows n + 5 apart
    weight = torch.randn(n, generator=g).bfloat16()
    got = cpu_rows.rms_norm(x, weight, 1e-6)
    want = _torch_rms(x, weight, 1e-6)
    assert got.dtype == dtype and got.shape == (7, n)
    # Another order of summing moves the norm by an ulp of float32, which may tip each of bf16's
    # two roundings (h / norm, then w times it) to the next value: 2 bf16 ulps at most.
    tol = 2**-6 if dtype == torch.bfloat16 else 2**-20
    assert ((got.float() - want.float()).abs() <= tol * want.float().abs()).all()
    for r in range(7):
        alone = cpu_rows.rms_norm(x[r : r + 1].contiguous(), weight, 1e-6)
        assert torch.equal(alone[0], got[r])


@pytest.mark.parametrize("march", ["x86-64-v2", "x86-64-v3"])
def test_each_instruction_set_gives_the_same_bits(monkeypatch, lib, tmp_path, march):
    if march not in cpu_build.cpu_levels():
        skip_for_environment(f"the CPU does not run {march} code: that build cannot run here")
    g = torch.Generator().manual_seed(2)
    x, weight = torch.randn(3, 1536, generator=g).bfloat16(), torch.randn(1536, generator=g).bfloat16()
    monkeypatch.setattr(cpu_rows, "kernel", lambda: lib)
    native = cpu_rows.rms_norm(x, weight, 1e-6)
    other = _build(tmp_path, cpu_build.flags_for(march))
    monkeypatch.setattr(cpu_rows, "kernel", lambda: other)
    assert torch.equal(cpu_rows.rms_norm(x, weight, 1e-6), native)


def test_the_runner_takes_them_and_stays_within_a_rounding_of_torchs_ops(monkeypatch, lib, tiny_paths):
    model = load_hf(tiny_paths["qwen2"], dtype=torch.bfloat16)
    prompt = [5, 9, 14, 3, 27, 8, 11]
    logits = {}
    calls = []
    for name, kernel in (("compiled", lambda: lib), ("torch", lambda: None)):
        monkeypatch.setattr(cpu_rows, "kernel", kernel)
        runner = ModelRunner(model, num_slots=1, max_len=32)
        if name == "compiled":  # count the compiled calls of one forward
            for fn in ("rms_norm", "rotary_"):
                original = getattr(cpu_rows, fn)
                monkeypatch.setattr(cpu_rows, fn, lambda *a, f=original, n=fn: calls.append(n) or f(*a))
        slot = runner.alloc_slot()
        logits[name] = torch.cat(
            [runner.forward([slot], [prompt], num_logits=len(prompt))[0], runner.forward([slot], [[21]])[0]]
        )
    layers = model.config.num_hidden_layers
    assert calls.count("rms_norm") == 2 * (2 * layers + 1) and calls.count("rotary_") == 2 * 2 * layers
    got, want = logits["compiled"], logits["torch"]
    assert (got - want).abs().max() <= 0.05 * want.abs().max()
