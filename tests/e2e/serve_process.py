"""`specdec serve` as a user runs it: a subprocess from a YAML config, on free loopback ports, its
log in a file. Shared by the end-to-end tests of the command (tests/e2e/test_serve_*.py)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

REPO = Path(__file__).resolve().parents[2]
SPECDEC = [sys.executable, "-m", "specdec.cli"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cli_env() -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


@contextmanager
def serve_process(config: dict, tmp: Path, *, log_format: str = "json") -> Iterator[tuple[subprocess.Popen, object]]:
    """Start `specdec serve --config` (as from a user's shell: it makes its own worker secret and
    Ray token); yields (the process, its log file opened for reading and writing). Ends it with
    SIGTERM (then SIGKILL) if it still runs."""
    path = tmp / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    log = open(tmp / "serve.log", "w+")
    env = cli_env()
    for name in ("SPECDEC_WORKER_SECRET", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN"):
        env.pop(name, None)
    proc = subprocess.Popen(
        [*SPECDEC, "serve", "--config", str(path), "--log-format", log_format],
        cwd=REPO,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        yield proc, log
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(30)
        log.close()


def log_text(log) -> str:
    log.flush()
    log.seek(0)
    return log.read()


def wait_for_log(proc, log, needle: str, timeout: float) -> None:
    t_end = time.monotonic() + timeout
    while needle not in log_text(log):
        if proc.poll() is not None:
            pytest.fail(f"specdec serve exited with {proc.returncode}:\n{log_text(log)[-4000:]}")
        if time.monotonic() > t_end:
            pytest.fail(f"no {needle!r} in the log of specdec serve after {timeout:.0f} s:\n{log_text(log)[-4000:]}")
        time.sleep(0.2)


def wait_serving(proc, address: str, log, timeout: float) -> None:
    t_end = time.monotonic() + timeout
    with grpc.insecure_channel(address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while True:
            if proc.poll() is not None:
                pytest.fail(f"specdec serve exited with {proc.returncode}:\n{log_text(log)[-4000:]}")
            try:
                if (
                    stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status
                    == health_pb2.HealthCheckResponse.SERVING
                ):
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > t_end:
                pytest.fail(f"specdec serve not serving after {timeout:.0f} s:\n{log_text(log)[-4000:]}")
            time.sleep(0.5)
