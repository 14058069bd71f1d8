"""q, k and v (and gate and up) as one GEMM where the compiled loop runs: the same numbers as apart.

A column of the loop's GEMM is a fold over its own weight row (specdec/core/cpu_gemm.c), so the
joint weights must give the runner's logits bit for bit as the separate ones do: a target's (the
invariant forward, bf16) and a draft's (int8, whose few rows take the int8 panels and whose prefill
takes the dense ones). The loop is built here on any machine, as in test_cpu_gemm.py.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from specdec.core import cpu_build, cpu_gemm, fused
from specdec.core import runner as runner_module
from specdec.core.quant import quantize_int8
from specdec.core.runner import ModelRunner
from tests.conftest import load_hf

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs a C compiler (gcc)")

PROMPT = [5, 9, 14, 3, 27, 8, 11, 2, 30, 7, 19]  # 11 tokens: more than an int8 GEMM's 8 rows


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    path = cpu_build.build(cpu_gemm.SOURCE, shutil.which("gcc"), tmp_path_factory.mktemp("kernels"))
    return cpu_build.load(path, cpu_gemm.declare)


def _logits(runner: ModelRunner) -> list[torch.Tensor]:
    """A prefill, a 3-token verify-sized step and a decode step."""
    slot = runner.alloc_slot()
    return [
        runner.forward([slot], [PROMPT], num_logits=len(PROMPT))[0],
        runner.forward([slot], [[4, 12, 6]], num_logits=3)[0],
        runner.forward([slot], [[21]])[0],
    ]


@pytest.mark.parametrize("quant", [None, "int8"], ids=["bf16 target", "int8 draft"])
def test_joint_weights_give_the_logits_of_separate_ones(monkeypatch, lib, tiny_paths, quant):
    monkeypatch.setattr(cpu_gemm, "kernel", lambda: lib)
    model = load_hf(tiny_paths["qwen2"], dtype=torch.bfloat16)  # q, k and v with biases
    options = {"weight_quant": quant, "invariant_numerics": quant is None, "max_len": 32}
    joint = ModelRunner(model, num_slots=1, **options)
    layer = joint.layers[0]
    assert layer.qkv is not None and layer.qkv_bias is not None and layer.gate_up is not None
    assert layer.qkv.shape[0] == layer.q.shape[0] + layer.k.shape[0] + layer.v.shape[0]
    monkeypatch.setattr(runner_module, "fuse", lambda parts, biases: None)
    apart = ModelRunner(model, num_slots=1, **options)
    assert apart.layers[0].qkv is None
    for got, want in zip(_logits(joint), _logits(apart)):
        assert torch.equal(got, want)


def test_weights_stay_apart_where_the_loop_does_not_take_them(monkeypatch, lib):
    """float32 weights (oneDNN's), and parts of which only some have a bias."""
    monkeypatch.setattr(cpu_gemm, "kernel", lambda: lib)
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(16, 32, generator=gen), torch.randn(8, 32, generator=gen)
    assert fused.fuse([a, b], [None, None]) is None
    a, b = a.bfloat16(), b.bfloat16()
    assert fused.fuse([a, b], [torch.ones(16), None]) is None
    joint, bias = fused.fuse([quantize_int8(a), quantize_int8(b)], [None, None])
    assert bias is None and joint.panels is not None and joint.q.device.type == "meta"
    joint, bias = fused.fuse([a, b], [torch.ones(16, dtype=torch.bfloat16), torch.zeros(8, dtype=torch.bfloat16)])
    assert joint.panels and bias.dtype == torch.float32 and bias.shape == (24,)
