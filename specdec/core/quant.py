"""Weight-only int8 for draft models: half the bytes a memory-bound decode step has to read.

Only drafters use it: a draft's numbers may change (verification keeps the output lossless), the
target's never do. Per-output-channel symmetric scales; the matmul is torch's fused
int8-weight kernel (`aten._weight_int8pack_mm`), the one gpt-fast uses, or on a CPU without bf16
instructions the compiled loop over int8 panels (specdec/core/cpu_gemm.c), where torch's kernel
read the weights at about half the memory's speed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specdec.core import cpu_gemm
from specdec.core.packed import PackedWeight, pack, packed_linear

# The int8 kernel pays off for decode-sized inputs only; a prefill (many rows) is faster on the
# dense weights, which the transformers model keeps anyway (packed for the CPU's GEMM as the
# target's are, `pack_weight`).
INT8_MAX_ROWS = 8


@dataclass
class Int8Weight:
    q: torch.Tensor  # [out, in] int8
    scale: torch.Tensor  # [out], in the activation dtype
    dense: torch.Tensor | PackedWeight  # the original weights, for inputs of many rows
    panels: torch.Tensor | None = None  # q for the compiled loop (cpu_gemm.c), where it runs

    @property
    def shape(self) -> torch.Size:
        return self.q.shape


Weight = torch.Tensor | Int8Weight | PackedWeight  # a weight matrix as the runner holds it


def quantize_int8(w: torch.Tensor) -> Int8Weight:
    scale = w.float().abs().amax(dim=1).clamp_min(1e-8) / 127.0
    q = torch.round(w.float() / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return Int8Weight(q.contiguous(), scale.to(w.dtype), w)


def linear(
    x: torch.Tensor, w: torch.Tensor | Int8Weight | PackedWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    if isinstance(w, torch.Tensor):
        return cpu_gemm.linear(x, w, bias) if cpu_gemm.takes(w) else F.linear(x, w, bias)
    if isinstance(w, PackedWeight):
        return packed_linear(x, w, bias)
    flat = x.reshape(-1, x.shape[-1])
    if flat.shape[0] > INT8_MAX_ROWS:
        return linear(x, w.dense, bias)
    if w.panels is not None:
        return cpu_gemm.linear_int8(x, w.panels, w.scale, bias)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    out = torch.ops.aten._weight_int8pack_mm(flat, w.q, w.scale).view(*x.shape[:-1], w.q.shape[0])
    return out if bias is None else out + bias


def pack_weight(w: torch.Tensor | Int8Weight | PackedWeight) -> Int8Weight | PackedWeight:
    """`w` laid out for the CPU's GEMMs (specdec/core/packed.py). An int8 weight: its dense copy too
    (it serves the inputs of many rows, a draft prefill), and q in the compiled loop's panels where
    the CPU has no bf16 instructions (torch's int8 kernel read a draft's weights at about half the
    memory's speed there: docs/results.md, "CPUs without bfloat16 instructions")."""
    if isinstance(w, torch.Tensor):
        return pack(w)
    if isinstance(w, Int8Weight) and isinstance(w.dense, torch.Tensor):
        panels = cpu_gemm.pack_int8(w.q) if cpu_gemm.takes(w.dense) else None
        return dataclasses.replace(w, dense=pack(w.dense), panels=panels)
    return w


def int8_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """The fused kernel pays on the CPU for bf16 activations; with float32 it is slower than dense,
    so keep dense there (docs/results.md, "Small costs behind rules in the code")."""
    return device.type == "cpu" and dtype == torch.bfloat16
