"""The gateway's own accounts, without a router behind it (a real `python -m gateway` process, real
HTTP over loopback): a request it refuses itself writes one access line in the router's shape, and
its /metrics counts requests by endpoint and status; `specdec bench serve` reads the own-work
histograms of that exposition into p50 / p99 (specdec/bench/serve_http.py). The routed half (times
of requests and chunks that went through the router) is tests/integration/test_http_api.py's."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import httpx
import pytest

from cluster.gateway_process import start_gateway
from gateway.metrics import GatewayMetrics
from specdec.bench.serve_http import gateway_cost, histogram_quantile, parse_gateway_metrics
from specdec.rpc.api_security import SecurityConfig
from tests.access_lines import check_refusal_line
from tests.e2e.serve_process import free_port

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    """A gateway whose router is nowhere (port 1): whatever it answers, it answers itself."""
    log_path = tmp_path_factory.mktemp("gw") / "gateway.log"
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    with open(log_path, "w") as log:
        gw = start_gateway("127.0.0.1:1", "127.0.0.1", port, SecurityConfig(), log_format="json", env=env, stderr=log)
        try:
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
                yield client, log_path
        finally:
            gw.stop()


def _line(log_path: Path, request_id: str) -> dict:
    t_end = time.monotonic() + 60
    while True:
        lines = [json.loads(x) for x in log_path.read_text().splitlines() if x.startswith("{")]
        found = [x for x in lines if x["logger"] == "specdec.access" and x.get("request_id") == request_id]
        if found or time.monotonic() > t_end:
            assert len(found) == 1, lines
            return found[0]
        time.sleep(0.05)


REFUSALS = [  # (request id, method, path, body, status, OpenAI code)
    ("own-n", "POST", "/v1/completions", {"model": "m", "prompt": "x", "n": 2}, 400, "unsupported_parameter"),
    ("own-json", "POST", "/v1/chat/completions", b"{oops", 400, "invalid_json"),
    ("own-route", "GET", "/v1/nowhere", None, 404, "not_found"),
    ("own-method", "GET", "/v1/completions", None, 405, "invalid_request_error"),
]


def _send(client: httpx.Client, rid: str, method: str, path: str, body) -> httpx.Response:
    content = body if isinstance(body, bytes) else None
    payload = body if isinstance(body, dict) else None
    return client.request(method, path, json=payload, content=content, headers={"x-request-id": rid})


@pytest.mark.parametrize("rid, method, path, body, status, code", REFUSALS)
def test_a_refusal_of_its_own_writes_one_access_line(gateway, rid, method, path, body, status, code):
    client, log_path = gateway
    resp = _send(client, rid, method, path, body)
    assert resp.status_code == status and resp.json()["error"]["code"] == code
    assert resp.headers["x-request-id"] == rid
    line = _line(log_path, rid)
    check_refusal_line(line, rid, status, code)
    assert line["rpc"] == f"{method} {path}"


BROKEN = {
    "no request id": lambda x: {**x, "request_id": None},
    "a field renamed": lambda x: {k if k != "total_ms" else "duration_ms": v for k, v in x.items()},
    "a field of its own": lambda x: {**x, "path": "/v1/completions"},
    "the HTTP status as status": lambda x: {**x, "status": 400},
    "no error code": lambda x: {**x, "error_code": None},
    "text format, not JSON": lambda x: {k: v for k, v in x.items() if k not in ("time", "level", "logger")},
}


@pytest.mark.parametrize("broken", BROKEN)
def test_a_broken_refusal_line_fails_the_check(gateway, broken):
    client, log_path = gateway
    rid = "own-broken-" + broken.replace(" ", "-").replace(",", "")
    _send(client, rid, "POST", "/v1/completions", b"[")
    line = _line(log_path, rid)
    check_refusal_line(line, rid, 400, "invalid_json")
    with pytest.raises(AssertionError):
        check_refusal_line(BROKEN[broken](line), rid, 400, "invalid_json")


def test_metrics_count_requests_by_endpoint_and_status(gateway):
    client, _ = gateway
    before = parse_gateway_metrics(client.get("/metrics").text)
    for i in range(3):
        _send(client, f"count-{i}", "POST", "/v1/completions", b"nope")
    _send(client, "count-route", "GET", "/favicon.ico", None)
    resp = client.get("/metrics")
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    after = parse_gateway_metrics(resp.text)
    got = {k: v - before["requests"].get(k, 0.0) for k, v in after["requests"].items()}
    assert got[("/v1/completions", "400")] == 3
    assert got[("other", "404")] == 1  # an unknown path is no series of its own
    assert got[("/metrics", "200")] == 1
    # none of them reached the router: no own-work time
    assert after["request"]["count"] == before["request"]["count"] == 0 and after["chunk"]["count"] == 0


def _cost_of(metrics: GatewayMetrics, before: dict) -> dict:
    return gateway_cost(before, parse_gateway_metrics(metrics.exposition().decode()))


def test_the_bench_reads_p50_and_p99_of_the_own_work_from_a_scrape():
    metrics = GatewayMetrics()
    metrics.request_seconds.observe(0.09)  # before the scenario: not its own
    before = parse_gateway_metrics(metrics.exposition().decode())
    for _ in range(98):
        metrics.request_seconds.observe(0.0008)
    for _ in range(2):
        metrics.request_seconds.observe(0.04)
    for _ in range(10):
        metrics.chunk_seconds.observe(0.0001)
    cost = _cost_of(metrics, before)
    # Prometheus's histogram_quantile: linear within the bucket the rank falls in
    assert cost["requests"] == 100 and cost["chunks"] == 10
    assert cost["ms_per_request_p50"] == pytest.approx(0.75 + 0.25 * 50 / 98, abs=1e-3)
    assert cost["ms_per_request_p99"] == pytest.approx(20 + 30 * 1 / 2, abs=1e-3)
    assert cost["ms_per_chunk_p50"] == pytest.approx(0.05 + 0.05 * 5 / 10, abs=1e-3)
    assert gateway_cost(None, before) is None  # no scrape before: no cost, not a wrong one


def test_the_bench_cost_of_a_broken_scrape_is_not_mistaken():
    """A scrape without the series (a gateway without /metrics' histograms, renamed series) gives no
    quantiles: the check that the cost is there fails rather than reading zeros."""
    metrics = GatewayMetrics()
    before = parse_gateway_metrics(metrics.exposition().decode())
    metrics.request_seconds.observe(0.001)
    renamed = metrics.exposition().decode().replace("specdec_gateway_request_seconds", "gateway_seconds")
    cost = gateway_cost(before, parse_gateway_metrics(renamed))
    assert cost["requests"] == 0 and cost["ms_per_request_p50"] is None
    assert histogram_quantile(0.5, {}) is None and histogram_quantile(0.5, {float("inf"): 0.0}) is None
    assert histogram_quantile(0.99, {0.001: 1.0, float("inf"): 2.0}) == 0.001  # past the last bound: the bound
