"""Weights that meet the same input multiplied as one: q, k and v; gate and up.

On a CPU a decode step of a small model costs as much in calls as in weights: a 0.5B draft's step
took 62 ms, of which 29 in the GEMM loop and 9 in its 169 calls' own work around it (converting,
allocating, dispatching: 54 us each), docs/results.md, "CPUs without bfloat16 instructions". One GEMM
over the concatenated weights makes a layer 4 calls instead of 7.

Only where the compiled loop runs (specdec/core/cpu_gemm.c): an output there is a fold over its own
weight row, so a column of the joint GEMM has the bits of the same column in its own GEMM, and the
invariant forward's numbers do not change (tests/unit/test_fused.py). oneDNN's and torch's int8
kernels may block by the GEMM's width, so elsewhere the weights stay apart.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdec.core import cpu_gemm
from specdec.core.packed import PackedWeight
from specdec.core.quant import Int8Weight, Weight


def fuse(parts: Sequence[Weight], biases: Sequence[torch.Tensor | None]) -> tuple[Weight, torch.Tensor | None] | None:
    """`parts` [n_i, K] as one weight [sum n_i, K] packed for the loop, and their biases as one
    (float32, as the loop takes them); None where the loop does not take them, or only some parts
    have a bias. The parts themselves are left as they are (their plain tensors are the model's own)."""
    if len({b is None for b in biases}) > 1:
        return None
    if all(isinstance(p, torch.Tensor) and cpu_gemm.takes(p) for p in parts):
        return _panels(torch.cat(list(parts))), _bias(biases)
    if all(isinstance(p, Int8Weight) and isinstance(p.dense, torch.Tensor) and cpu_gemm.takes(p.dense) for p in parts):
        q = torch.cat([p.q for p in parts])
        joint = Int8Weight(
            _shape_of(q),
            torch.cat([p.scale for p in parts]).float(),  # what the loop converts the scales to per call
            _panels(torch.cat([p.dense for p in parts])),
            cpu_gemm.pack_int8(q),
        )
        return joint, _bias(biases)
    return None


def _panels(w: torch.Tensor) -> PackedWeight:
    return PackedWeight(cpu_gemm.pack(w), _shape_of(w), panels=True)


def _shape_of(w: torch.Tensor) -> torch.Tensor:
    """A tensor of w's shape and dtype holding no memory: the joint weight's plain form is needed by
    nothing (tensor parallelism reshards the parts and packs them again)."""
    return torch.empty(w.shape, dtype=w.dtype, device="meta")


def _bias(biases: Sequence[torch.Tensor | None]) -> torch.Tensor | None:
    return None if biases[0] is None else torch.cat([b.float() for b in biases])
