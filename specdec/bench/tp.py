"""`specdec bench runner --tp N`: the runner at TP 1 beside TP N, same total threads, in one run.

This process runs the TP 1 runner with every thread, and is rank 0 of a local group of N ranks
(the others are child processes, specdec.core.tp_group.LocalGroup) with the threads split between
them. Blocks of TP 1 and TP N steps alternate, so a change in the machine's load hits both. Each
lm_head mode (split by vocabulary with a gather, or replicated) gets its own group. Rank 0 times
its all-reduces and its gather: their share of the step is what tensor parallelism costs on top
of the split matmuls (waiting for a slower rank counts in it too).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from specdec.core.models import load_model
from specdec.core.runner import ModelRunner
from specdec.core.tp import LM_HEAD_MODES
from specdec.core.tp_group import GroupSpec, LocalGroup

CASES = (("decode b=1", 1, 1), ("decode b=8", 8, 1), ("verify 5 tokens b=1", 1, 5))

__all__ = ["bench_tp", "format_tp_table"]


class _Timed:
    """Wraps a runner hook and adds up the seconds spent in it."""

    def __init__(self, fn: Callable):
        self.fn, self.seconds = fn, 0.0

    def __call__(self, x):
        t0 = time.perf_counter()
        try:
            return self.fn(x)
        finally:
            self.seconds += time.perf_counter() - t0


@dataclass
class _Case:
    runner: object  # ModelRunner or LeaderRunner
    slots: list[int]
    context: int
    feeds: list[list[int]]

    @classmethod
    def open(cls, runner, batch: int, context: list[int], new: int) -> _Case:
        slots = [runner.alloc_slot() for _ in range(batch)]
        runner.forward(slots, [context] * batch, num_logits=0)
        return cls(runner, slots, len(context), [[7] * new] * batch)

    def step(self) -> float:
        t0 = time.perf_counter()
        self.runner.forward(self.slots, self.feeds, num_logits=len(self.feeds[0]))
        dt = time.perf_counter() - t0
        for s in self.slots:
            self.runner.rollback(s, self.context)
        return dt

    def close(self) -> None:
        for s in self.slots:
            self.runner.free_slot(s)


def _block(case: _Case, threads: int, n: int, hooks: list[_Timed]) -> tuple[list[float], list[float]]:
    """`n` timed steps after one warm-up: (step seconds, hook seconds) per step."""
    torch.set_num_threads(threads)
    case.step()
    steps, comm = [], []
    for _ in range(n):
        before = sum(h.seconds for h in hooks)
        steps.append(case.step())
        comm.append(sum(h.seconds for h in hooks) - before)
    return steps, comm


def bench_tp(
    model_spec: str,
    tp: int,
    dtype: str = "bfloat16",
    context_len: int = 128,
    repeat: int = 10,
    threads: int | None = None,
    lm_heads: tuple[str, ...] = LM_HEAD_MODES,
    progress: Callable[[str], None] = lambda _: None,
) -> dict:
    total = threads or os.cpu_count() or 1
    per_rank = max(1, total // tp)
    loaded = load_model(model_spec, dtype=dtype)
    max_len = context_len + 8
    single = ModelRunner(loaded.model, num_slots=8, max_len=max_len)
    context = list(range(100, 100 + context_len))
    half = max(1, repeat // 2)
    modes = []
    for mode in lm_heads:
        progress(f"starting {tp} ranks (lm_head {mode})")
        spec = GroupSpec(model_spec, tp, dtype=dtype, num_slots=8, max_len=max_len, lm_head=mode)
        with LocalGroup(spec, threads=per_rank) as group:
            torch.set_num_threads(per_rank)
            leader = group.start(ModelRunner(loaded.model, num_slots=8, max_len=max_len))
            hooks = [_Timed(leader.runner.all_reduce)]
            leader.runner.all_reduce = hooks[0]
            if leader.runner.gather_logits is not None:
                hooks.append(_Timed(leader.runner.gather_logits))
                leader.runner.gather_logits = hooks[1]
            cases = []
            for name, batch, new in CASES:
                progress(f"{name} (lm_head {mode})")
                one, many = _Case.open(single, batch, context, new), _Case.open(leader, batch, context, new)
                t1, tn, comm = [], [], []
                for _ in range(2):  # ABAB: both see the same load
                    t1 += _block(one, total, half, [])[0]
                    steps, c = _block(many, per_rank, half, hooks)
                    tn += steps
                    comm += c
                one.close()
                many.close()
                tp1, tpn = statistics.median(t1) * 1e3, statistics.median(tn) * 1e3
                share = statistics.median(c / s for c, s in zip(comm, tn))
                cases.append(
                    {
                        "name": name,
                        "tp1_ms": round(tp1, 2),
                        "tpn_ms": round(tpn, 2),
                        "ratio": round(tpn / tp1, 3),
                        "comm_ms": round(statistics.median(comm) * 1e3, 2),
                        "comm_share": round(share, 3),
                    }
                )
        modes.append({"lm_head": mode, "cases": cases})
    torch.set_num_threads(total)
    best = min(modes, key=lambda m: sum(c["tpn_ms"] for c in m["cases"]))["lm_head"]
    return {
        "model": model_spec,
        "dtype": dtype,
        "tp": tp,
        "context_len": context_len,
        "repeat": 2 * half,
        "threads_total": total,
        "threads_per_rank": per_rank,
        "load_avg": [round(x, 2) for x in os.getloadavg()],
        "modes": modes,
        "faster_lm_head": best,
    }


def format_tp_table(result: dict) -> str:
    tp = result["tp"]
    lines = [
        f"{result['model']} ({result['dtype']}, context {result['context_len']}, TP 1 x {result['threads_total']} "
        f"threads vs TP {tp} x {result['threads_per_rank']}, median of {result['repeat']}, "
        f"load avg {result['load_avg']})",
        f"{'lm_head':<11}{'case':<22}{'TP1 ms':>9}{f'TP{tp} ms':>9}{'ratio':>8}{'comm ms':>9}{'comm share':>12}",
    ]
    for m in result["modes"]:
        for c in m["cases"]:
            lines.append(
                f"{m['lm_head']:<11}{c['name']:<22}{c['tp1_ms']:>9.1f}{c['tpn_ms']:>9.1f}{c['ratio']:>7.2f}x"
                f"{c['comm_ms']:>9.1f}{c['comm_share']:>11.0%}"
            )
    lines.append(f"faster lm_head: {result['faster_lm_head']}")
    return "\n".join(lines)
