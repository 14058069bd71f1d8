"""Simulated devices and worker processes: what a call's compute costs in time when it shares a
device.

A :class:`Device` is processor sharing: the calls running on it (one per worker at most: a worker
runs one batch RPC at a time) split its speed equally. A draft worker on its target's device (a
colocated deployment, e.g. one CPU machine) then slows the target while both compute, as two
processes on the same cores do, and the target's telemetry reads busy for as long as its call
runs. A :class:`Worker` runs its calls one at a time, in the order they were sent.

Time is the event loop's: on the simulator's :class:`~cluster.planning.virtual_loop.VirtualClockLoop`
a completion is a timer at the simulated instant the call's work runs out.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable

__all__ = ["Call", "Device", "Worker"]


class Call:
    """One RPC's compute: ``work`` seconds at its device's full speed. ``start`` / ``end``: when it
    began and stopped running on the device (None until then)."""

    def __init__(self, work: float):
        self.work = work
        self.left = work  # as of its device's last update
        self.start: float | None = None
        self.end: float | None = None
        self._then: list[Callable[[], None]] = []

    @property
    def done(self) -> bool:
        return self.end is not None

    @property
    def ran_s(self) -> float:
        """Seconds it ran on its device (stretched while it shared it)."""
        assert self.start is not None and self.end is not None
        return self.end - self.start

    def on_done(self, fn: Callable[[], None]) -> None:
        if self.done:
            fn()
        else:
            self._then.append(fn)

    def _finish(self, now: float) -> None:
        self.left, self.end = 0.0, now
        then, self._then = self._then, []
        for fn in then:
            fn()


class Device:
    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.running: list[Call] = []
        self._t = loop.time()
        self._timer: asyncio.TimerHandle | None = None

    def _advance(self) -> None:
        """Bring the running calls' work left up to now."""
        now = self.loop.time()
        if self.running:
            done = (now - self._t) / len(self.running)
            for c in self.running:
                c.left -= done
        self._t = now

    def run(self, call: Call) -> None:
        self._advance()
        call.start = self.loop.time()
        self.running.append(call)
        self._plan()

    def _plan(self) -> None:
        """Schedule the next completion (the call with the least work left)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.running:
            c = min(self.running, key=lambda c: c.left)
            self._timer = self.loop.call_at(self._t + max(0.0, c.left) * len(self.running), self._end, c)

    def _end(self, c: Call) -> None:
        self._timer = None
        self._advance()
        self.running.remove(c)
        self._plan()
        c._finish(self.loop.time())


class Worker:
    """A worker process: one call at a time, in the order sent, each on its device. ``busy``:
    seconds its calls ran (stretched while they shared the device)."""

    def __init__(self, device: Device):
        self.device = device
        self.queue: deque[Call] = deque()
        self.current: Call | None = None
        self.busy = 0.0
        self._recent: list[Call] = []  # calls not yet past a telemetry window

    def submit(self, call: Call) -> Call:
        if call.work > 0:
            self._recent.append(call)
        self.queue.append(call)
        if self.current is None:
            self._next()
        return call

    def _next(self) -> None:
        if self.current is not None:
            self.busy += self.current.ran_s
        self.current = self.queue.popleft() if self.queue else None
        if self.current is not None:
            self.current.on_done(self._next)
            self.device.run(self.current)

    def busy_in(self, t0: float, t1: float) -> float:
        """Seconds its calls ran within [t0, t1] (its busy clock as telemetry reads it: compute while
        it runs, not while it queues); forgets calls that ended before t0."""
        self._recent = [c for c in self._recent if c.end is None or c.end > t0]
        return sum(
            max(0.0, min(t1 if c.end is None else c.end, t1) - max(c.start, t0))
            for c in self._recent
            if c.start is not None
        )
