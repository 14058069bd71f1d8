"""bfloat16 GEMMs on a CPU without bfloat16 instructions, as one compiled loop (cpu_gemm.c).

Where the CPU has no bf16 dot product (oneDNN's bf16 kernels need avx512_bf16 or AMX; many AMD
and desktop CPUs have only AVX2), torch's bf16 GEMM falls back to a reference loop that runs a
prefill at a fifth of float32's speed (docs/results.md, "CPUs without bfloat16 instructions").
cpu_gemm.c reads the bf16 weights packed in panels (`pack`, once at load: specdec/core/packed.py),
multiplies in float32 and fixes its order of arithmetic, so a row's result depends on nothing else
in the GEMM (docs/design.md, invariant 2). Machines with bf16 instructions keep oneDNN's packed
GEMM.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch
import torch.nn.functional as F

from specdec.core.cpu_build import library

SOURCE = Path(__file__).with_name("cpu_gemm.c")

__all__ = [
    "SOURCE",
    "PANEL",
    "activation_dtype",
    "declare",
    "kernel",
    "linear",
    "linear_int8",
    "linear_packed",
    "pack",
    "pack_int8",
    "takes",
    "unpack",
]

PANEL = 16  # output columns per panel (cpu_gemm.c)


def declare(lib: ctypes.CDLL) -> None:
    pointer, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.bf16_linear.restype = None
    lib.bf16_linear.argtypes = [pointer] * 4 + [i64] * 3
    lib.int8_linear.restype = None
    lib.int8_linear.argtypes = [pointer] * 5 + [i64] * 3


@functools.cache
def kernel() -> ctypes.CDLL | None:
    """The compiled library where this CPU needs it (no bf16 instructions), else None."""
    if torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return None
    return library(SOURCE, declare, "bfloat16 GEMM")


def takes(w: torch.Tensor) -> bool:
    """Whether `linear` runs this weight: a plain bf16 CPU weight on a CPU that needs the loop."""
    return w.dtype == torch.bfloat16 and w.device.type == "cpu" and kernel() is not None


def activation_dtype(device: torch.device, dtype: torch.dtype, invariant: bool) -> torch.dtype:
    """What a runner's activations and KV cache are held in: its weights' dtype, except float32 for
    a runner of bf16 weights in fast numerics (a drafter) on a CPU where this loop runs. The loop
    multiplies in float32 anyway, so the roundings to bf16 between the layers' operations only cost
    conversions there, and torch's bf16 attention on such a CPU takes 3-5x its float32 time
    (docs/results.md, "CPUs without bfloat16 instructions"). A target keeps its model's dtype: its
    numbers are the model's in that dtype."""
    if invariant or dtype != torch.bfloat16 or device.type != "cpu" or kernel() is None:
        return dtype
    return torch.float32


def pack(w: torch.Tensor) -> torch.Tensor:
    """w [N, K] bf16 in cpu_gemm.c's layout: panels of PANEL columns (zeros past N), for each k
    columns j and 8 + j side by side: [panels, K, 8, 2]."""
    n, k = w.shape
    count = -(-n // PANEL)
    padded = F.pad(w, (0, 0, 0, count * PANEL - n))
    return padded.view(count, 2, PANEL // 2, k).permute(0, 3, 2, 1).contiguous()


def unpack(panels: torch.Tensor, n: int) -> torch.Tensor:
    """The [n, K] weight `pack` was given."""
    return panels.permute(0, 3, 2, 1).reshape(-1, panels.shape[1])[:n].contiguous()


def _run(x: torch.Tensor, k: int, n: int, bias: torch.Tensor | None, call) -> torch.Tensor:
    """x [..., k] in float32 rows, an output [rows, n] and the bias in float32, handed to
    `call(x, bias, out, rows)` (pointers; bias 0 for none); the result [..., n] in x's dtype."""
    flat = x.reshape(-1, k).float().contiguous()
    b = None if bias is None else bias.float().contiguous()
    out = torch.empty(flat.shape[0], n, dtype=torch.float32)
    call(flat.data_ptr(), 0 if b is None else b.data_ptr(), out.data_ptr(), flat.shape[0])
    return out.to(x.dtype).view(*x.shape[:-1], n)


def linear_packed(
    x: torch.Tensor, panels: torch.Tensor, n: int, bias: torch.Tensor | None = None, lib: ctypes.CDLL | None = None
) -> torch.Tensor:
    """F.linear(x, w, bias) for a bf16 `w` [n, K] packed by `pack`; the result in x's dtype. `lib`:
    a particular build (tests), else `kernel()`."""
    k, fn = panels.shape[1], (lib or kernel()).bf16_linear
    return _run(x, k, n, bias, lambda xp, bp, yp, rows: fn(xp, panels.data_ptr(), bp, yp, rows, n, k))


def pack_int8(q: torch.Tensor) -> torch.Tensor:
    """int8 weights q [N, K] in cpu_gemm.c's layout: panels of PANEL columns (zeros past N), for
    each k the 16 columns in order: [panels, K, 16]."""
    n, k = q.shape
    count = -(-n // PANEL)
    return F.pad(q, (0, 0, 0, count * PANEL - n)).view(count, PANEL, k).transpose(1, 2).contiguous()


def linear_int8(
    x: torch.Tensor,
    panels: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    lib: ctypes.CDLL | None = None,
) -> torch.Tensor:
    """(x q^T) scale + bias for int8 q [n, K] packed by `pack_int8`, `scale` [n]; in x's dtype.
    `lib`: a particular build (tests), else `kernel()`."""
    k, n, fn = panels.shape[1], scale.shape[0], (lib or kernel()).int8_linear
    s = scale.float().contiguous()
    return _run(x, k, n, bias, lambda xp, bp, yp, rows: fn(xp, panels.data_ptr(), s.data_ptr(), bp, yp, rows, n, k))


def linear(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, lib: ctypes.CDLL | None = None
) -> torch.Tensor:
    """F.linear(x, w, bias) for a plain bf16 `w` [N, K], packed for this call (the runner packs its
    weights once: specdec/core/packed.py)."""
    return linear_packed(x, pack(w), w.shape[0], bias, lib)
