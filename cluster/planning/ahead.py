"""Calls of one pure function run ahead of a sequential search, in forked processes.

A search that asks for results one at a time, each choice depending on the last, can still say
which arguments it will likely ask for next. :class:`Ahead` starts those in ``jobs`` worker
processes (forked: they share the caller's state, nothing is pickled but the argument and the
result) and hands each result over when the search asks for it. The function must be pure, so the
search reads the same results in the same order as with one process; an argument started ahead
that the search never asks for is only wasted work. ``specdec plan`` runs its simulations so.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Hashable
from concurrent.futures import Future, ProcessPoolExecutor
from typing import Any

__all__ = ["Ahead"]

_FN: Callable[[Any], Any] | None = None  # what a forked worker process calls


def _call_forked(arg: Any) -> Any:
    assert _FN is not None
    return _FN(arg)


class Ahead:
    def __init__(self, fn: Callable[[Any], Any], jobs: int):
        global _FN
        self.fn, self.jobs = fn, jobs
        self.pool: ProcessPoolExecutor | None = None
        if jobs > 1:
            _FN = fn
            self.pool = ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("fork"))
        self.started: dict[Hashable, Future] = {}

    def ahead(self, args: list[Hashable]) -> None:
        """Start these, most likely needed first, while fewer than ``jobs`` calls run."""
        if self.pool is None:
            return
        running = sum(not f.done() for f in self.started.values())
        for arg in args:
            if running >= self.jobs:
                return
            if arg not in self.started:
                self.started[arg] = self.pool.submit(_call_forked, arg)
                running += 1

    def result(self, arg: Hashable) -> Any:
        if self.pool is None:
            return self.fn(arg)
        if arg not in self.started:
            self.started[arg] = self.pool.submit(_call_forked, arg)
        return self.started.pop(arg).result()

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
