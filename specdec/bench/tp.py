"""`specdec bench runner --tp N`: the runner at TP 1 beside TP N, same total threads, in one run.

This process runs the TP 1 runner with every thread, and is rank 0 of a local group of N ranks
(the others are child processes, specdec.core.tp_group.LocalGroup) with the threads split between
them. Blocks of TP 1 and TP N steps alternate, so a change in the machine's load hits both. Each
lm_head mode (split by vocabulary with a gather, or replicated) gets its own group. Rank 0 times
its all-reduces and its gather: their share of the step is what tensor parallelism costs on top
of the split matmuls (waiting for a slower rank counts in it too). CPU seconds per step (rank 0's,
and the other ranks' from /proc) are reported beside the wall times: on a shared machine a
descheduled rank inflates the wall time and the all-reduce wait, but not the work.
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
    """Wraps a runner hook and adds up the seconds (wall, and this thread's CPU) spent in it."""

    def __init__(self, fn: Callable):
        self.fn, self.seconds, self.cpu = fn, 0.0, 0.0

    def __call__(self, x):
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            return self.fn(x)
        finally:
            self.seconds += time.perf_counter() - t0
            self.cpu += time.thread_time() - c0


def _cpu_seconds(pids: list[int]) -> float:
    """CPU seconds used so far by the processes `pids` (Linux /proc; 0 where it cannot be read)."""
    total = 0.0
    for pid in pids:
        try:
            fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, IndexError):
            pass
    return total


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


@dataclass
class _Block:
    steps: list[float]  # wall seconds per step
    comm: list[float]  # wall seconds in the all-reduces and the gather, per step
    cpu: float  # rank 0's CPU seconds per step
    others_cpu: float  # the other ranks' CPU seconds per step, together
    comm_cpu: float  # rank 0's CPU seconds in the all-reduces and the gather, per step


def _block(case: _Case, threads: int, n: int, hooks: list[_Timed], pids: list[int]) -> _Block:
    """`n` timed steps after one warm-up. The CPU figures do not count time a rank spent
    descheduled, so on a loaded machine they still say how much work a step is."""
    torch.set_num_threads(threads)
    case.step()
    steps, comm = [], []
    cpu0, others0, comm_cpu0 = time.process_time(), _cpu_seconds(pids), sum(h.cpu for h in hooks)
    for _ in range(n):
        before = sum(h.seconds for h in hooks)
        steps.append(case.step())
        comm.append(sum(h.seconds for h in hooks) - before)
    cpu, others = (time.process_time() - cpu0) / n, (_cpu_seconds(pids) - others0) / n
    return _Block(steps, comm, cpu, others, (sum(h.cpu for h in hooks) - comm_cpu0) / n)


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
                pids = [p.pid for p in group.procs]
                ones, manys = [], []
                for _ in range(2):  # ABAB: both see the same load
                    ones.append(_block(one, total, half, [], []))
                    manys.append(_block(many, per_rank, half, hooks, pids))
                one.close()
                many.close()
                t1 = [s for b in ones for s in b.steps]
                tn = [s for b in manys for s in b.steps]
                comm = [c for b in manys for c in b.comm]
                tp1, tpn = statistics.median(t1) * 1e3, statistics.median(tn) * 1e3
                cpu1 = statistics.mean(b.cpu for b in ones) * 1e3
                cpun = statistics.mean(b.cpu for b in manys) * 1e3
                others = statistics.mean(b.others_cpu for b in manys) * 1e3 / max(1, tp - 1)
                comm_cpu = statistics.mean(b.comm_cpu for b in manys) * 1e3
                cases.append(
                    {
                        "name": name,
                        "tp1_ms": round(tp1, 2),
                        "tpn_ms": round(tpn, 2),
                        "ratio": round(tpn / tp1, 3),
                        "comm_ms": round(statistics.median(comm) * 1e3, 2),
                        "comm_share": round(statistics.median(c / s for c, s in zip(comm, tn)), 3),
                        "tp1_cpu_ms": round(cpu1, 2),
                        "tpn_cpu_ms": round(cpun, 2),  # rank 0
                        "tpn_other_cpu_ms": round(others, 2),  # each other rank, on average
                        "comm_cpu_ms": round(comm_cpu, 2),  # rank 0
                    }
                )
        modes.append({"lm_head": mode, "cases": cases})
    torch.set_num_threads(total)
    best = min(modes, key=lambda m: sum(c["tpn_ms"] for c in m["cases"]))["lm_head"]  # wall time decides
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
        f"{'':<33}{'wall':-^43}  {'CPU per rank':-^33}",
        f"{'lm_head':<11}{'case':<22}{'TP1 ms':>9}{f'TP{tp} ms':>9}{'ratio':>8}{'comm ms':>9}{'share':>8}"
        f"  {'TP1 ms':>8}{'rank 0':>8}{'others':>8}{'comm':>8}",
    ]
    for m in result["modes"]:
        for c in m["cases"]:
            lines.append(
                f"{m['lm_head']:<11}{c['name']:<22}{c['tp1_ms']:>9.1f}{c['tpn_ms']:>9.1f}{c['ratio']:>7.2f}x"
                f"{c['comm_ms']:>9.1f}{c['comm_share']:>8.0%}  {c['tp1_cpu_ms']:>8.1f}{c['tpn_cpu_ms']:>8.1f}"
                f"{c['tpn_other_cpu_ms']:>8.1f}{c['comm_cpu_ms']:>8.1f}"
            )
    lines.append(f"faster lm_head: {result['faster_lm_head']}")
    return "\n".join(lines)
