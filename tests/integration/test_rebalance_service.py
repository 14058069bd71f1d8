"""The rebalancer end to end: 2 target replicas and 2 draft workers (Ray actors, tiny models, real
gRPC on loopback), the router in this process with one shared drafter pool.

One drafter is slowed at run time (the workers' TEST/BENCHMARK knob ``set_bench_step_delay``): the
rebalancer shifts the drafts to the fast one. A drafter that dies drops out and comes back. Device
telemetry reaches the router's /metrics (one drafter reports through the FAKE NVML). Every output
equals the single-process engine's: rebalancing never changes tokens.
"""

from __future__ import annotations

import threading
import time

import pytest

from specdec.core.params import SamplingParams
from specdec.core.request_state import KPolicy
from specdec.rpc.client import SpecdecClient

MAX_LEN = 512
SLOTS = 8
PERIOD = 0.25  # telemetry and rebalancer period (s)
FAKE_SCRIPT = [{"gpu": 42, "memory": 7, "used": 1 << 30, "total": 16 << 30, "power_mw": 90_000}]


def _config(path, **extra) -> dict:
    return {
        "model": str(path),
        "dtype": "float32",
        "num_slots": SLOTS,
        "max_len": MAX_LEN,
        "threads": 1,
        "telemetry": {"period_s": PERIOD},
        **extra,
    }


class Cluster:
    def __init__(self, router, targets, drafts):
        self.router, self.targets, self.drafts = router, targets, drafts
        self.client = SpecdecClient(router.address)

    def metric(self, name: str, labels: dict | None = None) -> float:
        return self.router.metrics.sample(name, labels) or 0.0

    def wait_slots_free(self, timeout: float = 30.0) -> None:
        """Every worker's KV slots free again (a request that moved held slots on both drafters)."""
        import ray

        from specdec.rpc import worker_pb2, worker_pb2_grpc
        from specdec.rpc.worker_secret import worker_channel

        def free(handle, stub_cls) -> int:
            address = ray.get(handle.address.remote(), timeout=60)
            with worker_channel(address) as ch:  # the workers require the session's secret
                return stub_cls(ch).Info(worker_pb2.InfoRequest(), timeout=10).free_slots

        t_end = time.monotonic() + timeout
        while True:
            slots = [free(h, worker_pb2_grpc.TargetServiceStub) for h in self.targets]
            slots += [free(h, worker_pb2_grpc.DraftServiceStub) for h in self.drafts]
            if slots == [SLOTS] * 4:
                return
            assert time.monotonic() < t_end, f"slots not freed: {slots}"
            time.sleep(0.1)

    def jobs_by_drafter(self) -> dict[str, int]:
        """How many requests draft on each drafter, read in the router's own thread."""

        async def read() -> dict[str, int]:
            return {v.name: v.jobs for v in self.router.router.pool.views()}

        return self.router.run(read(), timeout=30)

    def drafted(self) -> dict[str, float]:
        return {f"draft-{i}": self.metric("specdec_draft_sequences_total", {"worker": f"draft-{i}"}) for i in (0, 1)}


@pytest.fixture(scope="module")
def cluster(ray_cluster, actor_reaper, tiny_paths):
    import ray

    from draft_worker.actor import spawn_draft_worker
    from router.config import RouterConfig
    from router.server import RouterThread, TargetBinding
    from router.workers import ActorEndpoint
    from target_worker.actor import spawn_target_worker

    targets = [spawn_target_worker(_config(tiny_paths["llama"])) for _ in range(2)]
    drafts = [
        spawn_draft_worker(_config(tiny_paths["llama-draft"])),
        spawn_draft_worker(
            _config(tiny_paths["llama-draft"], telemetry={"period_s": PERIOD, "fake_nvml": FAKE_SCRIPT})
        ),
    ]
    actor_reaper.extend(targets + drafts)
    ray.get([h.address.remote() for h in targets + drafts], timeout=300)
    config = RouterConfig(
        port=0,
        metrics_port=0,
        k_policy=KPolicy(k=3, adaptive=True, k_min=1, k_max=6),
        micro_batches=1,
        draft_deadline_s=5.0,
        draft_deadline_factor=0,  # no deadline-based fail open: the rebalancer has to do the shifting
        default_max_tokens=64,
        rebalance={"period_s": PERIOD, "move_cooldown_s": 0.5, "stale_s": 5.0},
    )
    bindings = [
        TargetBinding(
            "tiny-llama",
            ActorEndpoint(t, f"target-{i}"),
            ActorEndpoint(d, f"draft-{i}"),
            "tiny-llama-draft",
            tokenizer=str(tiny_paths["llama"]),
        )
        for i, (t, d) in enumerate(zip(targets, drafts))
    ]
    router = RouterThread(bindings, config).start(connect_timeout=300)
    c = Cluster(router, targets, drafts)
    try:
        yield c
    finally:
        c.client.close()
        router.stop(grace=0)


