"""cluster/service.sh restarts the router on a `ray up` head when it dies, while Ray runs there: a
real `specdec serve --address auto` is started through the script, killed with SIGKILL (a crash,
the kernel's OOM killer), and must come back under a new pid; once Ray is gone from the node (`ray
stop` removes Ray's address file) a dead router stays dead, so `ray down` leaves nothing running;
`stop` ends it for good. A copy of the script whose supervisor runs the service only once fails the
same check.

No Ray cluster runs here: the node's Ray state is Ray's own address file (RAY_TMPDIR/ray/
ray_current_cluster, what `ray start --head` writes and `ray stop` removes), naming an address where
nothing listens, so `specdec serve` stays in its wait for the GCS (RAY_gcs_rpc_server_reconnect_timeout_s)
long enough to be killed, as a router waiting for its head does. It needs the SmolLM2 pack prepared
(`specdec models prepare smollm2-135m-instruct`): `specdec serve` checks the packs first.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specdec.core.packs import is_ready

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "cluster" / "service.sh"
PACK = "smollm2-135m-instruct"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pid(state: Path) -> int | None:
    """The live `specdec serve` the script's pid file names, or None."""
    try:
        pid = int((state / "serve.pid").read_text())
        return pid if b"specdec" in Path(f"/proc/{pid}/cmdline").read_bytes() else None
    except (OSError, ValueError):
        return None


def _replaced(state: Path, old: int, wait_s: float) -> int | None:
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and _pid(state) in (None, old):
        time.sleep(0.5)
    new = _pid(state)
    return new if new != old else None


def check_restarts(script: Path, tmp_path: Path, wait_s: float = 30.0) -> None:
    """Start; kill the service: a new one; Ray gone, kill it: none; stop."""
    state, ray_tmp = tmp_path / "state", tmp_path / "ray-tmp"
    address_file = ray_tmp / "ray" / "ray_current_cluster"
    address_file.parent.mkdir(parents=True)
    address_file.write_text(f"127.0.0.1:{_free_port()}")  # nothing listens: serve waits there for the GCS
    config = tmp_path / "serve.yaml"
    config.write_text(f"target: {{model: {PACK}, device: cpu}}\ndraft: {{model: ngram}}\n")
    env = dict(
        os.environ,
        SPECDEC_STATE_DIR=str(state),
        SPECDEC_RESTART_DELAY_S="1",
        RAY_TMPDIR=str(ray_tmp),
        RAY_gcs_rpc_server_reconnect_timeout_s="60",
        PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        PYTHONPATH=str(REPO),
    )

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", str(script), *args], env=env, capture_output=True, text=True, timeout=150)

    out = run("start", "--config", str(config))
    assert out.returncode == 0, out.stdout + out.stderr
    try:
        first = _pid(state)
        assert first, "not running after start"
        os.kill(first, signal.SIGKILL)
        second = _replaced(state, first, wait_s)
        assert second, "the service was not restarted after it died"
        address_file.unlink()  # what `ray stop` does
        os.kill(second, signal.SIGKILL)
        assert _replaced(state, second, 3.0) is None, "restarted with no Ray on the node"
        deadline = time.monotonic() + 60
        while (state / "supervisor.pid").exists() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not (state / "supervisor.pid").exists(), "the supervisor outlives Ray"
    finally:
        out = run("stop")
    assert out.returncode == 0, out.stdout + out.stderr
    assert _pid(state) is None, "running after stop"


@pytest.fixture(autouse=True)
def _pack_prepared():
    if not is_ready(PACK):
        pytest.skip(f"needs the {PACK} pack: specdec models prepare {PACK}")


def test_a_dead_router_is_restarted_while_ray_runs(tmp_path):
    check_restarts(SCRIPT, tmp_path)


def _broken_copy(tmp_path: Path, old: str, new: str) -> Path:
    text = SCRIPT.read_text()
    assert old in text
    copy = tmp_path / "cluster" / "service.sh"
    copy.parent.mkdir()
    copy.write_text(text.replace(old, new))
    (copy.parent / "env.sh").write_text((REPO / "cluster" / "env.sh").read_text())
    return copy


def test_a_supervisor_that_runs_once_fails_the_check(tmp_path):
    loop = 'while [ ! -e "$stopfile" ]; do'
    once = _broken_copy(tmp_path, loop, 'while [ ! -e "$stopfile" ] && [ ! -e "$exitsfile" ]; do')
    with pytest.raises(AssertionError, match="not restarted"):
        check_restarts(once, tmp_path, wait_s=8.0)


def test_a_supervisor_that_ignores_ray_fails_the_check(tmp_path):
    blind = _broken_copy(tmp_path, "if ! ray_here; then", "if false; then")
    with pytest.raises(AssertionError, match="no Ray on the node"):
        check_restarts(blind, tmp_path)
