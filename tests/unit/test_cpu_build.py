"""The compiled CPU loops where the process has no compiler (the image's runtime): prebuilt for each
x86-64 level by `python -m specdec.core.cpu_build DIR`, the best level the CPU runs loaded from
SPECDEC_PREBUILT_KERNELS, only if built from the same source text (specdec/core/cpu_build.py)."""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys

import pytest
import torch

from specdec.core import cpu_attention, cpu_build, cpu_gemm
from specdec.core.attention import hidden_keys_bias

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs a C compiler (gcc)")

V2 = {"cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3", "sse2", "fpu"}
V3 = V2 | {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"}
V4 = V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx512_bf16"}


@pytest.mark.parametrize(
    ("flags", "levels"),
    [
        (V4, ["x86-64-v4", "x86-64-v3", "x86-64-v2"]),
        (V3, ["x86-64-v3", "x86-64-v2"]),
        (V3 - {"fma"}, ["x86-64-v2"]),  # AVX2 without FMA runs no v3 code
        (V4 - {"avx2"}, ["x86-64-v2"]),  # a level needs every level below it
        (V2 - {"popcnt"}, []),
    ],
    ids=["avx512", "avx2", "avx2-no-fma", "avx512-no-avx2", "older"],
)
def test_the_levels_a_cpu_runs_come_from_its_flags(flags, levels):
    assert cpu_build.cpu_levels(flags) == levels


GCC = shutil.which("gcc")


@pytest.fixture(scope="module")
def prebuilt(tmp_path_factory):
    """Every loop built for every level by the command the image runs."""
    out = tmp_path_factory.mktemp("prebuilt")
    done = subprocess.run(
        [sys.executable, "-m", "specdec.core.cpu_build", str(out)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    names = {p.name for p in out.iterdir()}
    assert names == {cpu_build.prebuilt_name(s, lvl) for s in cpu_build.SOURCES for lvl in cpu_build.LEVELS}
    return out


@pytest.fixture(scope="module")
def native(tmp_path_factory):
    """This machine's own builds (-march=native) of both loops."""
    out = tmp_path_factory.mktemp("native")
    attention = cpu_build.load(cpu_build.build(cpu_attention.SOURCE, GCC, out), cpu_attention.declare)
    gemm = cpu_build.load(cpu_build.build(cpu_gemm.SOURCE, GCC, out), cpu_gemm.declare)
    return attention, gemm


@pytest.fixture
def no_compiler(monkeypatch, tmp_path):
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.delenv(cpu_build.ENV_SWITCH, raising=False)
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))  # nothing built locally either
    monkeypatch.setattr(shutil, "which", lambda *_a, **_k: None)


def _attention(monkeypatch, lib) -> torch.Tensor:
    gen = torch.Generator().manual_seed(3)
    keys = torch.randn(2, 2, 256, 128, generator=gen).bfloat16()
    values = torch.randn(2, 2, 256, 128, generator=gen).bfloat16()
    q = torch.randn(2, 12, 5, 128, generator=gen).bfloat16()
    bias = hidden_keys_bias(torch.tensor([[90 + t for t in range(5)], [200 + t for t in range(5)]]), 256)
    monkeypatch.setattr(cpu_attention, "kernel", lambda: lib)
    return cpu_attention.attend(q, keys, values, bias, 0.088)


def _gemm(lib) -> torch.Tensor:
    gen = torch.Generator().manual_seed(5)
    x, w = torch.randn(7, 200, generator=gen), torch.randn(96, 200, generator=gen).bfloat16()
    return cpu_gemm.linear(x, w, torch.randn(96, generator=gen), lib=lib)


def test_without_a_compiler_the_best_prebuilt_level_loads_and_gives_the_built_bits(
    prebuilt, native, no_compiler, monkeypatch, caplog
):
    monkeypatch.setenv(cpu_build.PREBUILT_ENV, str(prebuilt))
    best = cpu_build.cpu_levels()[0]
    with caplog.at_level(logging.INFO, logger="specdec.core.cpu_build"):
        attention = cpu_build.library(cpu_attention.SOURCE, cpu_attention.declare, "attention")
        gemm = cpu_build.library(cpu_gemm.SOURCE, cpu_gemm.declare, "bfloat16 GEMM")
    assert attention is not None and gemm is not None
    assert f"the CPU's attention runs compiled (prebuilt for {best})" in caplog.text
    assert cpu_build.prebuilt_name(cpu_attention.SOURCE, best) in caplog.text
    assert torch.equal(_attention(monkeypatch, attention), _attention(monkeypatch, native[0]))
    assert torch.equal(_gemm(gemm), _gemm(native[1]))


def test_a_library_prebuilt_from_another_source_text_is_not_loaded(no_compiler, monkeypatch, caplog, tmp_path):
    """Prebuilt loops of another revision of the source may round differently: none loads."""
    older = tmp_path / "cpu_attention.c"
    older.write_text(cpu_attention.SOURCE.read_text() + "\n/* another revision */\n")
    out = tmp_path / "kernels"
    cpu_build.prebuild(out, GCC, (older,))
    assert len(list(out.iterdir())) == len(cpu_build.LEVELS)
    monkeypatch.setenv(cpu_build.PREBUILT_ENV, str(out))
    with caplog.at_level(logging.WARNING, logger="specdec.core.cpu_build"):
        assert cpu_build.library(cpu_attention.SOURCE, cpu_attention.declare, "attention") is None
    assert f"none in {cpu_build.PREBUILT_ENV}={out}" in caplog.text and "runs as torch ops" in caplog.text


def test_without_a_compiler_or_prebuilt_loops_torch_runs(no_compiler, caplog):
    with caplog.at_level(logging.WARNING, logger="specdec.core.cpu_build"):
        assert cpu_build.library(cpu_gemm.SOURCE, cpu_gemm.declare, "bfloat16 GEMM") is None
    assert f"{cpu_build.PREBUILT_ENV} unset" in caplog.text
