"""A scale-up whose node never comes: the Ray pool actuator (cluster/pool_actuator.py) gives up
after its launch timeout with LaunchFailed, kills the actor it asked for and withdraws the request;
the router's autoscaler records it as a `launch_failed` action (an event, not a crash) and the
service goes on serving. Real Ray (the test session's cluster has no `nowhere_gpu`), the real
router and workers (tests/integration/service_fixture.py)."""

from __future__ import annotations

import asyncio

import pytest

from tests.integration.service_fixture import running_service, worker_config

LAUNCH_TIMEOUT_S = 3.0


@pytest.fixture(scope="module")
def service(ray_cluster, actor_reaper, tiny_paths):
    with running_service(actor_reaper, tiny_paths) as svc:
        yield svc


def _actuator(tiny_paths):
    from cluster.config import PoolConfig, ServeConfig
    from cluster.pool_actuator import RayPoolActuator

    target = dict(worker_config(tiny_paths["llama"]), placement={"resources": {"nowhere_gpu": 1}})
    return RayPoolActuator(ServeConfig(PoolConfig.from_dict(target, "target"), None))


def test_a_node_that_never_comes_is_launch_failed(ray_cluster, tiny_paths):
    from router.autoscaler import LaunchFailed

    actuator = _actuator(tiny_paths)
    with pytest.raises(LaunchFailed, match=r"no node with .*nowhere_gpu.* within 3 s"):
        asyncio.run(actuator.launch("target", LAUNCH_TIMEOUT_S))
    (launch,) = actuator.launches
    assert launch.failed and launch.ready_at is None and launch.node_at is None
    assert actuator.handles == {}  # nothing kept for a replica that never served


def test_the_autoscaler_records_a_failed_launch_and_the_service_serves_on(service, tiny_paths):
    from router.autoscaler import Autoscaler
    from router.pool_size import PoolSizeConfig

    router = service.router.router
    scaler = Autoscaler(router, _actuator(tiny_paths), PoolSizeConfig(enabled=True, launch_timeout_s=LAUNCH_TIMEOUT_S))
    failed0 = service.metric("specdec_rebalance_actions_total", {"action": "launch_failed"})
    service.router.run(scaler._launch("target"), timeout=LAUNCH_TIMEOUT_S + 60)
    assert [(action, who) for _, action, who in scaler.events] == [("launch_failed", "target")]
    assert scaler.pending == {"target": 0, "draft": 0}
    assert service.metric("specdec_rebalance_actions_total", {"action": "launch_failed"}) == failed0 + 1
    assert len(router.targets) == 1  # no replica joined
    out = service.client.generate("def fib(n):", max_tokens=8, timeout=60)
    assert len(out.token_ids) == 8 and out.finish_reason == "length"
