"""What tests/e2e/test_ray_up.py runs inside its own PID, mount and network namespaces.

``python -m tests.e2e.ray_up_ns SPEC.json`` (as root, under ``unshare --pid --fork --mount-proc
--net``, with ``lo`` up): hides /tmp, /etc/passwd's home of root and the pack cache behind private
mounts, starts sshd on 127.0.0.1 and 127.0.0.2 with a fresh key, then does what a user does:
``ray up -y``, waits for the router, calls Generate from outside the cluster, ``ray exec`` the
service status, ``ray down -y``, and lists what still runs. Everything it sees goes to
``<work>/result.json`` (the test asserts on it); every command's output to ``<work>/logs/``.
The machine ``ray up`` runs from has its own home, ``<work>/client`` (the nodes': ``<work>/home``),
where the operator's step of cluster/README.md makes Ray's token (``~/.specdec/ray-token``): the
cluster file's file_mounts must carry it to the nodes, and a Ray client here is refused without it.
Ray's session logs stay in ``<work>/ray-tmp``. Teardown (``ray down``, sshd) is in ``finally``;
whatever survives dies with the namespace.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

SSH_ADDRESSES = ("127.0.0.1", "127.0.0.2")
# Command lines of processes that must be gone after `ray down` (Ray's own list, plus ours).
LEFTOVER_MARKERS = (
    "raylet",
    "gcs_server",
    "ray::",
    "default_worker.py",
    "monitor.py",
    "log_monitor.py",
    "dashboard",
    "runtime_env",
    "ray_process_reaper",
    "ray.util.client.server",
    "specdec",
)


def sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True)


def private_mounts(spec: dict, home: Path) -> None:
    """Nothing the cluster writes reaches the machine outside the namespace's mounts.

    /tmp becomes a tmpfs (Ray's state files, config cache and SSH control sockets live there); the
    paths the run needs that lay under the old /tmp (the work dir, and the checkout, its venv or the
    pack cache when they live there) are bound back at their own paths, and Ray's temp dir is bound
    to <work>/ray-tmp so the session logs outlive the namespace. root's home, for sshd and for `ray
    up`, is <work>/home (a private copy of /etc/passwd says so; /root itself stays, the venv's python
    lives there), and the pack cache is bound read-only at ~/.cache/specdec.
    """
    work = Path(spec["work"])
    old_tmp = Path("/mnt")
    sh("mount", "--bind", "/tmp", str(old_tmp))
    sh("mount", "-t", "tmpfs", "-o", "mode=1777", "tmpfs", "/tmp")
    kept: list[Path] = []
    for path in sorted({Path(os.path.realpath(spec[k])) for k in ("work", "repo", "venv", "cache")}):
        if path.is_relative_to("/tmp") and not any(path.is_relative_to(k) for k in kept):  # parents first
            kept.append(path)
            path.mkdir(parents=True, exist_ok=True)
            sh("mount", "--bind", str(old_tmp / path.relative_to("/tmp")), str(path))
    (work / "ray-tmp").mkdir(exist_ok=True)
    Path("/tmp/ray").mkdir()
    sh("mount", "--bind", str(work / "ray-tmp"), "/tmp/ray")

    passwd = work / "passwd"
    lines = Path("/etc/passwd").read_text().splitlines()
    passwd.write_text(
        "".join(
            (":".join(f[:5] + [str(home)] + f[6:]) if f[0] == "root" else line) + "\n"
            for line in lines
            for f in [line.split(":")]
        )
    )
    sh("mount", "--bind", str(passwd), "/etc/passwd")

    cache = home / ".cache" / "specdec"
    cache.mkdir(parents=True)
    sh("mount", "--bind", spec["cache"], str(cache))
    sh("mount", "-o", "remount,bind,ro", str(cache))


def start_sshd(work: Path) -> subprocess.Popen:
    """sshd on port 22 of both loopback addresses; fresh host and client keys (<work>/ssh/id_ed25519)."""
    d = work / "ssh"
    d.mkdir()
    sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / "host_key"))
    sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / "id_ed25519"))
    shutil.copy(d / "id_ed25519.pub", d / "authorized_keys")
    (d / "sshd_config").write_text(
        "\n".join(
            [
                "Port 22",
                *(f"ListenAddress {a}" for a in SSH_ADDRESSES),
                f"HostKey {d / 'host_key'}",
                f"AuthorizedKeysFile {d / 'authorized_keys'}",
                f"PidFile {d / 'sshd.pid'}",
                "PermitRootLogin prohibit-password",
                "PasswordAuthentication no",
                "KbdInteractiveAuthentication no",
                "UsePAM no",
                "StrictModes no",  # the work dir lies under /tmp (mode 1777)
                "MaxSessions 64",
                "MaxStartups 64",  # Ray's SSH multiplexing opens many sessions at once
                "LogLevel VERBOSE",
                "",
            ]
        )
    )
    Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # privilege separation directory
    with open(work / "logs" / "sshd.log", "w") as log:  # sshd keeps its own copy of the descriptor
        proc = subprocess.Popen(
            ["/usr/sbin/sshd", "-D", "-e", "-f", str(d / "sshd_config")], stdout=log, stderr=subprocess.STDOUT
        )
    deadline = time.monotonic() + 20
    for addr in SSH_ADDRESSES:
        while True:
            try:
                socket.create_connection((addr, 22), timeout=1).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"sshd did not listen on {addr}:22 (see logs/sshd.log)") from None
                time.sleep(0.2)
    return proc


class Runner:
    """Runs commands with the cluster client's environment; each one's output in logs/NN-name.log.

    No Ray token in that environment: the client holds it in a file only (``~/.specdec/ray-token``).
    """

    def __init__(self, spec: dict, home: Path):
        self.logs = Path(spec["work"]) / "logs"
        self.n = 0
        self.env = {
            "PATH": f"{Path(spec['venv']) / 'bin'}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "HOME": str(home),
            "USER": "root",
            "LANG": "C.UTF-8",
            "PYTHONPATH": spec["repo"],
            "RAY_USAGE_STATS_ENABLED": "0",
            "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
        }

    def __call__(self, name: str, cmd: list[str], timeout: float, env: dict | None = None) -> dict[str, Any]:
        self.n += 1
        log = self.logs / f"{self.n:02d}-{name}.log"
        t0 = time.monotonic()
        with open(log, "w") as f:
            try:
                rc = subprocess.run(
                    cmd,
                    stdout=f,
                    stderr=subprocess.STDOUT,
                    env={**self.env, **(env or {})},
                    cwd=self.env["PYTHONPATH"],
                    timeout=timeout,
                ).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        return {"rc": rc, "s": round(time.monotonic() - t0, 1), "log": str(log), "output": log.read_text()}


def worker_launch_failed() -> bool:
    """The autoscaler gave up on the worker machine (it never retries a local-provider node)."""
    log = Path("/tmp/ray/session_latest/logs/monitor.log")
    return log.exists() and "(launch failed)" in log.read_text(errors="replace")


def wait_serving(server: str, deadline: float) -> str:
    """The router's health once SERVING, or the last status at the deadline or when the worker failed."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    status = "UNAVAILABLE"
    with grpc.insecure_channel(server) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline and not worker_launch_failed():
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
                status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
                if status == "SERVING":
                    break
            except grpc.RpcError as exc:
                status = exc.code().name
            time.sleep(1)
    return status


def ancestors() -> list[int]:
    """This process and its parents up to the namespace's init (their command lines name the work dir)."""
    pids = [os.getpid()]
    while pids[-1] > 1:
        stat = Path(f"/proc/{pids[-1]}/stat").read_text()
        pids.append(int(stat.rsplit(")", 1)[1].split()[1]))
    return pids


def leftovers(own: set[int]) -> list[str]:
    """Live processes of the namespace (zombies aside) that belong to Ray or specdec."""
    found = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit() or int(p.name) in own:
            continue
        try:
            state = (p / "stat").read_text().rsplit(")", 1)[1].split()[0]
            args = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        if state != "Z" and any(m in args for m in LEFTOVER_MARKERS) and not args.startswith(("ssh", "/usr/sbin/sshd")):
            found.append(f"{p.name} {args[:200]}")
    return found


def main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    work = Path(spec["work"])
    home, client = work / "home", work / "client"
    result: dict[str, Any] = {"steps": {}}
    steps = result["steps"]
    out = work / "result.json"
    private_mounts(spec, home)
    (work / "logs").mkdir()
    (home / ".specdec").mkdir(parents=True)
    (home / ".bashrc").touch()
    # The nodes run the synced checkout (~/specdec) with the test machine's venv: no pip, no network.
    (home / ".specdec" / "env").write_text('export PYTHONPATH="$HOME/specdec"\n')
    # The operator's one step for Ray's token auth (cluster/README.md): a token file, mode 600.
    token_file = client / ".specdec" / "ray-token"
    token_file.parent.mkdir(parents=True)
    token_file.touch(mode=0o600)
    token_file.write_text(secrets.token_hex(32) + "\n")
    run = Runner(spec, client)
    with_token = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token_file)}
    gcs = f"{SSH_ADDRESSES[0]}:{spec['gcs_port']}"
    sshd = None
    config = spec["cluster_yaml"]
    try:
        sshd = start_sshd(work)
        up = ["ray", "up", "-y", "--no-config-cache", "--disable-usage-stats", "--log-color", "false", config]
        t0 = time.monotonic()
        deadline = t0 + spec["serve_timeout_s"]
        steps["ray_up"] = run("ray-up", up, timeout=spec["up_timeout_s"])
        if steps["ray_up"]["rc"] == 0:
            status = wait_serving(spec["server"], deadline)
            if status != "SERVING" and worker_launch_failed():
                # On a loaded machine a raylet can miss Ray's fixed 15 s wait for its dashboard agent;
                # the operator's remedy is a second `ray up` (it restarts the head and the autoscaler).
                steps["ray_up_again"] = run("ray-up-again", up, timeout=spec["up_timeout_s"])
                status = wait_serving(spec["server"], deadline)
            steps["serving"] = {"status": status, "s": round(time.monotonic() - t0, 1)}
        if steps.get("serving", {}).get("status") == "SERVING":
            steps["generate"] = run(
                "generate", ["specdec", "generate", "--server", spec["server"], *spec["generate_args"]], timeout=120
            )
            exec_ = ["ray", "exec", "--no-config-cache", "--log-color", "false", config]
            steps["ray_exec_status"] = run("ray-exec-status", [*exec_, "~/specdec/cluster/service.sh status"], 120)
            steps["ray_exec_ray_status"] = run("ray-exec-ray-status", [*exec_, "ray status"], 120)
            # Ray's token auth is on: a node's file is the operator's; a client without it, or with
            # another token, is refused; with it, let in.
            node_token = home / ".specdec" / "ray-token"
            result["node_token"] = {
                "same": node_token.is_file() and node_token.read_text() == token_file.read_text(),
                "mode": oct(node_token.stat().st_mode & 0o777) if node_token.is_file() else None,
            }
            steps["ray_status_wrong_token"] = run(
                "ray-status-wrong-token", [*exec_, "RAY_AUTH_TOKEN=0123456789abcdef ray status"], 120
            )
            steps["ray_status_no_token"] = run("ray-status-no-token", ["ray", "status", "--address", gcs], 120)
            steps["ray_status_token"] = run(
                "ray-status-token", ["ray", "status", "--address", gcs], 120, env=with_token
            )
    finally:
        serve_log = home / ".specdec" / "serve.log"
        result["serve_log"] = serve_log.read_text() if serve_log.exists() else ""
        steps["ray_down"] = run("ray-down", ["ray", "down", "-y", "--log-color", "false", config], timeout=240)
        own = {*ancestors(), *([sshd.pid] if sshd else [])}
        t1 = time.monotonic()
        result["leftovers_right_after_ray_down"] = left = leftovers(own)
        while left and time.monotonic() - t1 < spec["leftover_wait_s"]:
            time.sleep(1)
            left = leftovers(own)
        result["leftovers"] = left
        result["leftovers_gone_after_s"] = round(time.monotonic() - t1, 1)
        if sshd is not None:
            sshd.terminate()
            sshd.wait(10)
        out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
