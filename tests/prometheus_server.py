"""A real Prometheus (Debian's binary) for tests: scraping given /metrics targets every second,
with the repository's alert rules loaded, its data in a temporary folder, on a free loopback port.
The process is this test's own and is ended (SIGTERM, then SIGKILL) when the context exits."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import yaml

from tests.conftest import skip_for_environment
from tests.promql import ALERTS


class Prometheus:
    def __init__(self, url: str, proc: subprocess.Popen, log: Path):
        self.url, self.proc, self.log = url, proc, log

    def api(self, path: str, **params: str) -> dict:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}{query}", timeout=10) as resp:
            body = json.load(resp)
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        """The instant vector ``expr`` gives now (an error in ``expr`` fails the test)."""
        return self.api("query", query=expr)["result"]

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict]:
        return self.api("query_range", query=expr, start=str(start), end=str(end), step=str(step))["result"]

    def wait_up(self, jobs: int, timeout: float = 30.0) -> None:
        """Until ``jobs`` targets have been scraped healthy."""
        t_end = time.monotonic() + timeout
        while True:
            try:
                active = self.api("targets")["activeTargets"]
                if sum(t["health"] == "up" for t in active) >= jobs:
                    return
            except OSError:
                active = "not answering"
            if self.proc.poll() is not None or time.monotonic() > t_end:
                raise AssertionError(f"prometheus targets not up: {active}\n{self.log.read_text()[-3000:]}")
            time.sleep(0.2)


@contextmanager
def prometheus(targets: list[str], tmp: Path, port: int) -> Iterator[Prometheus]:
    """Prometheus scraping ``targets`` (host:port, path /metrics) every second."""
    binary = shutil.which("prometheus")
    if binary is None:
        skip_for_environment("prometheus is not installed (make sysdeps installs Debian's prometheus)")
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(ALERTS)],
        "scrape_configs": [{"job_name": "specdec", "static_configs": [{"targets": targets}]}],
    }
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    log = tmp / "prometheus.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [
                binary,
                f"--config.file={tmp / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        yield Prometheus(f"http://127.0.0.1:{port}", proc, log)
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
