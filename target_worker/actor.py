"""The target worker as a Ray actor: loads the model, serves TargetService over gRPC on its node.

Contract (the router / launcher side):

* ``spawn_target_worker(config, placement=None, name=None, max_restarts=-1)`` -> actor handle.
  ``config`` is a :class:`specdec.rpc.worker_config.WorkerConfig` dict (model, dtype, device,
  num_slots, max_len, host, port, threads, ...); ``placement`` picks the node (see
  :func:`specdec.rpc.worker_host.actor_options`; default ``{"resources": {"target_gpu": 1}}``).
* ``handle.address.remote()`` -> "host:port" of the gRPC server; ``info.remote()`` -> dict
  (WorkerInfo fields + address, pid, started_at, restarted, node_ip); ``pid.remote()``;
  ``drain.remote()``; ``shutdown.remote(grace)``.
* Restarts: Ray restarts a dead actor (``max_restarts``) by re-running ``__init__``: the model is
  loaded again, the server binds a new port (when port is 0) and the caches are empty. Callers find
  it again by asking the same handle (or ``ray.get_actor(name)``) for ``address()`` once gRPC says
  UNAVAILABLE; calls made while it restarts wait for it. The router replays the committed tokens
  and the verifier rebuilds the caches from them (docs/design.md, invariant 1).

Ray and torch are imported lazily, so importing this module is cheap and torch-free.
"""

from __future__ import annotations

import logging

from specdec.rpc.worker_config import WorkerConfig
from specdec.rpc.worker_host import WorkerHost, actor_options
from specdec.rpc.worker_secret import current_secret

log = logging.getLogger(__name__)

DEFAULT_RESOURCES = {"target_gpu": 1}

__all__ = ["DEFAULT_RESOURCES", "TargetWorker", "spawn_target_worker"]


class TargetWorker(WorkerHost):
    """Loads the target model and serves specdec.v1.TargetService (a Ray actor, or a plain object)."""

    role = "target"

    def __init__(self, config: dict | WorkerConfig, secret: str | None = None):
        from specdec.rpc import worker_pb2_grpc
        from target_worker.servicer import SERVICE_NAME, build_target_servicer

        cfg = WorkerConfig.from_dict(config)
        self.servicer = build_target_servicer(cfg)
        super().__init__(
            cfg,
            [(worker_pb2_grpc.add_TargetServiceServicer_to_server, self.servicer, SERVICE_NAME)],
            self.servicer,
            secret=secret,
        )


def spawn_target_worker(
    config: dict | WorkerConfig,
    placement: dict | None = None,
    name: str | None = None,
    max_restarts: int = -1,
    max_task_retries: int = 3,
):
    """Create a TargetWorker actor placed by ``placement``; returns the handle (not yet ready:
    ``ray.get(handle.address.remote())`` waits for the model to load)."""
    import ray

    cfg = WorkerConfig.from_dict(config)  # fail here, not in the actor, on a bad config
    if cfg.model.lower() == "ngram":
        raise ValueError("worker config 'model': a target worker needs a model, not 'ngram'")
    opts = actor_options(
        placement, DEFAULT_RESOURCES, name=name, max_restarts=max_restarts, max_task_retries=max_task_retries
    )
    # the worker secret goes as an argument: a runtime_env's env_vars end up in Ray's log files
    return ray.remote(TargetWorker).options(**opts).remote(cfg.to_dict(), current_secret())
