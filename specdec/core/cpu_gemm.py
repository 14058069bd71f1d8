"""bfloat16 GEMMs on a CPU without bfloat16 instructions, as one compiled loop (cpu_gemm.c).

Where the CPU has no bf16 dot product (oneDNN's bf16 kernels need avx512_bf16 or AMX; many AMD
and desktop CPUs have only AVX2), torch's bf16 GEMM falls back to a reference loop that runs a
prefill at a fifth of float32's speed (docs/results.md, "CPUs without bfloat16 instructions").
cpu_gemm.c reads the bf16 weights as they are, multiplies in float32 and fixes its order of
arithmetic, so a row's result depends on nothing else in the GEMM (docs/design.md, invariant 2).
Machines with bf16 instructions keep oneDNN's packed GEMM (specdec/core/packed.py).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from specdec.core.cpu_build import library

SOURCE = Path(__file__).with_name("cpu_gemm.c")

__all__ = ["SOURCE", "declare", "kernel", "linear", "takes"]


def declare(lib: ctypes.CDLL) -> None:
    pointer, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.bf16_linear.restype = None
    lib.bf16_linear.argtypes = [pointer] * 4 + [i64] * 3


@functools.cache
def kernel() -> ctypes.CDLL | None:
    """The compiled library where this CPU needs it (no bf16 instructions), else None."""
    if torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return None
    return library(SOURCE, declare, "bfloat16 GEMM")


def takes(w: torch.Tensor) -> bool:
    """Whether `linear` runs this weight: a plain bf16 CPU weight on a CPU that needs the loop."""
    return w.dtype == torch.bfloat16 and w.device.type == "cpu" and kernel() is not None


def linear(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, lib: ctypes.CDLL | None = None
) -> torch.Tensor:
    """F.linear(x, w, bias) for bf16 `w` [N, K] by cpu_gemm.c; the result in x's dtype. `lib`: a
    particular build (tests), else `kernel()`."""
    n, k = w.shape
    flat = x.reshape(-1, k).float().contiguous()
    w = w if w.is_contiguous() else w.contiguous()
    b = None if bias is None else bias.float().contiguous()
    out = torch.empty(flat.shape[0], n, dtype=torch.float32)
    (lib or kernel()).bf16_linear(
        flat.data_ptr(), w.data_ptr(), 0 if b is None else b.data_ptr(), out.data_ptr(), flat.shape[0], n, k
    )
    return out.to(x.dtype).view(*x.shape[:-1], n)
