"""CPU weights laid out once for oneDNN's GEMM, as vLLM's CPU backend and inductor's freezing do.

`F.linear` on a plain [out, in] weight makes oneDNN (bf16) or MKL (float32) read it in a layout
not made for the call; reordering each weight once at load time into oneDNN's own blocked layout
makes the memory-bound decode and verify GEMMs 25-35 % faster in bf16 and 1.5-3x faster in float32
on the EPYC machine (docs/results.md, "The CPU engine"). A packed weight rounds a row one way at
M = 1 and one other way at every M >= 2, as the plain bf16 GEMM does, so the invariant forward's
padding rule still holds; `attention.padding_rule_holds` checks that on every machine at load time
with packed weights, as the forward uses them. On a CPU without bf16 instructions, where oneDNN has
no bf16 GEMM, bf16 weights are packed instead in the panels of the compiled loop
(specdec/core/cpu_gemm.c), which gives a row the same bits in any GEMM.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specdec.core import cpu_gemm

# oneDNN's packed GEMM is fastest at 4-5 rows on the EPYC machine (AVX-512 bf16): with fewer it
# picks slower kernels, e.g. Qwen2.5-1.5B's down projection 0.95 ms at 1 row and 1.24 ms at 2 against
# 0.77 ms at 4 (docs/results.md, "The CPU engine"). A decode step's few rows are padded to this
# many with zeros: the same numbers as any M >= 2 (the padding rule, checked at load time).
MIN_ROWS = 4


@dataclass
class PackedWeight:
    packed: torch.Tensor  # oneDNN's opaque layout, or cpu_gemm's panels: only `packed_linear` reads it
    source: torch.Tensor  # the plain [out, in] weight, for whatever reshapes weights (tp.py)
    panels: bool = False  # laid out for cpu_gemm.c (a CPU without bf16 instructions), not oneDNN

    @property
    def shape(self) -> torch.Size:
        return self.source.shape

    @property
    def nbytes(self) -> int:
        """The bytes a GEMM reads (the packed copy holds as many as the plain weight)."""
        return self.source.nbytes


def packing_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN packs CPU weights in float32 always, in bf16 where the CPU has bf16 instructions;
    elsewhere bf16 weights are packed for the compiled loop (cpu_gemm.c) where it is built."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and (torch.ops.mkldnn._is_mkldnn_bf16_supported() or cpu_gemm.kernel() is not None)


def pack(w: torch.Tensor) -> PackedWeight:
    if cpu_gemm.takes(w):
        return PackedWeight(cpu_gemm.pack(w), w, panels=True)
    # No batch-size hint: one layout for every M (measured no slower at M = 1-8 than a hint).
    return PackedWeight(torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), None), w)


def packed_linear(x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    if w.panels:
        return cpu_gemm.linear_packed(x, w.packed, w.shape[0], bias)
    flat = x.reshape(-1, x.shape[-1])
    rows = flat.shape[0]
    if rows < MIN_ROWS:
        flat = F.pad(flat, (0, 0, 0, MIN_ROWS - rows))
    elif not flat.is_contiguous():
        flat = flat.contiguous()
    out = torch.ops.mkldnn._linear_pointwise(flat, w.packed, bias, "none", [], "")
    return out[:rows].view(*x.shape[:-1], w.shape[0])
