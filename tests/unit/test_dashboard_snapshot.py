"""scripts/dashboard_snapshot.py against a query_range API on loopback that answers each query with
a small matrix built here: every query of the dashboard (tests/promql.py reads them) is asked for
and drawn, in a panel titled as the dashboard's, and a query left without data is reported. The
broken variants: a dashboard with one query dropped draws a figure the check refuses, and a query
the API answers with no series makes ``--strict`` fail."""

from __future__ import annotations

import importlib.util
import json
import threading
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from copy import deepcopy
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tests.promql import DASHBOARD, REPO, dashboard_queries

RATE = "30s"
START, END, STEP = 1_700_000_000.0, 1_700_000_600.0, 10.0


def _script():
    spec = importlib.util.spec_from_file_location("dashboard_snapshot", REPO / "scripts" / "dashboard_snapshot.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


snapshot = _script()


def _matrix(query: str, start: float, end: float, step: float) -> list[dict]:
    """Two series per query over the range (a ramp and a constant), labelled as the legends expect."""
    times = [start + i * step for i in range(int((end - start) / step) + 1)]
    labels = {"model": "smollm2", "worker": "target-0", "role": "target", "signal": "compute", "action": "grow"}
    return [
        {"metric": {**labels, "instance": f"r{i}"}, "values": [[t, str((t - start) * (i + 1) / 600)] for t in times]}
        for i in range(2)
    ]


@contextmanager
def _query_api(no_data: frozenset[str] = frozenset()) -> Iterator[tuple[str, list[str]]]:
    """A loopback HTTP server with Prometheus' query_range answer; yields (its URL, the queries asked)."""
    asked: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            url = urllib.parse.urlparse(self.path)
            params = {k: v[0] for k, v in urllib.parse.parse_qs(url.query).items()}
            if url.path != "/api/v1/query_range":
                self.send_error(404)
                return
            query = params["query"]
            asked.append(query)
            result = [] if query in no_data else _matrix(query, *(float(params[k]) for k in ("start", "end", "step")))
            body = json.dumps({"status": "success", "data": {"resultType": "matrix", "result": result}}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", asked
    finally:
        server.shutdown()
        server.server_close()


def _expected() -> dict[str, set[str]]:
    """Panel title -> its queries as sent, from the dashboard file itself."""
    out: dict[str, set[str]] = {}
    for title, expr in dashboard_queries():
        out.setdefault(title, set()).add(expr.replace("$__rate_interval", RATE))
    return out


def _drawn(fig) -> dict[str, set[str]]:
    """Panel title -> the queries its lines were drawn from (each line's gid)."""
    return {ax.get_title("left"): {ln.get_gid() for ln in ax.get_lines()} for ax in fig.axes if ax.get_visible()}


def _assert_every_query_drawn(fig) -> None:
    assert _drawn(fig) == _expected()


def test_every_panel_and_query_is_drawn_from_the_api(tmp_path):
    dashboard = json.loads(DASHBOARD.read_text())
    with _query_api() as (url, asked):
        fig, empty = snapshot.render(dashboard, snapshot.prometheus_fetch(url, START, END, STEP), RATE, START)
    assert empty == []
    assert sorted(asked) == sorted(q for qs in _expected().values() for q in qs)
    _assert_every_query_drawn(fig)
    # two series per query, each named by its legend with the labels filled in, over the whole range
    throughput = next(ax for ax in fig.axes if ax.get_title("left") == "Throughput")
    labels = [ln.get_label() for ln in throughput.get_lines()]
    assert labels.count("requests/s smollm2") == 2 and labels.count("generated tokens/s") == 2
    xs = throughput.get_lines()[0].get_xdata()
    assert (xs[0], xs[-1]) == (0.0, 10.0)  # minutes from the start


def test_a_dropped_query_is_caught():
    dashboard = json.loads(DASHBOARD.read_text())
    broken = deepcopy(dashboard)
    panel = next(p for p in broken["panels"] if len(p.get("targets", [])) > 1)
    panel["targets"].pop()
    with _query_api() as (url, _):
        fig, _ = snapshot.render(broken, snapshot.prometheus_fetch(url, START, END, STEP), RATE, START)
    with pytest.raises(AssertionError):
        _assert_every_query_drawn(fig)


def test_the_command_writes_a_png_and_reports_queries_without_data(tmp_path, capsys):
    silent = dashboard_queries()[0][1].replace("$__rate_interval", RATE)
    out = tmp_path / "dashboard.png"
    args = ["--dashboard", str(DASHBOARD), "--out", str(out), "--rate-interval", RATE]
    args += ["--start", str(START), "--end", str(END), "--step", str(STEP)]
    with _query_api() as (url, _):
        assert snapshot.main(["--prometheus", url, "--strict", *args]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with _query_api(no_data=frozenset({silent})) as (url, _):
        assert snapshot.main(["--prometheus", url, *args]) == 0
        assert snapshot.main(["--prometheus", url, "--strict", *args]) == 1
    assert f"no data: Throughput: {silent}" in capsys.readouterr().err
