"""An asyncio event loop on simulated time, for the capacity simulator.

The simulator runs the router's own coroutines (scheduler lanes, drafting, the rebalancer) over
simulated workers. On this loop ``time()`` is a number that stands still while callbacks run and
jumps to the next timer when nothing is ready, so ``asyncio.sleep``, ``wait_for`` timeouts and
every timestamp the router takes (router/clock.py reads the running loop's clock) are simulated
seconds, and a run takes as long as its callbacks' Python, not as long as the workload.

There is no I/O: the loop's selector never waits. A loop with nothing ready and no timer left is
deadlocked (a simulated call that never completes) and raises :class:`SimulationStalled` instead
of blocking forever.
"""

from __future__ import annotations

import asyncio
import selectors

__all__ = ["SimulationStalled", "VirtualClockLoop"]


class SimulationStalled(RuntimeError):
    """Nothing is ready and no timer is due: the simulation cannot make progress."""


class _JumpSelector(selectors.BaseSelector):
    """A selector without file objects whose ``select(timeout)`` advances the loop's clock instead
    of waiting."""

    def __init__(self, loop: VirtualClockLoop):
        self._loop = loop
        self._map: dict = {}

    def register(self, fileobj, events, data=None):  # noqa: ANN001 - the selectors API
        raise NotImplementedError("the virtual-clock loop does no I/O")

    def unregister(self, fileobj):  # noqa: ANN001
        raise KeyError(fileobj)

    def select(self, timeout: float | None = None) -> list:
        if timeout is None:
            raise SimulationStalled("no callback is ready and no timer is scheduled")
        if timeout > 0:
            self._loop.advance(timeout)
        return []

    def get_map(self) -> dict:
        return self._map


class VirtualClockLoop(asyncio.BaseEventLoop):
    """``loop.time()`` starts at 0 and moves only when the loop would otherwise wait."""

    def __init__(self) -> None:
        super().__init__()
        self._now = 0.0
        self._selector = _JumpSelector(self)

    def time(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        self._now += seconds

    def _process_events(self, event_list: list) -> None:
        pass

    def _write_to_self(self) -> None:
        pass  # call_soon_threadsafe: nothing to wake, the loop never blocks

    def close(self) -> None:
        if not self.is_running():
            super().close()
