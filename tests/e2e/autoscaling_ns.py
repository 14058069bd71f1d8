"""What tests/e2e/test_autoscaling.py runs inside its own PID, mount and network namespaces.

``python -m tests.e2e.autoscaling_ns SPEC.json`` (under ``unshare --pid --fork --mount-proc
--net``, with ``lo`` up): binds a private directory over /tmp/ray (Ray's session files, and the
"current cluster" file other Ray users on this machine read, stay ours), starts Ray's fake
multi-node autoscaler (:class:`SpecdecAutoscalingCluster`: the real autoscaler starting raylets on
this machine as nodes), runs ``specdec serve --address`` on it, sends a burst of requests until a
replica the router added has served one, then waits for the pools and the nodes to shrink back.
Everything it sees (results, log events, node counts over time, metrics) goes to
``<work>/result.json`` for the test to check; ``specdec serve``'s output to ``<work>/serve.log``.
Teardown (SIGTERM to serve, ``ray stop --force`` by the cluster) is in ``finally``; whatever
survives dies with the namespace.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from ray.cluster_utils import AutoscalingCluster

from tests.e2e.ray_up_ns import ancestors, leftovers

GCS = "127.0.0.1:6379"
# `specdec serve`'s log lines that time a scale-up and a scale-down (cluster/pool_actuator.py,
# router/autoscaler.py, router/scheduler.py), after the text format's timestamp and level.
EVENTS = {
    "action": re.compile(r"router\.autoscaler: ([a-z_]+): (\S+) \("),
    "node_joined": re.compile(r"cluster\.pool_actuator: (\S+): a node joined after"),
    "actor_serving": re.compile(r"cluster\.pool_actuator: (\S+) serving at"),
    "first_served": re.compile(r"router\.scheduler: (\S+): first request served"),
}
STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) [A-Z]+ ")


class SpecdecAutoscalingCluster(AutoscalingCluster):
    """AutoscalingCluster with its base config given here: Ray 2.60's wheel lacks the fake
    provider's example.yaml that ``_generate_config`` reads (these are its keys)."""

    def _generate_config(self, head_resources, worker_node_types, autoscaler_v2=False, **config_kwargs):
        config = {
            "cluster_name": "specdec-fake",
            "max_workers": sum(t["max_workers"] for t in worker_node_types.values()),
            "provider": {
                "type": "fake_multinode",
                "use_node_id_as_ip": True,
                "disable_node_updaters": True,
                "disable_launch_config_check": True,
            },
            "available_node_types": {
                **worker_node_types,
                "ray.head.default": {"resources": head_resources, "node_config": {}, "max_workers": 0},
            },
            "head_node_type": "ray.head.default",
            "auth": {},
            "upscaling_speed": 1.0,
            "idle_timeout_minutes": 0.1,
            "docker": {},
            **{
                k: []
                for k in (
                    "initialization_commands",
                    "setup_commands",
                    "head_setup_commands",
                    "worker_setup_commands",
                    "head_start_ray_commands",
                    "worker_start_ray_commands",
                    "cluster_synced_files",
                    "rsync_exclude",
                    "rsync_filter",
                )
            },
            "file_mounts": {},
            "file_mounts_sync_continuously": False,
        }
        config.update(config_kwargs)
        return config


def _stamp(line: str) -> float | None:
    m = STAMP.match(line)
    return dt.datetime.strptime(m[1], "%Y-%m-%d %H:%M:%S,%f").timestamp() if m else None


def log_events(text: str) -> list[tuple[float, str, str]]:
    """(epoch seconds, event, replica) for every timing line of the serve log, in order."""
    out = []
    for line in text.splitlines():
        t = _stamp(line)
        if t is None:
            continue
        for kind, rx in EVENTS.items():
            m = rx.search(line)
            if m:
                out.append((t, m[1] if kind == "action" else kind, m[2] if kind == "action" else m[1]))
    return out


