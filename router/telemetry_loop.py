"""The rebalancer's clock: every ``rebalance.period_s`` it polls each worker's ``Info`` for device
telemetry, exports it to Prometheus, and re-plans each target's depth level (router/draft_depth.py,
through router/target_balance.py).

Telemetry is best effort: a poll that fails or times out is skipped (it never marks a worker down;
the data path does that), and a worker whose Info carries no telemetry has none. The per-round
decisions (draft assignment, speculation switch) are taken where the rounds run
(router/drafter_pool.py, router/target_balance.py); routing in router/server.py; pool sizes in
router/autoscaler.py, on the same period.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

import grpc

from router import clock
from router.config import RebalanceConfig
from router.metrics import Metrics
from router.workers import WorkerClient
from specdec.rpc.telemetry import sample_from_proto

log = logging.getLogger(__name__)

__all__ = ["TelemetryLoop"]


class TelemetryLoop:
    """``workers()`` lists the workers to poll now (targets and drafters: the pools may change);
    ``schedulers()`` the target schedulers whose depth to re-plan."""

    def __init__(
        self,
        workers: Callable[[], Sequence[WorkerClient]],
        schedulers: Callable[[], Sequence],
        config: RebalanceConfig,
        metrics: Metrics,
    ):
        self.workers = workers
        self.schedulers = schedulers
        self.cfg = config
        self.metrics = metrics
        self._task: asyncio.Task | None = None
        self._polls: dict[int, asyncio.Task] = {}

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="rebalancer")

    async def stop(self) -> None:
        tasks = [t for t in (self._task, *self._polls.values()) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            try:
                await self.tick()
            except Exception:  # noqa: BLE001 - the rebalancer must never take the router down
                log.exception("rebalancer tick failed")
            await asyncio.sleep(self.cfg.period_s)

    async def tick(self) -> None:
        """Poll telemetry (waiting at most one period), then re-plan every target's depth."""
        started = []
        for w in self.workers():
            prev = self._polls.get(id(w))
            if w.up and w.stub is not None and (prev is None or prev.done()):
                self._polls[id(w)] = task = asyncio.get_running_loop().create_task(self._poll(w))
                started.append(task)
        if started:
            await asyncio.wait(started, timeout=self.cfg.period_s)
        now = clock.now()
        for s in self.schedulers():
            s.balance.update_depth(now)

    async def _poll(self, w: WorkerClient) -> None:
        address = w.address
        try:
            info = await w.fetch_info(timeout=max(5.0, 2 * self.cfg.period_s))
        except (grpc.aio.AioRpcError, AttributeError) as exc:
            log.debug("telemetry poll of %s failed: %s", w.name, exc)
            return
        if w.address != address:  # a recovery moved it meanwhile: its own probe has the new process's Info
            return
        w.record_info(info, address)
        self.metrics.worker_free_slots.labels(w.role, w.name).set(info.free_slots)
        self.metrics.record_evicted(w.role, w.name, info.evicted)
        if info.HasField("telemetry"):
            w.telemetry = sample_from_proto(info.telemetry)
            self.metrics.record_device(w.name, w.role, w.telemetry)
        else:
            w.telemetry = None