@pytest.fixture(scope="module")
def engine(tiny_paths):
    from specdec.core.build import build_engine

    eng, parts = build_engine(
        str(tiny_paths["llama"]), str(tiny_paths["llama-draft"]), dtype="float32", num_slots=16, max_len=MAX_LEN
    )
    return eng, parts


def _encode(engine, text: str) -> list[int]:
    return list(engine[1].target.tokenizer(text)["input_ids"])


def _run_concurrently(client, requests: list[dict], timeout: float = 240) -> list:
    out: list = [None] * len(requests)

    def one(i: int) -> None:
        try:
            out[i] = client.generate(timeout=timeout, **requests[i])
        except Exception as exc:  # noqa: BLE001 - reported by the assertions below
            out[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 30)
    return out


def _requests(engine, n: int, max_tokens: int, sampled: bool = True) -> tuple[list[dict], list]:
    """n requests (greedy, and with ``sampled`` every third seeded sampling) and the engine's outputs."""
    texts = ["def fib(n):", "hello world, ", "The quick brown fox", "import numpy as np\n", "abcabc", "x = 1\ny ="]
    reqs, params = [], []
    for i in range(n):
        ids = _encode(engine, texts[i % len(texts)])
        kw = dict(temperature=0.8, top_p=0.9, seed=100 + i) if sampled and i % 3 == 2 else {}
        reqs.append(dict(prompt_token_ids=ids, max_tokens=max_tokens, ignore_eos=True, mode="draft", **kw))
        params.append(SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kw))
    expected = engine[0].generate([r["prompt_token_ids"] for r in reqs], params)
    return reqs, expected


def _check_outputs(outs, expected) -> None:
    for i, (o, e) in enumerate(zip(outs, expected)):
        assert not isinstance(o, Exception), f"request {i}: {o!r}"
        assert o.token_ids == e.token_ids, f"request {i} differs from the engine"


def test_the_pool_serves_both_targets_from_both_drafters_with_the_engines_outputs(cluster, engine):
    before = cluster.drafted()
    reqs, expected = _requests(engine, 8, 24)
    result: dict = {}
    runner = threading.Thread(target=lambda: result.update(outs=_run_concurrently(cluster.client, reqs)))
    runner.start()
    peak = [0, 0]  # requests seen on each target replica while they run
    while runner.is_alive():
        for i, s in enumerate(cluster.router.router.schedulers):
            peak[i] = max(peak[i], len(s.running) + len(s.waiting))
        time.sleep(0.01)
    runner.join()
    _check_outputs(result["outs"], expected)
    assert min(peak) >= 2, peak  # spread over both replicas by load
    after = cluster.drafted()
    assert all(after[k] > before[k] for k in after), (before, after)  # both drafters drafted


def test_device_telemetry_reaches_the_router_metrics(cluster):
    t_end = time.monotonic() + 30
    lab = {"worker": "draft-1", "role": "draft", "device": "cpu"}
    while cluster.metric("specdec_device_utilization", {**lab, "signal": "kernel"}) != pytest.approx(0.42):
        assert time.monotonic() < t_end, "the fake NVML's utilization did not reach /metrics"
        time.sleep(PERIOD)
    assert cluster.metric("specdec_device_power_watts", lab) == pytest.approx(90.0)
    assert cluster.metric("specdec_device_memory_used_bytes", lab) == float(1 << 30)
    # CPU workers: the busy fraction and the process's own figures; no NVML series
    cpu = {"worker": "target-0", "role": "target", "device": "cpu"}
    assert 0.0 <= cluster.metric("specdec_device_utilization", {**cpu, "signal": "busy"}) <= 1.0
    assert cluster.metric("specdec_worker_rss_bytes", {"worker": "target-0", "role": "target"}) > 0
    assert cluster.router.metrics.sample("specdec_device_power_watts", cpu) is None
    info = cluster.router.router.pool.client("draft-1").telemetry
    assert info.source == "nvml" and info.utilization == pytest.approx(0.42)


def _busiest(cluster, since: dict[str, float], at_least: float, runner, timeout: float = 60) -> tuple[int, str, str]:
    """Once ``at_least`` sequences were drafted since ``since``: (index, name) of the drafter that
    drafted most of them (where the policy put the requests), and the other one's name."""
    t_end = time.monotonic() + timeout
    while True:
        now = cluster.drafted()
        delta = {k: now[k] - since[k] for k in now}
        if sum(delta.values()) >= at_least:
            i = 0 if delta["draft-0"] >= delta["draft-1"] else 1
            return i, f"draft-{i}", f"draft-{1 - i}"
        assert time.monotonic() < t_end and runner.is_alive(), now
        time.sleep(0.05)


