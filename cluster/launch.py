"""Bring the service up on Ray: workers as actors, the router in this process.

:func:`launch` starts (embedded) or joins (``ray.address: auto``) a Ray cluster, creates the
target and draft worker actors placed by the config's resources, waits for their gRPC servers,
and starts the router (public gRPC API + /metrics) on a background thread with the actors'
handles. :func:`serve` does that and blocks until SIGINT / SIGTERM, then shuts down cleanly:
health flips to NOT_SERVING, running requests get ``router.grace_s`` to finish (the rest end
UNAVAILABLE), the actors are killed and an embedded Ray is shut down (``ray stop`` is never run).

This is the one place that imports the router and both worker packages together.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from cluster.config import PoolConfig, ServeConfig
from cluster.local_ray import check_loopback, pin_loopback_node
from cluster.placement import check_tensor_parallel, embedded_node
from specdec.rpc.worker_host import end_worker_actors

log = logging.getLogger(__name__)

__all__ = ["Deployment", "StopRequested", "launch", "serve", "start_ray", "check_exposure", "check_models"]


@dataclass
class Deployment:
    config: ServeConfig
    router: Any  # router.server.RouterThread
    targets: list = field(default_factory=list)
    drafts: list = field(default_factory=list)
    started_ray: bool = False
    actuator: Any = None  # cluster.pool_actuator.RayPoolActuator when router.scaling is on
    gateway: Any = None  # cluster.gateway_process.GatewayProcess when router.http_port is set

    @property
    def address(self) -> str:
        return self.router.address

    @property
    def metrics_port(self) -> int | None:
        return self.router.router.metrics_port

    def stop(self, grace: float | None = None) -> None:
        import ray

        if self.gateway is not None:  # first: no new HTTP requests while the router drains
            self.gateway.stop()
        if self.router is not None:
            self.router.stop(grace)
        if self.actuator is not None:
            self.actuator.stop()  # every replica it holds, and the resource request
        # With an actuator they are ended already: this finds them dead.
        end_worker_actors(self.targets + self.drafts, grace if grace is not None else 2.0)
        if self.started_ray and ray.is_initialized():
            ray.shutdown()
        log.info("specdec stopped")


def check_exposure(cfg: ServeConfig) -> None:
    """Refuse a public API beyond loopback without TLS and bearer tokens unless the config says
    ``security.allow_insecure: true`` (docs/design.md, Security): a copied cluster file must not
    open the service to its network by accident."""
    from cluster.local_ray import is_loopback

    sec, rc = cfg.security, cfg.router
    if is_loopback(rc.host) or (sec.tls and sec.token_auth) or sec.allow_insecure:
        return
    missing = " and ".join(m for m, on in (("TLS", sec.tls), ("bearer tokens", sec.token_auth)) if not on)
    raise ValueError(
        f"router.host {rc.host} serves the API beyond this machine without {missing}: set "
        "security.tls_cert and security.tls_key, and security.tokens_file (README, Security), or "
        "security.allow_insecure: true where a network boundary you control guards the port"
    )


def check_models(cfg: ServeConfig) -> None:
    """Fail before starting anything when a model is not prepared or pulled (the error says how), the
    runner does not support its architecture, or the draft's tokenizer is not the target's
    (specdec.core.model_check; docs/models.md)."""
    from specdec.core import packs
    from specdec.core.model_check import check_models as check_model_pair

    check_model_pair(cfg.target.worker.model, cfg.draft.worker.model if cfg.draft is not None else None)
    if cfg.target.tokenizer and cfg.target.tokenizer in packs.PACKS:
        packs.resolve_pack(cfg.target.tokenizer)


def start_ray(cfg: ServeConfig) -> bool:
    """Start an embedded local cluster or join ``cfg.ray.address``; True if we started one."""
    rc = cfg.ray
    if not rc.address:
        # A private cluster: Ray's own token auth on (a fresh token per start unless one is given), on
        # the loopback address; RAY_AUTH_MODE=disabled in the environment turns the auth off. Set
        # before Ray is imported: Ray reads the mode once, at import.
        if os.environ.setdefault("RAY_AUTH_MODE", "token") == "token":
            os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))
        else:
            log.warning(
                "RAY_AUTH_MODE=%s: the embedded Ray cluster accepts unauthenticated calls", os.environ["RAY_AUTH_MODE"]
            )
    import ray

    if ray.is_initialized():
        return False
    if rc.address:
        log.info("joining the Ray cluster at %s", rc.address)
        ray.init(address=rc.address, namespace=rc.namespace)
        return False
    num_cpus, resources = embedded_node(cfg)
    log.info("starting an embedded Ray cluster: %d logical CPUs, resources %s", num_cpus, resources)
    system = {"worker_niceness": rc.worker_niceness} if rc.worker_niceness is not None else None
    pin_loopback_node()  # every Ray process binds 127.0.0.1 (cluster/local_ray.py)
    ray.init(
        address="local",
        num_cpus=num_cpus,
        resources=resources,
        namespace=rc.namespace,
        include_dashboard=rc.include_dashboard,
        _node_ip_address="127.0.0.1",
        _system_config=system,
    )
    check_loopback()
    return True


def _spawn(pool: PoolConfig, role: str) -> list:
    if role == "target" and pool.tensor_parallel > 1:
        from target_worker.group import spawn_target_group

        return [
            spawn_target_group(pool.worker.to_dict(), pool.tensor_parallel, pool.placement, timeout_s=pool.tp_timeout_s)
            for _ in range(pool.replicas)
        ]
    if role == "target":
        from target_worker.actor import spawn_target_worker as spawn
    else:
        from draft_worker.actor import spawn_draft_worker as spawn
    return [spawn(pool.worker.to_dict(), pool.placement) for _ in range(pool.replicas)]


def _known_nodes(cfg: ServeConfig) -> list[dict[str, float]] | None:
    """Total resources per node: the running cluster's, the embedded one's to be, or None (not joined yet)."""
    ray = sys.modules.get("ray")  # not imported here: Ray reads RAY_AUTH_MODE once, at import (start_ray)
    if ray is not None and ray.is_initialized():
        return [dict(n["Resources"]) for n in ray.nodes() if n.get("Alive")]
    if cfg.ray.address is None:
        num_cpus, resources = embedded_node(cfg)
        return [{"CPU": float(num_cpus), "memory": float("inf"), **resources}]
    return None


class StopRequested(Exception):
    """A stop (SIGINT / SIGTERM) came while the service was starting: :func:`launch` stopped what it
    had started."""


def _wait_ready(handles: list, role: str, timeout: float, stop: threading.Event | None = None) -> list[str]:
    """The workers' gRPC addresses once they all serve. Waits in short slices and gives up when
    ``stop`` is set (SIGTERM while a worker waits for resources), not only after ``timeout``."""
    import ray
    from ray.exceptions import RayActorError

    log.info("waiting for %d %s worker(s) to start", len(handles), role)
    refs = [h.address.remote() for h in handles]
    t_end = time.monotonic() + timeout
    pending = refs
    while pending:
        if stop is not None and stop.is_set():
            raise StopRequested(f"stopped while waiting for the {role} workers")
        if time.monotonic() > t_end:
            raise RuntimeError(
                f"{role} workers did not start within {timeout:.0f} s (not enough "
                f"resources for their placement? see `ray status`)"
            )
        _, pending = ray.wait(pending, num_returns=len(pending), timeout=0.5)
    try:
        return ray.get(refs)
    except RayActorError as exc:
        raise RuntimeError(f"a {role} worker failed to start: {exc}") from None


def launch(
    cfg: ServeConfig,
    *,
    connect_timeout: float = 900.0,
    stop: threading.Event | None = None,
    ray_started: Callable[[], None] | None = None,
) -> Deployment:
    """Start everything; returns once the router (and the HTTP gateway, when ``router.http_port`` is
    set) serves. The caller stops it (``Deployment.stop``). ``stop``: once set, waiting for workers
    ends in :class:`StopRequested` (everything started is stopped). ``ray_started``: called once Ray
    is up (``ray.init`` installs its own SIGTERM handler)."""
    from router.server import RouterThread, TargetBinding
    from router.workers import ActorEndpoint
    from specdec.rpc.worker_secret import ensure_secret

    check_exposure(cfg)
    check_models(cfg)
    nodes = _known_nodes(cfg)
    check_tensor_parallel(cfg, nodes)  # bad values fail here, before Ray or any worker starts
    cfg.security.check_files()
    ensure_secret(cfg.security.worker_secret_file)  # before Ray starts: its processes inherit it
    dep = Deployment(config=cfg, router=None)
    try:
        dep.started_ray = start_ray(cfg)
        if ray_started is not None:
            ray_started()
        if nodes is None:  # joined a cluster: now its nodes are known
            check_tensor_parallel(cfg, _known_nodes(cfg))
        t0 = time.monotonic()
        dep.targets = _spawn(cfg.target, "target")
        dep.drafts = _spawn(cfg.draft, "draft") if cfg.draft else []
        addrs = _wait_ready(dep.targets, "target", connect_timeout, stop)
        log.info("target workers ready at %s", ", ".join(addrs))
        if dep.drafts:
            addrs = _wait_ready(dep.drafts, "draft", connect_timeout, stop)
            log.info("draft workers ready at %s", ", ".join(addrs))
        log.info("workers loaded in %.1f s", time.monotonic() - t0)
        bindings = []
        for i, t in enumerate(dep.targets):
            d = dep.drafts[i % len(dep.drafts)] if dep.drafts else None
            bindings.append(
                TargetBinding(
                    model=cfg.target.model_name,
                    target=ActorEndpoint(t, name=f"target-{i}"),
                    draft=ActorEndpoint(d, name=f"draft-{i % len(dep.drafts)}") if d is not None else None,
                    draft_model=cfg.draft.model_name if cfg.draft else None,
                    tokenizer=cfg.target.tokenizer,  # None: the target worker sends it (GetTokenizer)
                )
            )
        if cfg.router.scaling.enabled:
            from cluster.pool_actuator import RayPoolActuator

            initial = {f"target-{i}": ("target", h) for i, h in enumerate(dep.targets)}
            initial.update({f"draft-{i}": ("draft", h) for i, h in enumerate(dep.drafts)})
            dep.actuator = RayPoolActuator(cfg, initial)
        dep.router = RouterThread(bindings, cfg.router, actuator=dep.actuator, security=cfg.security).start(
            connect_timeout
        )
        if cfg.router.http_port:
            from cluster.gateway_process import dial_address, start_gateway

            router = dial_address(cfg.router.host, dep.router.router.port)
            dep.gateway = start_gateway(router, cfg.router.host, cfg.router.http_port, cfg.security)
    except BaseException:
        dep.stop(grace=0)
        raise
    return dep


def serve(cfg: ServeConfig, *, ready: Any = None) -> int:
    """:func:`launch`, then block until SIGINT / SIGTERM and shut down cleanly. Returns 0, also
    when the signal comes while the service starts (waiting for workers, say)."""
    stop = threading.Event()

    def _on_signal(signum, _frame):
        log.info("received %s: shutting down", signal.Signals(signum).name)
        stop.set()

    def _install() -> None:
        for s in previous:
            signal.signal(s, _on_signal)

    previous = {s: signal.signal(s, _on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    dep = None
    try:
        try:
            dep = launch(cfg, stop=stop, ray_started=_install)
        except StopRequested as exc:
            log.info("%s", exc)
            return 0
        _install()  # Ray may have installed its own handlers while the workers started
        metrics = dep.metrics_port
        msg = f"specdec serving specdec.v1.Generation on {dep.address}" + (
            f", metrics on http://{cfg.router.metrics_host}:{metrics}/metrics" if metrics else ""
        )
        if dep.gateway is not None:
            msg += f", the OpenAI-compatible API on http://{cfg.router.host}:{cfg.router.http_port}/v1"
        log.info(msg)
        if ready is not None:
            ready(dep)
        while not stop.wait(0.5):
            pass
    finally:
        if dep is not None:
            dep.stop()
        for s, h in previous.items():
            signal.signal(s, h)
    return 0