def metrics(port: int) -> dict[str, float]:
    """The router's /metrics samples this test reads: actions taken and pool sizes."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith(("specdec_rebalance_actions_total{", "specdec_pool_replicas{")):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


class NodeWatch(threading.Thread):
    """Alive nodes over time (epoch seconds, {node type: count}), every 0.5 s, as the autoscaler sees them."""

    def __init__(self):
        super().__init__(daemon=True)
        self.samples: list[tuple[float, dict[str, int]]] = []
        self.halt = threading.Event()
        self.lock = threading.Lock()

    def counts(self) -> dict[str, int]:
        import ray

        out: dict[str, int] = {}
        for n in ray.nodes():
            if n.get("Alive"):
                res = n["Resources"]
                kind = "draft" if "draft_gpu" in res else "target" if "target_gpu" in res else "head"
                out[kind] = out.get(kind, 0) + 1
        return out

    def sample(self) -> dict[str, int]:
        c = self.counts()
        with self.lock:
            if not self.samples or self.samples[-1][1] != c:
                self.samples.append((time.time(), c))
        return c

    def run(self) -> None:
        while not self.halt.wait(0.5):
            try:
                self.sample()
            except Exception:  # noqa: BLE001 - the GCS busy for a moment: next sample
                continue


def burst(spec: dict, serve_log: Path) -> dict[str, Any]:
    """``concurrency`` clients send requests back to back until a replica the router added
    (``*-as*``) has served one, or ``burst_max_s``; then each finishes its request."""
    from specdec.rpc.client import SpecdecClient

    prompts, n_tok = spec["prompts"], spec["max_tokens"]
    results: list[tuple[int, list[int], str]] = []
    errors: list[str] = []
    stop = threading.Event()

    def client_loop(j: int) -> None:
        with SpecdecClient(spec["server"]) as client:
            i = j
            while not stop.is_set():
                p = i % len(prompts)
                try:
                    r = client.generate(prompts[p], max_tokens=n_tok, ignore_eos=True, timeout=180)
                    results.append((p, list(r.token_ids), r.finish_reason))
                except Exception as exc:  # noqa: BLE001 - every failure is reported, the test fails on any
                    errors.append(repr(exc))
                i += spec["concurrency"]

    threads = [threading.Thread(target=client_loop, args=(j,)) for j in range(spec["concurrency"])]
    start = time.time()
    for t in threads:
        t.start()
    new_served = re.compile(r"router\.scheduler: \S+-as\d+: first request served")
    while time.time() - start < spec["burst_max_s"] and not new_served.search(serve_log.read_text(errors="replace")):
        time.sleep(0.25)
    stop.set()
    for t in threads:
        t.join(200)
    return {"start": start, "end": time.time(), "results": results, "errors": errors}


def settled(port: int, nodes: NodeWatch, spec: dict) -> bool:
    """Both pools at their minimum with nothing draining, and only the minimum's nodes alive."""
    m = metrics(port)
    for pool in ("target", "draft"):
        if m.get(f'specdec_pool_replicas{{pool="{pool}",state="serving"}}') != spec["min_replicas"][pool]:
            return False
        if m.get(f'specdec_pool_replicas{{pool="{pool}",state="draining"}}', 0) != 0:
            return False
    return nodes.sample() == spec["min_nodes"]


def wait_serving(server: str, proc: subprocess.Popen, deadline: float) -> str:
    """The router's health once SERVING (polled every 0.2 s on a fresh channel: a channel's
    reconnect backoff would see it seconds late), or the last status at the deadline or exit."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    status = "UNAVAILABLE"
    while time.monotonic() < deadline and proc.poll() is None:
        with grpc.insecure_channel(server) as channel:
            try:
                reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
                status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
                if status == "SERVING":
                    return status
            except grpc.RpcError as exc:
                status = exc.code().name
        time.sleep(0.2)
    return status if proc.poll() is None else f"{status} (specdec serve exited with {proc.returncode})"


def stop_serve(proc: subprocess.Popen) -> int | str:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(90)
        except subprocess.TimeoutExpired:
            proc.kill()
            return "killed"
    return proc.returncode


def main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    work = Path(spec["work"])
    out: dict[str, Any] = {"phases": {}}
    phases = out["phases"]
    (work / "ray-tmp").mkdir()
    Path("/tmp/ray").mkdir(exist_ok=True)
    subprocess.run(["mount", "--bind", str(work / "ray-tmp"), "/tmp/ray"], check=True)
    # The raylets the autoscaler starts, and their workers, inherit this environment: the project
    # under test comes first on the path, Ray's token auth is the test session's.
    os.environ.update(PYTHONPATH=spec["repo"], RAY_USAGE_STATS_ENABLED="0", **spec["ray_auth"])
    serve_log = work / "serve.log"
    cluster = SpecdecAutoscalingCluster(
        head_resources={"CPU": 1}, worker_node_types=spec["node_types"], idle_timeout_minutes=spec["idle_minutes"]
    )
    serve = None
    nodes = NodeWatch()
    t0 = time.time()
    try:
        cluster.start()
        import ray

        ray.init(address=GCS, logging_level="WARNING")
        nodes.start()
        phases["cluster_started"] = time.time() - t0
        with open(serve_log, "w") as log:
            serve = subprocess.Popen(
                ["specdec", "serve", "--config", spec["serve_config"], "--address", GCS],
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=spec["repo"],
            )
        t1 = time.time()
        out["serving"] = wait_serving(spec["server"], serve, time.monotonic() + spec["serve_timeout_s"])
        phases["serve_ready"] = time.time() - t1
        out["serve_ready_at"] = time.time()
        if out["serving"] == "SERVING":
            out["burst"] = burst(spec, serve_log)
            deadline = time.monotonic() + spec["settle_timeout_s"]
            while not (ok := settled(spec["metrics_port"], nodes, spec)) and time.monotonic() < deadline:
                time.sleep(0.5)
            out["settled"] = ok
            out["settled_at"] = time.time()
            out["metrics"] = metrics(spec["metrics_port"])
    finally:
        nodes.halt.set()
        out["serve_rc"] = stop_serve(serve) if serve is not None else None
        try:
            import ray

            ray.shutdown()
        except Exception:  # noqa: BLE001
            pass
        cluster.shutdown()
        own = set(ancestors())
        t2 = time.monotonic()
        while (left := leftovers(own)) and time.monotonic() - t2 < 30:
            time.sleep(1)
        out["leftovers"] = left
        out["nodes"] = nodes.samples
        text = serve_log.read_text(errors="replace") if serve_log.exists() else ""
        out["events"] = log_events(text)
        out["total_s"] = time.time() - t0
        (work / "result.json").write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
