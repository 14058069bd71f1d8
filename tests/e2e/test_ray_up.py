"""`ray up` end to end on this machine: cluster/local.yaml for a head at 127.0.0.1 and a worker at 127.0.0.2.

The whole cluster lives in its own PID, mount and network namespaces (``unshare``; `ray up` and
`ray down` run `ray stop` on their nodes, which must reach nothing outside), with sshd on both
loopback addresses and a fresh key (tests/e2e/ray_up_ns.py does the steps inside). The cluster
file is cluster/local.yaml with only what one machine and this test need changed, each change
checked to apply: the two addresses, the SSH user and key, the setup using this venv and
SmolLM2 (no pip, no network), the serve config (configs/cluster.yaml with SmolLM2 on CPU, placed
by the same custom resources), no `ray stop` on the worker (both "machines" are this one) and the
worker's Ray ports moved by PORT_SHIFT. The draft worker lands on the head by draft_gpu, the target
on the worker by target_gpu. Checked: the Generate call from outside returns the single-process
engine's greedy output, `ray exec` shows the service SERVING, and `ray down` leaves no Ray or
specdec process. Ray's token auth is on as the cluster files set it: the token file made once on
the machine `ray up` runs from (its own home, not the nodes') reaches every node through the
file's file_mounts, cluster/env.sh points Ray at it; a Ray client without it (`ray status`), or
`ray exec` with another token, is refused with Ray's InvalidAuthToken, and with it let in.
If the worker machine fails to start (on a loaded machine its raylet can miss
Ray's fixed 15 s wait for its dashboard agent, and the autoscaler never retries a local machine),
the run does what an operator would: `ray up` once more (and prints that it did). A failed
run keeps its logs in /tmp/specdec-ray-up-* (the failure message says where); a passing run
removes them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import SMOLLM, skip_for_environment

REPO = Path(__file__).resolve().parents[2]
SERVER = "127.0.0.1:50051"
PROMPT = "def fibonacci(n):"
MAX_TOKENS = 16
PORT_SHIFT = 1000  # the worker's Ray ports: both "machines" share one network namespace
TIMEOUT_S = 600  # the whole namespace run; inside: ray up 300 s, router serving 360 s after it starts
NS_CMD = ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc", "--net"]


def _swap(commands: list[str], marker: str, new: str) -> None:
    hits = [i for i, c in enumerate(commands) if marker in c]
    assert len(hits) == 1, f"expected one command with {marker!r} in {commands}"
    commands[hits[0]] = new


def _ports(command: str) -> dict[str, int]:
    return {flag: int(port) for flag, port in re.findall(r"(--[a-z-]+-port)=(\d+)", command)}


def _gcs_port(cluster_yaml: Path) -> int:
    head = " ".join(yaml.safe_load(cluster_yaml.read_text())["head_start_ray_commands"])
    return int(re.search(r"ray start --head .*--port=(\d+)", head)[1])


def cluster_variant(work: Path, venv: Path, serve_config: Path) -> dict:
    """cluster/local.yaml for a head at 127.0.0.1 and one worker at 127.0.0.2 (see the module doc)."""
    text = (REPO / "cluster" / "local.yaml").read_text()
    for example, loopback in (("10.0.0.10", "127.0.0.1"), ("10.0.0.11", "127.0.0.2")):
        assert example in text, example
        text = text.replace(example, loopback)
    cfg = yaml.safe_load(text)
    assert cfg["provider"] == {"type": "local", "head_ip": "127.0.0.1", "worker_ips": ["127.0.0.2"]}
    cfg["auth"] = {"ssh_user": "root", "ssh_private_key": str(work / "ssh" / "id_ed25519")}
    _swap(cfg["setup_commands"], "pip install", f"ln -sfn {venv} ~/specdec/.venv")
    _swap(cfg["setup_commands"], "models prepare", f"specdec models prepare -q {SMOLLM}")
    head = cfg["head_start_ray_commands"]
    _swap(head, "service.sh start", f"~/specdec/cluster/service.sh start --config {serve_config}")
    worker = cfg["worker_start_ray_commands"]
    assert worker[0] == "ray stop", worker
    del worker[0]  # it would stop the head too: same machine
    head_ports = _ports(" ".join(head))
    worker[-1] = re.sub(r"(--[a-z-]+-port)=(\d+)", lambda m: f"{m[1]}={int(m[2]) + PORT_SHIFT}", worker[-1])
    worker_ports = _ports(worker[-1])
    assert len(worker_ports) >= 7 and not set(worker_ports.values()) & set(head_ports.values())
    return cfg


def serve_variant() -> dict:
    """configs/cluster.yaml with SmolLM2 on CPU in both pools, placed by the same custom resources."""
    cfg = yaml.safe_load((REPO / "configs" / "cluster.yaml").read_text())
    for role in ("target", "draft"):
        pool = cfg[role]
        pool.update(model=SMOLLM, replicas=1, dtype="float32", device="cpu", num_slots=2, max_len=512, threads=1)
        pool["placement"] = {"resources": pool["placement"]["resources"]}  # no GPUs here
    cfg["router"]["port"] = int(SERVER.rsplit(":", 1)[1])
    # The file's draft deadline (0.5 s at most, scaled by the verify time) is sized for GPUs: SmolLM2
    # drafting on a loaded CPU can miss it every round, and the draft worker would never take part.
    cfg["router"].update(draft_deadline_s=5.0, draft_deadline_factor=0.0)
    cfg["security"] = {"allow_insecure": True}  # 0.0.0.0 without TLS and tokens: the namespace is its own network
    return cfg


def _skip_reason() -> str | None:
    if sys.platform != "linux" or os.geteuid() != 0:
        return "needs root on Linux (PID/mount/network namespaces, sshd)"
    for tool in ("unshare", "ip", "ssh", "ssh-keygen", "rsync"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (`make test` installs openssh-server and rsync as root)"
    if not os.access("/usr/sbin/sshd", os.X_OK):
        return "sshd is not installed (`make test` installs openssh-server as root)"
    probe = subprocess.run([*NS_CMD, "ip", "link", "set", "lo", "up"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"namespaces are not permitted here: {' '.join(NS_CMD)}: {probe.stderr.strip()}"
    return None


def _engine_output(env: dict) -> dict:
    """The single-process engine's greedy output (target alone) for the same request."""
    out = subprocess.run(
        [
            "specdec",
            "generate",
            "--target",
            SMOLLM,
            "--draft",
            "none",
            "--dtype",
            "float32",
            "--prompt",
            PROMPT,
            "--max-tokens",
            str(MAX_TOKENS),
            "--json",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def _tail(path: Path, n: int = 3000) -> str:
    return path.read_text(errors="replace")[-n:] if path.exists() else f"({path} is missing)"


def test_ray_up_local_cluster_serves_the_engine_output(smollm_path):
    reason = _skip_reason()
    if reason:
        skip_for_environment(reason)
    from specdec.core import packs

    venv = Path(sys.prefix)
    env = dict(
        os.environ,
        PYTHONPATH=str(REPO),
        PATH=f"{venv / 'bin'}:{os.environ['PATH']}",
        HF_HUB_OFFLINE="1",
    )
    expected = _engine_output(env)

    root = Path(tempfile.mkdtemp(prefix="specdec-ray-up-"))  # removed when the test passes, kept otherwise
    work = root / "work"
    work.mkdir()
    serve_config = work / "serve.yaml"
    serve_config.write_text(yaml.safe_dump(serve_variant(), sort_keys=False))
    cluster_yaml = work / "cluster.yaml"
    cluster_yaml.write_text(yaml.safe_dump(cluster_variant(work, venv, serve_config), sort_keys=False))
    spec = {
        "work": str(work),
        "repo": str(REPO),
        "venv": str(venv),
        "cache": str(packs.cache_root()),
        "cluster_yaml": str(cluster_yaml),
        "server": SERVER,
        "up_timeout_s": 300,
        "serve_timeout_s": 360,
        "leftover_wait_s": 30,
        "gcs_port": _gcs_port(cluster_yaml),
        "generate_args": ["--target", SMOLLM, "--prompt", PROMPT, "--max-tokens", str(MAX_TOKENS), "--json"],
    }
    (root / "spec.json").write_text(json.dumps(spec))

    t0 = time.monotonic()
    inner = f"ip link set lo up && {sys.executable} -m tests.e2e.ray_up_ns {root / 'spec.json'} & wait $!"
    with open(root / "namespace.log", "w") as log:
        try:
            rc = subprocess.run(
                [*NS_CMD, "bash", "-c", inner],
                cwd=REPO,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                timeout=TIMEOUT_S,
            ).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    elapsed = time.monotonic() - t0
    where = (
        f"kept in {root}: logs/ (one per command, sshd), ray-tmp/ (Ray's session logs), "
        f"home/.specdec/serve.log, result.json; ../namespace.log"
    )
    result_file = work / "result.json"
    if rc != 0 or not result_file.exists():
        logs = sorted((work / "logs").glob("*.log")) if (work / "logs").exists() else []
        last = f"{logs[-1].name}: {_tail(logs[-1])}" if logs else ""
        pytest.fail(
            f"the namespace run ended with {rc} after {elapsed:.0f} s\n{_tail(root / 'namespace.log')}\n{last}\n{where}"
        )
    result = json.loads(result_file.read_text())
    steps = result["steps"]
    again = ""
    if "ray_up_again" in steps:
        again = f" (then a second ray up, the worker having failed to start: {steps['ray_up_again']['s']} s)"
    print(
        f"ray up {steps['ray_up']['s']} s{again}, serving {steps.get('serving', {}).get('s')} s after ray up started, "
        f"ray down {steps['ray_down']['s']} s (+{result['leftovers_gone_after_s']} s until nothing ran), "
        f"whole namespace run {elapsed:.0f} s"
    )
    _check(result, expected, where)
    shutil.rmtree(root, ignore_errors=True)


def _check(result: dict, expected: dict, where: str) -> None:
    steps = result["steps"]

    def tail(step: str) -> str:
        return f"{step}: {steps[step]['output'][-3000:]}\n{where}"

    assert steps["ray_up"]["rc"] == 0, tail("ray_up")
    assert steps["serving"]["status"] == "SERVING", f"{steps['serving']}\n{result['serve_log'][-3000:]}\n{where}"
    # The draft on the head (draft_gpu), the target on the worker (target_gpu), each at its node's address.
    placed = result["serve_log"][-3000:] + where
    assert re.search(r"target workers ready at 127\.0\.0\.2:\d+", result["serve_log"]), placed
    assert re.search(r"draft workers ready at 127\.0\.0\.1:\d+", result["serve_log"]), placed

    assert steps["generate"]["rc"] == 0, tail("generate")
    remote = json.loads(steps["generate"]["output"][steps["generate"]["output"].index("{") :])
    for key in ("text", "token_ids", "finish_reason"):
        assert remote[key] == expected[key], f"{key}: {remote[key]!r} != the engine's {expected[key]!r}\n{where}"
    assert remote["stats"]["drafted"] > 0, remote["stats"]  # the draft worker on the other node took part

    assert steps["ray_exec_status"]["rc"] == 0, tail("ray_exec_status")
    assert f"{SERVER} SERVING" in steps["ray_exec_status"]["output"], tail("ray_exec_status")
    # Ray's view through `ray exec`: both machines joined, each with its pool's resource.
    status = steps["ray_exec_ray_status"]["output"]
    assert steps["ray_exec_ray_status"]["rc"] == 0 and "draft_gpu" in status and "target_gpu" in status, status
    # Ray's token auth: the operator's token file on the nodes (mode kept); refused without it.
    assert result["node_token"] == {"same": True, "mode": "0o600"}, result["node_token"]
    for step in ("ray_status_wrong_token", "ray_status_no_token"):
        refused = steps[step]
        assert refused["rc"] not in (0, "timeout") and "InvalidAuthToken" in refused["output"], tail(step)
    ok = steps["ray_status_token"]
    assert ok["rc"] == 0 and "draft_gpu" in ok["output"] and "target_gpu" in ok["output"], tail("ray_status_token")

    assert steps["ray_down"]["rc"] == 0, tail("ray_down")
    assert result["leftovers"] == [], f"still running after ray down: {result['leftovers']}\n{where}"
