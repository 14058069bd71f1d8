"""The invariant attention on a CPU as one compiled loop (cpu_attention.c), built on first use.

torch's small CPU ops cost more than the arithmetic of a decode step's attention: the gathered
keys and values converted to float32, two batched GEMMs, a dozen elementwise passes. The C loop
reads the cache's bfloat16 rows directly, skips the keys a query does not see, and fixes its order of
arithmetic itself, so a row's result depends on nothing else in the forward by construction
(docs/design.md, invariant 2), with no padding rule to rely on.

Built and cached by specdec/core/cpu_build.py. Without a C compiler, or with
``SPECDEC_CPU_KERNELS=0``, `kernel` is None and the caller keeps torch's path; one process always
uses one of the two, so its outputs stay self-consistent.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from specdec.core.cpu_build import library

SOURCE = Path(__file__).with_name("cpu_attention.c")

__all__ = ["SOURCE", "attend", "declare", "kernel", "runs_on", "supports"]


def declare(lib: ctypes.CDLL) -> None:
    pointer, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.invariant_attention.restype = i32
    lib.invariant_attention.argtypes = [pointer] * 3 + [i32] + [pointer, i64, i64] * 2 + [pointer] * 2 + [i32] * 6


@functools.cache
def kernel() -> ctypes.CDLL | None:
    """The compiled library, or None: switched off, no compiler, or a build that failed (logged)."""
    return library(SOURCE, declare, "attention")


def runs_on(device: torch.device) -> bool:
    """Whether the C loop computes attention on this device: a CPU, where the library is built."""
    return device.type == "cpu" and kernel() is not None


def supports(q: torch.Tensor) -> bool:
    """Whether the C loop takes this call: CPU tensors, where the library is built."""
    return runs_on(q.device)


def attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    bias: torch.Tensor,
    scale: float,
    slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """`attention.invariant_attention`'s contract (q [B, H, T, D]; keys, values [B, Hkv, S, D], or
    with ``slots`` [B] the rows of keys and values that batch row b reads; bias [B, 1, 1, T, S]) by
    the C loop; returns [B, H, T, D] in q's dtype."""
    batch, heads, width, dim = q.shape
    kv_heads, span = keys.shape[1], bias.shape[-1]
    qf = (q.float() * scale).contiguous()
    if keys.dtype not in (torch.bfloat16, torch.float32) or values.dtype != keys.dtype:
        if slots is not None:  # the rows read, not the whole cache
            keys, values, slots = keys[slots, :, :span], values[slots, :, :span], None
        keys, values = keys.float(), values.float()  # float16 widened exactly
    bf16 = keys.dtype == torch.bfloat16
    if keys.stride(-1) != 1:
        keys = keys.contiguous()
    if values.stride(-1) != 1:
        values = values.contiguous()
    rows = torch.arange(batch) if slots is None else slots.cpu()
    krows = (rows * keys.stride(0)).contiguous()
    vrows = (rows * values.stride(0)).contiguous()
    mask = bias.reshape(batch, width, span).contiguous()
    out = torch.empty(batch, heads, width, dim, dtype=torch.float32)
    done = kernel().invariant_attention(
        qf.data_ptr(),
        keys.data_ptr(),
        values.data_ptr(),
        int(bf16),
        krows.data_ptr(),
        *keys.stride()[1:3],
        vrows.data_ptr(),
        *values.stride()[1:3],
        mask.data_ptr(),
        out.data_ptr(),
        batch,
        heads,
        kv_heads,
        width,
        span,
        dim,
    )
    if done != 0:
        raise MemoryError("the CPU attention kernel could not allocate its buffers")
    return out.to(q.dtype)
