"""Where the tokens of a ragged forward sit: every row's tokens packed one after another for the
weight GEMMs, and a [rows, width] layout (padded at each row's end) for the attention. The eager
forward plans one per call (specdec/core/runner.py); the static steps have fixed layouts instead."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from specdec.core.attention import attention_width, gemm_rows

if TYPE_CHECKING:
    from specdec.core.runner import ModelRunner


@dataclass
class RaggedBatch:
    """Where the tokens of a ragged forward sit: packed [n] for the GEMMs, [B, width] for attention."""

    slots: list[int]
    starts: list[int]
    lens: list[int]
    num_logits: list[int]
    offsets: list[int]  # first packed index of each row
    width: int  # query positions per row in the attention layout (>= the longest row)
    rows: int  # packed rows the GEMMs run over: the tokens, plus padding in invariant mode
    span: int  # keys the longest row attends over
    slot_t: torch.Tensor
    lens_t: torch.Tensor
    positions: torch.Tensor  # [B, width]
    index: torch.Tensor | None  # packed -> flat [B * width] index; None when the tokens fill the layout

    @property
    def tokens(self) -> int:
        return sum(self.lens)

    @classmethod
    def plan(
        cls,
        runner: ModelRunner,
        slots: Sequence[int],
        tokens: Sequence[Sequence[int]],
        n_logits: list[int],
        lens: list[int],
        starts: list[int],
        invariant: bool,
    ) -> RaggedBatch:
        batch = len(slots)
        dev = runner.device
        width, n = max(lens), sum(lens)
        if invariant:
            width = attention_width(width, runner.num_heads, runner.num_kv_heads, dev)
        lens_t = torch.tensor(lens, dtype=torch.long, device=dev)
        offsets = torch.arange(width, device=dev)
        valid = offsets[None, :] < lens_t[:, None]
        index = None if n == batch * width else valid.view(-1).nonzero().squeeze(1)
        return cls(
            slots=list(slots),
            starts=starts,
            lens=lens,
            num_logits=n_logits,
            offsets=[sum(lens[:b]) for b in range(batch)],
            width=width,
            rows=gemm_rows(n, runner.dtype) if invariant else n,
            span=max(s + k for s, k in zip(starts, lens)),
            slot_t=torch.tensor(slots, dtype=torch.long, device=dev),
            lens_t=lens_t,
            positions=torch.tensor(starts, dtype=torch.long, device=dev)[:, None] + offsets[None, :],
            index=index,
        )

    @property
    def query_positions(self) -> torch.Tensor:
        """`positions` with the padding past each row's end at -1: a query that sees no key, which
        the invariant attention skips (its output is never read)."""
        if self.index is None:
            return self.positions
        ends = self.positions[:, :1] + self.lens_t[:, None]
        return self.positions.masked_fill(self.positions >= ends, -1)

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """[B, width, ...] -> [n, ...]: the real tokens, row after row."""
        flat = x.reshape(len(self.slots) * self.width, *x.shape[2:])
        return flat if self.index is None else flat[self.index]

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """[n, ...] -> [B, width, ...], zeros at the padding."""
        if self.index is None:
            return x.view(len(self.slots), self.width, *x.shape[1:])
        out = x.new_zeros(len(self.slots) * self.width, *x.shape[1:])
        out[self.index] = x
        return out.view(len(self.slots), self.width, *x.shape[1:])
