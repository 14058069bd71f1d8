"""The workers' free KV slots as the router's gauge ``specdec_worker_free_slots``: each worker's
own Info, every ``PERIOD_S`` seconds while it is up. What `specdec bench serve --workload soak`
watches for slots that are never given back."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

import grpc

from router.metrics import Metrics
from router.workers import WorkerClient, WorkerUnavailable
from specdec.rpc import worker_pb2

log = logging.getLogger(__name__)

__all__ = ["PERIOD_S", "poll_free_slots"]

PERIOD_S = 5.0


async def poll_free_slots(
    workers: Callable[[], Sequence[WorkerClient]], metrics: Metrics, period_s: float = PERIOD_S
) -> None:
    """Run until cancelled."""
    while True:
        for w in workers():
            if not w.up:
                continue
            try:
                info = await w.call("Info", worker_pb2.InfoRequest(), timeout=5.0)
            except (WorkerUnavailable, grpc.aio.AioRpcError) as exc:
                log.debug("%s worker %s: Info failed: %s", w.role, w.name, exc)
                continue
            metrics.worker_free_slots.labels(w.role, w.name).set(info.free_slots)
        await asyncio.sleep(period_s)
