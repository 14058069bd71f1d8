"""Real autoscaling on one machine: `specdec serve --address` on Ray's fake
multi-node autoscaler.

Inside its own PID, mount and network namespaces (``unshare``: the cluster's start and stop run
``ray stop --force``, which must reach nothing outside), tests/e2e/autoscaling_ns.py starts
``ray.cluster_utils.AutoscalingCluster`` (the real autoscaler, launching raylets on this machine
as nodes) with node types that mirror the real cluster: draft nodes offering ``draft_gpu`` (none
at the start: the first drafter's node is launched on demand) and target nodes offering
``target_gpu`` (one at the start). ``specdec serve --address`` (the real command) serves the tiny
models with router.scaling on; a burst of requests queues past ``scale_up_queue`` -> the router
adds a target replica, the actuator asks the autoscaler for a node, a new node joins, the new
actor serves requests (the draft pool grows too, on a draft node, when the policy finds its
drafter saturated: in some runs, not all; the test does not depend on it). The burst ends -> both
pools drain to their minimum (target 1, draft 0), the actors are retired and the autoscaler
removes the idle nodes. Every request's output is the target's greedy output (plain transformers
decoding); nothing is left running. The phases' times are printed (a JSON line; current
figures in docs/results.md, "Operations"). A failed run keeps its files in /tmp/specdec-autoscale-* (the failure message
says where); a passing run removes them.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import skip_for_environment

REPO = Path(__file__).resolve().parents[2]
SERVER = "127.0.0.1:50051"
METRICS_PORT = 9400
PROMPTS = ["def fib(n):", "hello world, ", "The quick brown fox", "import numpy as np\n"]
MAX_TOKENS = 16
PERIOD_S = 0.5  # the router's telemetry period (rebalance.period_s)
TIMEOUT_S = 900  # the whole namespace run: above its own waits (serving, burst, settling), which fail first
NS_CMD = ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc", "--net"]
NODE_TYPES = {
    "draft_node": {"resources": {"CPU": 1, "draft_gpu": 1}, "node_config": {}, "min_workers": 0, "max_workers": 2},
    "target_node": {"resources": {"CPU": 1, "target_gpu": 1}, "node_config": {}, "min_workers": 1, "max_workers": 2},
}


def _skip_reason() -> str | None:
    if sys.platform != "linux" or os.geteuid() != 0:
        return "needs root on Linux (PID/mount/network namespaces)"
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return "unshare or ip is not installed"
    probe = subprocess.run([*NS_CMD, "ip", "link", "set", "lo", "up"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"namespaces are not permitted here: {' '.join(NS_CMD)}: {probe.stderr.strip()}"
    return None


def serve_config(tiny_paths) -> dict:
    worker = {"dtype": "float32", "num_slots": 2, "max_len": 256, "threads": 1}
    return {
        "target": {"model": str(tiny_paths["llama"]), **worker, "placement": {"resources": {"target_gpu": 1}}},
        "draft": {"model": str(tiny_paths["llama-draft"]), **worker, "placement": {"resources": {"draft_gpu": 1}}},
        "router": {
            "port": int(SERVER.rsplit(":", 1)[1]),
            "metrics_port": METRICS_PORT,
            "metrics_host": "127.0.0.1",
            "micro_batches": 1,
            "rebalance": {"period_s": PERIOD_S},
            "scaling": {
                "enabled": True,
                "target": {"min_replicas": 1, "max_replicas": 2},
                "draft": {"min_replicas": 0, "max_replicas": 2},
                "scale_up_queue": 1,
                "up_samples": 1,
                "cooldown_s": 1.0,
                "scale_down_after_s": 6.0,
                "launch_timeout_s": 150,
            },
        },
    }


def _first(events: list, name: str, who: str | None = None) -> tuple[float, str] | None:
    return next(((t, r) for t, e, r in events if e == name and who in (None, r)), None)


def _growth(events: list, pool: str, start: float) -> dict | None:
    """A pool's scale-up, split: the policy's reaction (burst start -> decision), the node launch
    (the actuator's request -> a node of that pool joined), the actor's start (node -> gRPC serving)
    and the router's join (connect, tokenizer check). None if the pool did not grow."""
    up, joined = _first(events, f"scale_up_{pool}"), _first(events, f"joined_{pool}")
    if up is None or joined is None:
        return None
    node, actor = _first(events, "node_joined", joined[1]), _first(events, "actor_serving", joined[1])
    return {
        "policy_reaction_s": up[0] - start,
        "node_launch_s": None if node is None else node[0] - up[0],
        "actor_start_s": actor[0] - (node or up)[0],
        "router_join_s": joined[0] - actor[0],
    }


def figures(result: dict) -> dict:
    """Seconds of each phase (docs/results.md, "Operations"), from the serve log's timing lines and the node samples."""
    ev, b = result["events"], result["burst"]
    new_served = next(t for t, e, r in ev if e == "first_served" and "-as" in r)
    back = next((t for t, c in result["nodes"] if t > b["end"] and c == result["min_nodes"]), None)
    return {
        "target": _growth(ev, "target", b["start"]),
        "draft": _growth(ev, "draft", b["start"]),
        "first_served_by_new_replica_s": new_served - b["start"],
        "scale_down_replica_s": _first(ev, "removed_target")[0] - b["end"],
        "scale_down_nodes_s": None if back is None else back - b["end"],
    }


def _rounded(x):
    if isinstance(x, dict):
        return {k: _rounded(v) for k, v in x.items()}
    return None if x is None else round(x, 2)


def test_autoscaling_cluster_grows_and_shrinks_the_pools(tiny_paths):
    reason = _skip_reason()
    if reason:
        skip_for_environment(reason)
    from transformers import AutoTokenizer

    from tests.conftest import greedy_ids

    tok = AutoTokenizer.from_pretrained(tiny_paths["llama"])
    expected = [greedy_ids(tiny_paths["llama"], tok(p).input_ids, MAX_TOKENS) for p in PROMPTS]

    root = Path(tempfile.mkdtemp(prefix="specdec-autoscale-"))  # removed when the test passes
    (root / "serve.yaml").write_text(yaml.safe_dump(serve_config(tiny_paths), sort_keys=False))
    min_nodes = {"head": 1, "target": 1}
    spec = {
        "work": str(root),
        "repo": str(REPO),
        "serve_config": str(root / "serve.yaml"),
        "server": SERVER,
        "metrics_port": METRICS_PORT,
        "node_types": NODE_TYPES,
        "idle_minutes": 0.1,  # the autoscaler removes a node idle for 6 s
        "prompts": PROMPTS,
        "max_tokens": MAX_TOKENS,
        "concurrency": 6,
        "burst_max_s": 300,  # until a new replica serves: a node's launch and a worker's start on a loaded machine
        "serve_timeout_s": 180,
        "settle_timeout_s": 240,
        "min_replicas": {"target": 1, "draft": 0},
        "min_nodes": min_nodes,
        "ray_auth": {k: os.environ[k] for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN") if k in os.environ},
    }
    (root / "spec.json").write_text(json.dumps(spec))
    venv = Path(sys.prefix)
    env = dict(
        os.environ,
        PYTHONPATH=str(REPO),  # before the venv's editable install: the raylets' workers run this checkout
        PATH=f"{venv / 'bin'}:{os.environ['PATH']}",
        HF_HUB_OFFLINE="1",
    )
    inner = f"ip link set lo up && {sys.executable} -m tests.e2e.autoscaling_ns {root / 'spec.json'} & wait $!"
    t0 = time.monotonic()
    with open(root / "namespace.log", "w") as log:
        try:
            cmd = [*NS_CMD, "bash", "-c", inner]
            run = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=TIMEOUT_S)
            rc = run.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    elapsed = time.monotonic() - t0
    where = f"kept in {root}: serve.log, namespace.log, result.json, ray-tmp/ (Ray's session logs)"
    result_file = root / "result.json"
    if rc != 0 or not result_file.exists():
        tail = _tail(root / "namespace.log")
        pytest.fail(f"the namespace run ended with {rc} after {elapsed:.0f} s\n{tail}\n{where}")
    result = json.loads(result_file.read_text())
    result["min_nodes"] = min_nodes
    log_tail = _tail(root / "serve.log")
    assert result["serving"] == "SERVING", f"{result['serving']}\n{log_tail}\n{where}"

    burst = result["burst"]
    assert burst["errors"] == [], f"{burst['errors'][:5]}\n{where}"
    assert len(burst["results"]) >= 2 * spec["concurrency"], burst["results"]
    for p, token_ids, finish in burst["results"]:  # lossless across replica and node changes
        assert token_ids == expected[p] and finish == "length", f"prompt {p}: {token_ids} != {expected[p]}\n{where}"

    actions = [e for _, e, _ in result["events"]]
    assert "launch_failed" not in actions, f"{log_tail}\n{where}"
    # the target pool grew and both pools drained back (the draft pool grows too when its drafters
    # saturate: the figures say whether it did, the test does not depend on it)
    for action in ("scale_up_target", "joined_target", "drain_target", "removed_target", "removed_draft"):
        assert action in actions, f"no {action} in the serve log: {actions}\n{where}"
    assert result["settled"], f"the pools or the nodes did not shrink back: {result['nodes'][-3:]}\n{where}"
    m = result["metrics"]  # the same actions counted on /metrics
    for action in ("scale_up_target", "removed_target", "removed_draft"):
        assert m.get(f'specdec_rebalance_actions_total{{action="{action}"}}', 0) >= 1, m
    # the cluster grew: a target node joined for the new replica, beside the one at the start
    peak = max(c.get("target", 0) for _, c in result["nodes"])
    assert peak == 2, result["nodes"]
    assert result["nodes"][-1][1] == min_nodes, result["nodes"]
    assert result["leftovers"] == [], f"still running after the cluster stopped: {result['leftovers']}\n{where}"
    assert result["serve_rc"] == 0, f"specdec serve did not stop cleanly on SIGTERM: {result['serve_rc']}\n{where}"
    new = [r for _, e, r in result["events"] if e == "first_served" and "-as" in r]
    assert new, f"no replica added by the router served a request\n{where}"

    figs = figures(result)
    figs["target"]["policy_reaction_periods"] = figs["target"]["policy_reaction_s"] / PERIOD_S
    print("AUTOSCALING_FIGURES", json.dumps(_rounded(figs)))
    print(f"whole namespace run {elapsed:.0f} s; load average {os.getloadavg()}")
    assert figs["target"]["node_launch_s"] is not None, f"the new target replica found room without a new node\n{where}"
    shutil.rmtree(root, ignore_errors=True)


def _tail(path: Path, n: int = 4000) -> str:
    return path.read_text(errors="replace")[-n:] if path.exists() else f"({path} is missing)"