def test_a_slowed_drafter_loses_its_drafts_to_the_fast_one(cluster, engine):
    import ray

    reqs, expected = _requests(engine, 6, 160)
    result: dict = {}
    runner = threading.Thread(target=lambda: result.update(outs=_run_concurrently(cluster.client, reqs)))
    moves0 = cluster.metric("specdec_rebalance_actions_total", {"action": "draft_move"})
    start = cluster.drafted()
    runner.start()
    i, slow_name, fast_name = _busiest(cluster, start, 40, runner)  # slow the one carrying the drafts
    slow = cluster.drafts[i]
    ray.get(slow.set_bench_step_delay.remote(0.05), timeout=30)  # each draft step 50 ms slower
    t_slow = time.monotonic()
    # the shift, as the router's pool sees it: no request drafts on the slow drafter any more while
    # requests still draft on the fast one. (Counting drafts for a quiet spell instead raced the end
    # of the load: on a fast machine the moved requests finished within the spell.) A slowed round
    # takes k x 50 ms, so the requests left on it cannot finish before the rebalancer moves them.
    reaction, seen = None, []
    while runner.is_alive() and time.monotonic() - t_slow < 60:
        jobs = cluster.jobs_by_drafter()
        seen.append((round(time.monotonic() - t_slow, 2), jobs, cluster.drafted()))
        if jobs[slow_name] == 0 and jobs[fast_name] > 0:
            reaction = time.monotonic() - t_slow
            break
        time.sleep(0.05)
    at_shift = cluster.drafted()
    runner.join(300)
    ray.get(slow.set_bench_step_delay.remote(0.0), timeout=30)
    assert reaction is not None, f"drafts never shifted to the fast drafter: {seen[:5]} ... {seen[-5:]}"
    print(f"drafts shifted from {slow_name} {reaction:.2f} s after the slowdown")
    end = cluster.drafted()
    fast_share = (end[fast_name] - at_shift[fast_name]) / max(1.0, sum(end.values()) - sum(at_shift.values()))
    assert fast_share >= 0.9, (at_shift, end)
    if at_shift[slow_name] > start[slow_name]:  # requests were on it when it slowed: they moved
        assert cluster.metric("specdec_rebalance_actions_total", {"action": "draft_move"}) > moves0
    _check_outputs(result["outs"], expected)  # moved requests rebuilt their drafter caches: same tokens
    cluster.wait_slots_free()


def test_a_dead_drafter_drops_out_and_comes_back(cluster, engine, wait_for_restart):
    import ray

    reqs, expected = _requests(engine, 4, 160)
    fo0 = cluster.metric("specdec_rebalance_actions_total", {"action": "draft_failover"})
    result: dict = {}
    runner = threading.Thread(target=lambda: result.update(outs=_run_concurrently(cluster.client, reqs)))
    start = cluster.drafted()
    runner.start()
    i, name, _ = _busiest(cluster, start, 20, runner)  # kill the one carrying the drafts
    victim = cluster.drafts[i]
    old_pid = ray.get(victim.pid.remote(), timeout=30)
    ray.kill(victim, no_restart=False)
    runner.join(300)
    _check_outputs(result["outs"], expected)
    assert cluster.metric("specdec_rebalance_actions_total", {"action": "draft_failover"}) > fo0
    # it comes back (a new process on a new port) and gets drafts again
    wait_for_restart(victim, old_pid)
    t_end = time.monotonic() + 60
    while cluster.metric("specdec_worker_up", {"role": "draft", "worker": name}) != 1:
        assert time.monotonic() < t_end, "the router did not find the restarted drafter"
        time.sleep(0.1)
    before = cluster.drafted()[name]
    # a restarted drafter is a new process: its old measurements are dropped and it is priced at the
    # pool's median, so it gets requests again at once (router/drafter_pool.py, DrafterPool.view)
    reqs, expected = _requests(engine, 6, 24)
    _check_outputs(_run_concurrently(cluster.client, reqs), expected)
    assert cluster.drafted()[name] > before, cluster.router.router.pool.views()


def _router(cluster, tiny_paths, drafts=None, **rebalance):
    """A second router over the module's targets and ``drafts`` (default: the module's drafters),
    with its own rebalancer settings."""
    from router.config import RouterConfig
    from router.server import RouterThread, TargetBinding
    from router.workers import ActorEndpoint

    config = RouterConfig(
        port=0,
        metrics_port=0,
        k_policy=KPolicy(k=3, adaptive=True, k_min=1, k_max=6),
        micro_batches=1,
        draft_deadline_s=5.0,
        draft_deadline_factor=0,
        rebalance={"period_s": PERIOD, **rebalance},
    )
    bindings = [
        TargetBinding(
            "tiny-llama",
            ActorEndpoint(t, f"target-{i}"),
            ActorEndpoint(d, f"draft-{i}"),
            "tiny-llama-draft",
            tokenizer=str(tiny_paths["llama"]),
        )
        for i, (t, d) in enumerate(zip(cluster.targets, drafts or cluster.drafts))
    ]
    return RouterThread(bindings, config).start(connect_timeout=300)


