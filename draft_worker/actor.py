"""The draft worker as a Ray actor: loads the draft model (or the n-gram drafter) and serves
DraftService over gRPC on its node.

Contract (the router / launcher side), the same shape as the target worker's:

* ``spawn_draft_worker(config, placement=None, name=None, max_restarts=-1)`` -> actor handle.
  ``config`` is a :class:`specdec.rpc.worker_config.WorkerConfig` dict (model or "ngram", dtype, device,
  num_slots, max_len, host, port, threads, top_k_sent, ...); ``placement`` picks the node (see
  :func:`specdec.rpc.worker_host.actor_options`; default ``{"resources": {"draft_gpu": 1}}``).
* ``handle.address.remote()`` -> "host:port"; ``info.remote()`` -> dict (WorkerInfo fields +
  address, pid, started_at, restarted, node_ip); ``pid.remote()``; ``drain.remote()``;
  ``shutdown.remote(grace)``.
* A restarted actor re-runs ``__init__`` (new port when port is 0, empty caches): ask the handle
  for ``address()`` again. Until it is back the router verifies with k = 0 (fail open).

Ray and torch are imported lazily, so importing this module is cheap and torch-free.
"""

from __future__ import annotations

import logging

from specdec.rpc.worker_config import WorkerConfig
from specdec.rpc.worker_host import WorkerHost, actor_options
from specdec.rpc.worker_secret import current_secret

log = logging.getLogger(__name__)

DEFAULT_RESOURCES = {"draft_gpu": 1}

__all__ = ["DEFAULT_RESOURCES", "DraftWorker", "spawn_draft_worker"]


class DraftWorker(WorkerHost):
    """Loads the drafter and serves specdec.v1.DraftService (a Ray actor, or a plain object)."""

    role = "draft"

    def __init__(self, config: dict | WorkerConfig, secret: str | None = None):
        from draft_worker.servicer import SERVICE_NAME, build_draft_servicer
        from specdec.rpc import worker_pb2_grpc

        cfg = WorkerConfig.from_dict(config)
        self.servicer = build_draft_servicer(cfg)
        super().__init__(
            cfg,
            [(worker_pb2_grpc.add_DraftServiceServicer_to_server, self.servicer, SERVICE_NAME)],
            self.servicer,
            secret=secret,
        )


def spawn_draft_worker(
    config: dict | WorkerConfig,
    placement: dict | None = None,
    name: str | None = None,
    max_restarts: int = -1,
    max_task_retries: int = 3,
):
    """Create a DraftWorker actor placed by ``placement``; returns the handle (not yet ready:
    ``ray.get(handle.address.remote())`` waits for the drafter to load)."""
    import ray

    cfg = WorkerConfig.from_dict(config)  # fail here, not in the actor, on a bad config
    opts = actor_options(
        placement, DEFAULT_RESOURCES, name=name, max_restarts=max_restarts, max_task_retries=max_task_retries
    )
    # the worker secret goes as an argument: a runtime_env's env_vars end up in Ray's log files
    return ray.remote(DraftWorker).options(**opts).remote(cfg.to_dict(), current_secret())
