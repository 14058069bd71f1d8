"""What the capacity simulator runs on: the event loop on simulated time and the processor-sharing
devices that simulated workers compute on."""

from __future__ import annotations

import asyncio
import time

import pytest

from cluster.planning.devices import Call, Device, Worker
from cluster.planning.virtual_loop import SimulationStalled, VirtualClockLoop


def test_calls_on_one_device_share_it_and_each_workers_telemetry_reads_its_own_calls():
    """Processor sharing: a colocated drafter's call slows the target's while both run (not FIFO
    behind it), a worker still runs its own calls one at a time, and its busy clock counts the
    time its calls ran, stretched, per telemetry period."""
    loop = VirtualClockLoop()
    dev = Device(loop)
    target, draft = Worker(dev), Worker(dev)
    verify, propose = target.submit(Call(3.0)), draft.submit(Call(1.0))
    queued = target.submit(Call(1.0))  # behind the first on the target's own worker

    async def until_done():
        while not queued.done:
            await asyncio.sleep(0.5)

    loop.run_until_complete(until_done())
    loop.close()
    # both run from 0 at half speed: the draft's 1 s ends at 2; the verify's last 2 s alone end at 4
    assert (propose.end, verify.end, queued.start, queued.end) == (2.0, 4.0, 4.0, 5.0)
    assert [round(target.busy_in(t, t + 1), 6) for t in range(5)] == [1.0] * 5
    assert [round(draft.busy_in(t, t + 1), 6) for t in range(3)] == [1.0, 1.0, 0.0]
    assert target.busy == pytest.approx(5.0) and draft.busy == pytest.approx(2.0)


def test_the_virtual_clock_jumps_to_the_next_timer_and_a_stalled_simulation_raises():
    """The loop's clock is simulated time: a 100 s sleep and a 10 s timeout take no wall time, and a
    coroutine waiting for something nothing will ever complete ends the run with an error instead
    of hanging it."""
    loop = VirtualClockLoop()

    async def sleeps() -> float:
        await asyncio.sleep(100.0)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(asyncio.sleep(50.0), 10.0)
        return asyncio.get_running_loop().time()

    wall = time.perf_counter()
    assert loop.run_until_complete(sleeps()) == pytest.approx(110.0)
    assert time.perf_counter() - wall < 110.0  # the real sleeps could not have returned sooner

    async def stuck() -> None:
        await asyncio.get_running_loop().create_future()

    with pytest.raises(SimulationStalled):
        loop.run_until_complete(stuck())
    loop.close()
