"""Applies how big each pool is (router/pool_size.py): every ``rebalance.period_s`` it observes both
pools, and adds a replica through the actuator or drains one.

The actuator is the small interface the router gets from cluster/ (which places Ray actors and asks
Ray's autoscaler for nodes): the router never imports Ray. A launch is a background task bounded
by ``scaling.launch_timeout_s``: a node that never comes is logged and counted
(``launch_failed``), never waited on forever. Draining: the replica takes no new work; a target
finishes its requests (however long they take: cancelling one would lose it), a drafter its
in-flight Proposes, at most ``drain_timeout_s`` (its requests move to other drafters, which rebuild
their caches from the committed tokens: lossless); then it is removed and retired.
Every action is logged and counted in ``specdec_rebalance_actions_total{action}``; the replica
counts are the ``specdec_pool_replicas{pool,state}`` gauges.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Protocol

from router import clock
from router.pool_size import POOLS, PoolSizeConfig, ScaleState, draft_observation, plan_pool, target_observation
from router.workers import Endpoint

log = logging.getLogger(__name__)

__all__ = ["PoolActuator", "LaunchFailed", "Autoscaler"]


class LaunchFailed(RuntimeError):
    pass


class PoolActuator(Protocol):
    """What the router needs from the cluster to change a pool's size."""

    async def launch(self, pool: str, timeout: float) -> Endpoint:
        """A new replica of ``pool``, serving; LaunchFailed after ``timeout`` seconds."""
        ...

    async def retire(self, pool: str, name: str) -> None:
        """Stop replica ``name`` (already out of the router)."""
        ...


class Autoscaler:
    def __init__(self, router: Any, actuator: PoolActuator, config: PoolSizeConfig):
        """``router``: the :class:`router.server.Router` (not imported: it imports this module)."""
        self.router = router
        self.actuator = actuator
        self.cfg = config
        self.metrics = router.metrics
        self.state = {p: ScaleState() for p in POOLS}
        self.pending = {p: 0 for p in POOLS}
        self.draining: dict[str, tuple[str, float]] = {}  # replica name -> (pool, since)
        self.events: list[tuple[float, str, str]] = []  # (monotonic time, action, replica): for tests, bench
        self._tasks: set[asyncio.Task] = set()
        self._clock: asyncio.Task | None = None

    def start(self, period_s: float) -> None:
        self._clock = asyncio.get_running_loop().create_task(self._run(period_s), name="autoscaler")

    async def _run(self, period_s: float) -> None:
        while True:
            await asyncio.sleep(period_s)
            try:
                self.tick()
            except Exception:  # noqa: BLE001 - scaling must never take the router down
                log.exception("autoscaler tick failed")

    # ---- the clock ---------------------------------------------------------------------------
    def tick(self, now: float | None = None) -> None:
        now = clock.now() if now is None else now
        r = self.router
        self._finish_drains(now)
        targets = [s.balance.view() for s in r.schedulers]
        drafters = r.pool.views(now)
        drain_names = list(self.draining)
        obs = {
            "target": target_observation(targets, self.cfg, pending=self.pending["target"], draining=drain_names),
            "draft": draft_observation(
                targets, drafters, self.cfg, pending=self.pending["draft"], draining=drain_names
            ),
        }
        for pool, o in obs.items():
            self.state[pool], act = plan_pool(o, self.state[pool], now, self.cfg)
            if act is not None:
                self._record(act.action, act.victim or pool, act.reason)
                if act.action.startswith("scale_up"):
                    self._spawn(self._launch(pool))
                else:
                    self._drain(pool, act.victim, now)
            self._gauges(pool, o.serving)

    def _record(self, action: str, who: str, reason: str) -> None:
        self.metrics.rebalance_actions.labels(action).inc()
        self.events.append((clock.now(), action, who))
        log.info("%s: %s (%s)", action, who, reason)

    def _gauges(self, pool: str, serving: int) -> None:
        g = self.metrics.pool_replicas
        g.labels(pool, "serving").set(serving)
        g.labels(pool, "pending").set(self.pending[pool])
        g.labels(pool, "draining").set(sum(1 for p, _ in self.draining.values() if p == pool))

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ---- growing -----------------------------------------------------------------------------
    async def _launch(self, pool: str) -> None:
        self.pending[pool] += 1
        try:
            endpoint = await self.actuator.launch(pool, self.cfg.launch_timeout_s)
            if pool == "target":
                await self.router.add_target(endpoint, self.cfg.launch_timeout_s)
            else:
                await self.router.add_drafter(endpoint, self.cfg.launch_timeout_s)
            self._record(f"joined_{pool}", endpoint.name, "serving")
        except Exception as exc:  # noqa: BLE001 - a failed launch is an event, not a crash
            self._record("launch_failed", pool, str(exc))
        finally:
            self.pending[pool] -= 1

    # ---- shrinking ---------------------------------------------------------------------------
    def _drain(self, pool: str, name: str | None, now: float) -> None:
        if name is None:
            return
        self.draining[name] = (pool, now)
        if pool == "target":
            self.router.draining.add(name)
        else:
            self.router.pool.drain(name)

    def _finish_drains(self, now: float) -> None:
        for name, (pool, since) in list(self.draining.items()):
            busy = self.router.replica_busy(pool, name)
            if busy and (pool == "target" or now - since < self.cfg.drain_timeout_s):
                continue
            del self.draining[name]
            self._spawn(self._remove(pool, name, forced=busy))

    async def _remove(self, pool: str, name: str, forced: bool) -> None:
        await self.router.remove_replica(pool, name)
        self._record(f"removed_{pool}", name, "drain timeout: requests fail over" if forced else "drained")
        try:
            await self.actuator.retire(pool, name)
        except Exception as exc:  # noqa: BLE001 - the replica is out of the router either way
            log.warning("retiring %s replica %s failed: %s", pool, name, exc)

    async def stop(self) -> None:
        for t in [self._clock, *self._tasks]:
            if t is None:
                continue
            t.cancel()
        await asyncio.gather(*[t for t in (self._clock, *self._tasks) if t is not None], return_exceptions=True)
