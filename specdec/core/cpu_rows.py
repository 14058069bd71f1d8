"""A layer's RMS norm and rotary embedding on a CPU as compiled loops (cpu_rows.c), built on first use.

At a decode step's few rows, torch's ops for these cost far more than their arithmetic: an RMS
norm is eight ops of 5-100 us each, the rotary embedding of q or k six (docs/results.md, "CPUs
without bfloat16 instructions"). Each is one call here. The rotary embedding gives torch's bits;
the norm sums its squares in its own fixed order, so a row's result depends only on the row
(docs/design.md, invariant 2).

Built and cached by specdec/core/cpu_build.py; without a compiler (and no prebuilt library), or with
``SPECDEC_CPU_KERNELS=0``, `kernel` is None and the runner keeps torch's ops. A process keeps what it
got, so its outputs stay self-consistent.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from specdec.core.cpu_build import library

SOURCE = Path(__file__).with_name("cpu_rows.c")

__all__ = ["SOURCE", "declare", "kernel", "rms_norm", "rotary_", "supports"]


def declare(lib: ctypes.CDLL) -> None:
    pointer, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.rms_norm.restype = None
    lib.rms_norm.argtypes = [pointer, i64, pointer, pointer, i64, i64, ctypes.c_float, ctypes.c_int]
    lib.rotary.restype = None
    lib.rotary.argtypes = [pointer, i64, i64, pointer, pointer, i64, i64, i64, ctypes.c_int]


@functools.cache
def kernel() -> ctypes.CDLL | None:
    """The compiled library, or None: switched off, no compiler, or a build that failed (logged)."""
    return library(SOURCE, declare, "norms and rotary embedding")


def supports(x: torch.Tensor) -> bool:
    """Whether the loops take x: a bf16 or float32 CPU tensor whose last dimension is contiguous,
    where the library is built."""
    return (
        x.device.type == "cpu"
        and x.dtype in (torch.bfloat16, torch.float32)
        and x.stride(-1) == 1
        and kernel() is not None
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / sqrt(mean(x^2) + eps) over x [rows, n]'s rows, in x's dtype (see cpu_rows.c)."""
    if weight.dtype != torch.bfloat16:
        raise TypeError(f"rms_norm takes bf16 weights, got {weight.dtype}")
    rows, n = x.shape
    w = weight.contiguous()
    out = torch.empty(rows, n, dtype=x.dtype)
    kernel().rms_norm(
        x.data_ptr(), x.stride(0), w.data_ptr(), out.data_ptr(), rows, n, eps, int(x.dtype == torch.bfloat16)
    )
    return out


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [rows, heads, dim] rotated in place by cos, sin [rows, dim] or [rows, 1, dim] in x's dtype;
    returns x."""
    rows, heads, dim = x.shape
    cos, sin = cos.reshape(rows, dim).contiguous(), sin.reshape(rows, dim).contiguous()
    bf16 = int(x.dtype == torch.bfloat16)
    kernel().rotary(x.data_ptr(), x.stride(0), x.stride(1), cos.data_ptr(), sin.data_ptr(), rows, heads, dim, bf16)
    return x
