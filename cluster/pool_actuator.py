"""The router's pool actuator on Ray: new replicas as Ray actors with the pool's
placement, nodes through Ray's autoscaler.

A launch asks the autoscaler for room (``ray.autoscaler.sdk.request_resources`` with the bundles
of every replica the pools should hold: the call is not additive, it states the whole need), then
creates the actor; Ray places it when a node with the pool's resources arrives. The wait is
bounded (``timeout``): a node that never comes is a LaunchFailed, the actor is killed and the
request withdrawn. Retiring kills the actor and lowers the request, so the autoscaler can remove
the idle node (after its ``idle_timeout_minutes``). Each launch's phases (node launch, actor
start) are kept in ``launches``, so a test or a benchmark can report them.

The router sees only :class:`router.autoscaler.PoolActuator` (it never imports Ray).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from cluster.config import PoolConfig, ServeConfig
from router.autoscaler import LaunchFailed
from router.workers import ActorEndpoint
from specdec.rpc.worker_host import actor_options, end_worker_actors

log = logging.getLogger(__name__)

__all__ = ["Launch", "RayPoolActuator", "pool_bundle"]

DEFAULT_RESOURCES = {"target": {"target_gpu": 1}, "draft": {"draft_gpu": 1}}


def pool_bundle(pool: PoolConfig, role: str) -> dict[str, float]:
    """One replica's resource bundle, as the actor asks Ray for it."""
    opts = actor_options(pool.placement, DEFAULT_RESOURCES[role])
    bundle = {"CPU": float(opts["num_cpus"]), **{k: float(v) for k, v in opts.get("resources", {}).items()}}
    if opts.get("num_gpus"):
        bundle["GPU"] = float(opts["num_gpus"])
    return {k: v for k, v in bundle.items() if v > 0}


@dataclass
class Launch:
    """One replica launch, in monotonic seconds (node_at: None when it fit on a node already up)."""

    pool: str
    name: str
    asked_at: float
    node_at: float | None = None
    ready_at: float | None = None
    failed: str | None = None


def _alive_nodes(bundle: dict[str, float]) -> set[str]:
    """Alive nodes that could hold ``bundle`` (by their total resources): a node of another pool
    joining meanwhile is not this launch's node."""
    import ray

    return {n["NodeID"] for n in ray.nodes() if n.get("Alive") and _fits(n.get("Resources", {}), bundle)}


def _fits(available: dict[str, float], bundle: dict[str, float]) -> bool:
    return all(available.get(k, 0.0) >= v for k, v in bundle.items())


class RayPoolActuator:
    """``initial``: {replica name: (pool, handle)} the deployment started with (the router may
    drain those too; they count in the request)."""

    def __init__(self, cfg: ServeConfig, initial: dict[str, tuple[str, Any]] | None = None):
        self.cfg = cfg
        self.handles: dict[str, tuple[str, Any]] = dict(initial or {})  # name -> (pool, actor handle)
        self.launches: list[Launch] = []
        self._ids = itertools.count()
        self._lock = threading.Lock()

    def _pool(self, pool: str) -> PoolConfig:
        pc = self.cfg.target if pool == "target" else self.cfg.draft
        if pc is None:
            raise LaunchFailed(f"no {pool} pool in the config")
        return pc

    def _request(self, extra: dict[str, float] | None = None) -> None:
        """Tell the autoscaler the whole need: every replica up or launching (+ ``extra``)."""
        from ray.autoscaler.sdk import request_resources

        with self._lock:
            bundles = [pool_bundle(self._pool(p), p) for p, _ in self.handles.values()]
        if extra:
            bundles.append(extra)
        try:
            request_resources(bundles=bundles)
        except Exception as exc:  # noqa: BLE001 - no autoscaler (an embedded cluster): placement still works
            log.debug("request_resources: %s", exc)

    async def launch(self, pool: str, timeout: float) -> ActorEndpoint:
        return await asyncio.to_thread(self._launch, pool, timeout)

    def _launch(self, pool: str, timeout: float) -> ActorEndpoint:
        import ray

        pc = self._pool(pool)
        bundle = pool_bundle(pc, pool)
        name = f"{pool}-as{next(self._ids)}"
        rec = Launch(pool, name, time.monotonic())
        self.launches.append(rec)
        nodes = _alive_nodes(bundle)
        fits = _fits(ray.available_resources(), bundle)
        if not fits:
            log.info("%s: no room for %s in the cluster; asking Ray's autoscaler for a node", name, bundle)
        self._request(extra=bundle)
        if pool == "target":
            from target_worker.actor import spawn_target_worker as spawn
        else:
            from draft_worker.actor import spawn_draft_worker as spawn
        handle = spawn(pc.worker.to_dict(), pc.placement)
        ref = handle.address.remote()
        deadline = rec.asked_at + timeout
        while True:
            ready, _ = ray.wait([ref], timeout=0.5)
            if rec.node_at is None and not fits and _alive_nodes(bundle) - nodes:
                rec.node_at = time.monotonic()
                log.info("%s: a node joined after %.1f s", name, rec.node_at - rec.asked_at)
            if ready:
                break
            if time.monotonic() > deadline:
                ray.kill(handle, no_restart=True)
                rec.failed = f"no node with {bundle} and a ready {pool} worker within {timeout:.0f} s"
                self._request()  # withdraw the extra bundle
                raise LaunchFailed(f"{name}: {rec.failed} (see `ray status`)")
        try:
            address = ray.get(ref)
        except Exception as exc:  # noqa: BLE001 - RayActorError & co.: the worker failed to start
            ray.kill(handle, no_restart=True)
            rec.failed = f"worker failed to start: {exc}"
            self._request()
            raise LaunchFailed(f"{name}: {rec.failed}") from None
        rec.ready_at = time.monotonic()
        with self._lock:
            self.handles[name] = (pool, handle)
        self._request()
        log.info("%s serving at %s (%.1f s after the request)", name, address, rec.ready_at - rec.asked_at)
        return ActorEndpoint(handle, name=name)

    async def retire(self, pool: str, name: str) -> None:
        await asyncio.to_thread(self._retire, name)

    def _retire(self, name: str) -> None:
        with self._lock:
            entry = self.handles.pop(name, None)
        if entry is not None:
            end_worker_actors([entry[1]])
        self._request()
        log.info("%s retired", name)

    def stop(self) -> None:
        """End every replica it holds (those launched here and the deployment's initial ones it was
        given) and withdraw the request (the deployment is stopping)."""
        with self._lock:
            handles, self.handles = list(self.handles.values()), {}
        end_worker_actors([h for _, h in handles])
        self._request()
