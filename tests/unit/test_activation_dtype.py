"""A drafter computes in float32 where the compiled GEMM loop runs (cpu_gemm.activation_dtype).

The loop multiplies bf16 weights in float32 anyway, so a fast-numerics runner (a drafter) keeps its
activations and KV cache in float32 there: no roundings to bf16 between operations, and torch's
float32 attention instead of its slower bf16 one. Its numbers are then the model's float32 ones on
its bf16 weights. A target (the invariant forward) keeps bf16. The loop is built here on any
machine, as in test_cpu_gemm.py.
"""

from __future__ import annotations

import copy
import shutil

import pytest
import torch

from specdec.core import cpu_build, cpu_gemm
from specdec.core.runner import ModelRunner
from tests.conftest import load_hf

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs a C compiler (gcc)")

PROMPT = [5, 9, 14, 3, 27, 8, 11, 2, 30, 7, 19]  # 11 tokens: more than an int8 GEMM's 8 rows
STEP = [21]


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    path = cpu_build.build(cpu_gemm.SOURCE, shutil.which("gcc"), tmp_path_factory.mktemp("kernels"))
    return cpu_build.load(path, cpu_gemm.declare)


def _prefill_and_step(runner: ModelRunner) -> torch.Tensor:
    """Logits of the prompt's positions and of one decode step after it: [len(PROMPT) + 1, vocab]."""
    slot = runner.alloc_slot()
    first = runner.forward([slot], [PROMPT], num_logits=len(PROMPT))[0]
    return torch.cat([first, runner.forward([slot], [STEP])[0]])


@torch.inference_mode()
def _float32_logits(model) -> torch.Tensor:
    """The HF model's own forward in float32 on the same (bf16-valued) weights."""
    wide = copy.deepcopy(model).float()
    return wide(torch.tensor([PROMPT + STEP])).logits[0]


def test_a_drafter_computes_in_float32_on_its_bf16_weights(monkeypatch, lib, tiny_paths):
    monkeypatch.setattr(cpu_gemm, "kernel", lambda: lib)
    model = load_hf(tiny_paths["qwen2"], dtype=torch.bfloat16)
    draft = ModelRunner(model, num_slots=1, max_len=32, invariant_numerics=False)
    assert draft.act_dtype == torch.float32
    assert draft.k_cache.dtype == draft.v_cache.dtype == torch.float32
    want = _float32_logits(model)
    got = _prefill_and_step(draft)
    # float32 sums in another order than HF's: differences of a few ulps of the logits, where
    # one rounding to bf16 anywhere in the layers makes them about 1e-3 of the logits' size.
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


def test_a_target_and_an_int8_drafter(monkeypatch, lib, tiny_paths):
    """The invariant forward keeps the model's dtype; an int8 drafter computes in float32 too,
    through both of its paths (the dense weights for the prompt's rows, int8 panels for a step)."""
    monkeypatch.setattr(cpu_gemm, "kernel", lambda: lib)
    model = load_hf(tiny_paths["qwen2"], dtype=torch.bfloat16)
    target = ModelRunner(model, num_slots=1, max_len=32)
    assert target.act_dtype == target.k_cache.dtype == torch.bfloat16
    draft = ModelRunner(model, num_slots=1, max_len=32, weight_quant="int8", invariant_numerics=False)
    assert draft.act_dtype == draft.k_cache.dtype == torch.float32
    want = _float32_logits(model)
    got = _prefill_and_step(draft)
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    # int8 weights: about 1 % of each weight's row maximum off the model's.
    assert (got - want).abs().max() <= 0.05 * want.abs().max()


def test_without_the_loop_a_drafter_keeps_bf16(monkeypatch, tiny_paths):
    monkeypatch.setattr(cpu_gemm, "kernel", lambda: None)
    model = load_hf(tiny_paths["qwen2"], dtype=torch.bfloat16)
    draft = ModelRunner(model, num_slots=1, max_len=32, invariant_numerics=False, pack_weights=False)
    assert draft.act_dtype == draft.k_cache.dtype == torch.bfloat16
