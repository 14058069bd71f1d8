"""Ray fixtures shared by the integration tests (workers, service).

* ``ray_cluster`` (session): a fresh local Ray cluster for this test session only
  (``address="local"``: never joins a cluster someone else started), with logical CPUs and the
  custom resources the workers are placed by on CPU clusters (``draft_gpu``, ``target_gpu``).
  Shut down at the end of the session; ``ray stop`` is never run.
* ``actor_reaper`` (module): a list; append actor handles and they are killed (no restart) when
  the module's tests are done, so their resources go back to the cluster for the next module.
* ``wait_for_restart`` (session): ``wait_for_restart(handle, old_pid, timeout=90) -> new pid``
  waits until a killed actor with ``max_restarts`` is back (a new process answering ``pid()``).
"""

from __future__ import annotations

import os
import time

import pytest

from specdec.rpc.worker_host import end_worker_actors

# Logical resources of the test cluster: room for the workers of one test module at a time
# (each worker takes 1 CPU + 1 draft_gpu/target_gpu), plus a spare set.
RAY_NUM_CPUS = 4
RAY_RESOURCES = {"draft_gpu": 2, "target_gpu": 2}


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    from cluster.local_ray import pin_loopback_node

    if ray.is_initialized():  # another fixture or plugin already started one for this process
        yield ray.get_runtime_context()
        return
    pin_loopback_node()  # the session's Ray listens on 127.0.0.1 only, as `specdec serve`'s does
    ctx = ray.init(
        address="local",
        num_cpus=RAY_NUM_CPUS,
        resources=RAY_RESOURCES,
        include_dashboard=False,
        namespace="specdec-tests",
        log_to_driver=os.environ.get("SPECDEC_TEST_RAY_LOGS") == "1",
    )
    try:
        yield ctx
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def actor_reaper(ray_cluster):
    handles: list = []
    yield handles
    end_worker_actors(handles, grace=1.0)  # a TP group's placement group goes too


@pytest.fixture(scope="session")
def wait_for_restart(ray_cluster):
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError

    def wait(handle, old_pid: int, timeout: float = 90.0) -> int:
        deadline = time.monotonic() + timeout
        while True:
            try:
                pid = ray.get(handle.pid.remote(), timeout=max(1.0, deadline - time.monotonic()))
                if pid != old_pid:
                    return pid
            except (RayActorError, GetTimeoutError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"actor did not come back within {timeout:.0f} s")
            time.sleep(0.2)

    return wait