@pytest.mark.slow  # driven by delays against the machine's own speed: opt-in (pyproject.toml, markers)
def test_speculation_switched_off_by_slow_drafts_comes_back_on_after_a_catch_up(
    cluster, engine, tiny_paths, actor_reaper
):
    """Both drafters slowed until drafting cannot pay: the goodput rule switches the AUTO requests
    off (and later ones start off). Drafters fast again: the old price ages into a guess, one
    request probes, the drafters are measured fast, and requests speculate again, each first
    catching its drafter up with a Prefill in the background (specdec_draft_catch_up_total)
    instead of holding a round. Outputs equal the engine's throughout. The switch's rule in the
    router's own code under a virtual clock, run by default: tests/unit/test_planning_sim.py."""
    import ray

    from draft_worker.actor import spawn_draft_worker
    from specdec.rpc.worker_host import end_worker_actors

    # Drafters with the target's own weights (greedy acceptance 1): with the tiny drafter's
    # acceptance (0.1-0.4) fast drafts gain at most a few per cent on a 100 ms verify, within the
    # switch's margin and the verify line's noise, and whether they switched back on was a coin
    # toss (CI, stop 21). Here fast drafts pay several-fold and 300 ms draft steps lose by far.
    # (placed with no logical resources: the module's four workers hold the test cluster's)
    drafts = [spawn_draft_worker(_config(tiny_paths["llama"]), placement={"num_cpus": 0}) for _ in range(2)]
    actor_reaper.extend(drafts)  # if this test fails before its own finally
    ray.get([d.address.remote() for d in drafts], timeout=300)
    router = _router(cluster, tiny_paths, drafts, stale_s=1.0, spec_cooldown_s=0.5)
    client = SpecdecClient(router.address)

    def metric(name: str, labels: dict | None = None) -> float:
        return router.metrics.sample(name, labels) or 0.0

    def action(name: str) -> float:
        return metric("specdec_rebalance_actions_total", {"action": name})

    def start_batch() -> tuple[threading.Thread, dict, list]:
        reqs, expected = _requests(engine, 4, 120, sampled=False)
        for r in reqs:
            r["mode"] = "auto"
        result: dict = {}
        runner = threading.Thread(target=lambda: result.update(outs=_run_concurrently(client, reqs)))
        runner.start()
        return runner, result, expected

    def finish(runner: threading.Thread, result: dict, expected: list) -> None:
        runner.join(300)
        _check_outputs(result["outs"], expected)

    workers = cluster.targets + drafts
    try:
        ray.get([t.set_bench_step_delay.remote(0.1) for t in cluster.targets], timeout=30)
        ray.get([d.set_bench_step_delay.remote(0.3) for d in drafts], timeout=30)  # 300 ms per draft step
        slowed = start_batch()
        while slowed[0].is_alive() and action("spec_off") == 0:
            time.sleep(0.05)
        assert action("spec_off") > 0, f"slow drafts were never switched off; drafters {router.router.pool.views()}"
        ray.get([d.set_bench_step_delay.remote(0.0) for d in drafts], timeout=30)
        on0, caught0 = action("spec_on"), metric("specdec_draft_catch_up_total")  # drafter moves catch up too
        finish(*slowed)
        t_end, batches = time.monotonic() + 120, 1
        while action("spec_on") == on0 or metric("specdec_draft_catch_up_total") == caught0:
            seen = (action("spec_off"), action("spec_on") - on0, metric("specdec_draft_catch_up_total") - caught0)
            assert time.monotonic() < t_end, f"off, on, catch-ups since: {seen}; drafters {router.router.pool.views()}"
            finish(*start_batch())
            batches += 1
        print(
            f"off {action('spec_off'):.0f}, on {action('spec_on') - on0:.0f}, catch-ups "
            f"{metric('specdec_draft_catch_up_total') - caught0:.0f} after the drafters got fast, over "
            f"{batches} batch(es), acceptance {metric('specdec_acceptance_rate'):.2f}"
        )
    finally:
        ray.get([w.set_bench_step_delay.remote(0.0) for w in workers], timeout=30)
        client.close()
        router.stop(grace=0)
        end_worker_actors(drafts, grace=1.0)
    cluster.wait_slots_free()
