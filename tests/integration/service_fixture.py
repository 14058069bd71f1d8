"""The disaggregated service for tests: a target and a draft worker (Ray actors, tiny models) and the
router in this process (``RouterThread``), with helpers to look at the workers and the metrics.

The router runs with two micro-batch lanes from 2 requests on and pre-drafting on, so the pipelined
paths are the ones under test. Its draft deadline is fixed (``draft_deadline_factor`` 0): scaled by
the measured verify time, a loaded machine's noise can make every draft of a request late, and the
tests that check a request speculated would see none (the scaled deadline's rule:
tests/unit/test_batching.py).
"""

from __future__ import annotations

import time
from contextlib import contextmanager

from specdec.core.request_state import KPolicy
from specdec.rpc import worker_pb2, worker_pb2_grpc
from specdec.rpc.client import SpecdecClient
from specdec.rpc.worker_secret import worker_channel

MAX_LEN = 1024
SLOTS = 8
MODEL = "tiny-llama"


def worker_config(path) -> dict:
    return {"model": str(path), "dtype": "float32", "num_slots": SLOTS, "max_len": MAX_LEN, "threads": 1}


class Service:
    def __init__(self, router, target, draft, paths, credentials=None):
        self.router, self.target, self.draft, self.paths = router, target, draft, paths
        self.client = SpecdecClient(router.address, credentials=credentials)
        self.stub = self.client.stub

    def worker_info(self, role: str) -> worker_pb2.WorkerInfo:
        import ray

        handle = self.target if role == "target" else self.draft
        address = ray.get(handle.address.remote(), timeout=120)
        stub_cls = worker_pb2_grpc.TargetServiceStub if role == "target" else worker_pb2_grpc.DraftServiceStub
        with worker_channel(address) as ch:  # the workers require the session's secret
            return stub_cls(ch).Info(worker_pb2.InfoRequest(), timeout=10)

    def wait_slots_free(self, timeout: float = 60.0) -> None:
        t_end = time.monotonic() + timeout
        while True:
            free = {r: self.worker_info(r).free_slots for r in ("target", "draft")}
            if free == {"target": SLOTS, "draft": SLOTS}:
                return
            assert time.monotonic() < t_end, f"slots not freed: {free}"
            time.sleep(0.1)

    def metric(self, name: str, labels: dict | None = None) -> float:
        return self.router.metrics.sample(name, labels) or 0.0


@contextmanager
def running_service(
    actor_reaper, tiny_paths, security=None, credentials=None, models=None, draft_options=None, **router_config
):
    """Start the workers and the router (``router_config`` overrides the test defaults; ``security``:
    a SecurityConfig for the public port, ``credentials`` the client's; ``models``: (name, target
    path, draft path) instead of the tiny pair); stop the router at the end (the actors go with
    ``actor_reaper``); ``draft_options``: the draft worker's (DraftOptions fields)."""
    name, target_path, draft_path = models or (MODEL, tiny_paths["llama"], tiny_paths["llama-draft"])
    from draft_worker.actor import spawn_draft_worker
    from router.config import RouterConfig
    from router.server import RouterThread, TargetBinding
    from router.workers import ActorEndpoint
    from target_worker.actor import spawn_target_worker

    target = spawn_target_worker(worker_config(target_path))
    draft = spawn_draft_worker({**worker_config(draft_path), "draft_options": draft_options})
    actor_reaper.extend([target, draft])
    config = {
        "port": 0,
        "metrics_port": 0,
        "k_policy": KPolicy(k=3, adaptive=True, k_min=1, k_max=6),
        "micro_batches": 2,
        "split_min_batch": 2,
        "predraft": True,
        "draft_deadline_s": 5.0,
        "draft_deadline_factor": 0.0,  # fixed: see the module's docstring
        "recovery_timeout_s": 120.0,
        "default_max_tokens": 64,
        **router_config,
    }
    binding = TargetBinding(
        name,
        ActorEndpoint(target, "target-0"),
        ActorEndpoint(draft, "draft-0"),
        f"{name}-draft" if models else "tiny-llama-draft",
        tokenizer=str(target_path),
    )
    router = RouterThread([binding], RouterConfig(**config), security=security).start(connect_timeout=300)
    svc = Service(router, target, draft, tiny_paths, credentials)
    try:
        yield svc
    finally:
        svc.client.close()
        router.stop(grace=0)
