"""A decoder layer's operations between its GEMMs: the RMS norm, the rotary embedding and SwiGLU's
activation, each as the invariant forward needs it (docs/design.md, invariant 2).

On a CPU where specdec/core/cpu_rows.c is built, the norm and the rotary embedding are one compiled
call each (at a decode step's few rows torch's 6-10 small ops for each cost far more than their
arithmetic); elsewhere, and for float32 weights, torch's ops.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specdec.core import cpu_rows
from specdec.core.attention import invariant_dtype

__all__ = ["rms_norm", "rotary", "rotate_half", "silu"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, invariant: bool) -> torch.Tensor:
    """HF's RMSNorm over x [rows, hidden]: normalise in float32 (the invariant forward: in
    attention.invariant_dtype), cast back, then scale. On a CPU, one compiled call of the same
    steps, which sums the squares in its own fixed order (cpu_rows.c)."""
    if weight.dtype == torch.bfloat16 and cpu_rows.supports(x):
        return cpu_rows.rms_norm(x, weight, eps)
    h = x.to(invariant_dtype(x.device)) if invariant else x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [rows, heads, dim] rotated by cos, sin [rows, 1, dim]: in place by one compiled call on a CPU
    (cpu_rows.c, torch's bits), else torch's ops."""
    if cpu_rows.supports(x):
        return cpu_rows.rotary_(x, cos, sin)
    return x * cos + rotate_half(x) * sin


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def silu(x: torch.Tensor, invariant: bool) -> torch.Tensor:
    """SiLU; in the invariant forward in float32 from exp and division: F.silu computes the elements
    a vector loop leaves over (which depend on the tensor's size) with a different exp than the rest."""
    if not invariant:
        return F.silu(x)
    h = x.float()
    return (h / (1 + torch.exp(-h))).to(x.dtype)
