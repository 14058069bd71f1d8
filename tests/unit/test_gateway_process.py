"""The gateway `specdec serve` starts (cluster/gateway_process.py) does not outlive it: when its parent
is killed outright (SIGKILL, or its Ray driver aborting when `ray down` stops the GCS), the gateway
stops too, so no HTTP port is left serving a router that is gone. Real processes, a real uvicorn."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.e2e.serve_process import free_port

REPO = Path(__file__).resolve().parents[2]

PARENT = """
import sys
from cluster.gateway_process import start_gateway
from specdec.rpc.api_security import SecurityConfig
gw = start_gateway("127.0.0.1:1", "127.0.0.1", int(sys.argv[1]), SecurityConfig())
print(gw.proc.pid, flush=True)
sys.stdin.read()  # until killed
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie (not yet reaped by init) is gone as a server
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def test_the_gateway_stops_when_serve_is_killed():
    env = dict(os.environ, PYTHONPATH=str(REPO))
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(free_port())],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    gateway = None
    try:
        gateway = int(parent.stdout.readline())
        assert _alive(gateway)
        parent.send_signal(signal.SIGKILL)
        parent.wait(30)
        t_end = time.monotonic() + 30
        while _alive(gateway):
            assert time.monotonic() < t_end, "the gateway still runs 30 s after its parent was killed"
            time.sleep(0.1)
    finally:
        parent.kill()
        if gateway is not None and _alive(gateway):
            os.kill(gateway, signal.SIGKILL)
