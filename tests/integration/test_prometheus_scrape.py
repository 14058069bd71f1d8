"""A real Prometheus scraping a running service's /metrics every second: after a short load, every
dashboard panel's query and every alert's inner expression (its threshold dropped) answers with at
least one series, and the alert rules evaluate without error in Prometheus itself."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.e2e.serve_process import free_port
from tests.integration.service_fixture import running_service
from tests.prometheus_server import prometheus
from tests.promql import alert_rules, dashboard_queries, inner_expression

# the dashboard's Grafana interval, as a window that holds a few of the test's 1 s scrapes
RATE_WINDOW = "30s"


@pytest.fixture(scope="module")
def scraped(actor_reaper, tiny_paths, tmp_path_factory):
    with running_service(actor_reaper, tiny_paths) as svc:
        metrics = f"127.0.0.1:{svc.router.router.metrics_port}"
        with prometheus([metrics], tmp_path_factory.mktemp("prometheus"), free_port()) as prom:
            prom.wait_up(1)
            prompts = [f"def f{i}(x):" for i in range(6)]
            with ThreadPoolExecutor(len(prompts)) as pool:
                results = list(
                    pool.map(lambda p: svc.client.generate(p, max_tokens=24, mode="draft", timeout=120), prompts)
                )
            assert all(r.finish_reason in ("stop", "length") for r in results)
            yield prom


def _answers(prom, expr: str, timeout: float = 20.0) -> list[dict]:
    """The series ``expr`` gives, waiting for the scrapes after the load (a few seconds at most)."""
    t_end = time.monotonic() + timeout
    while not (result := prom.query(expr)) and time.monotonic() < t_end:
        time.sleep(0.5)
    return result


def test_every_dashboard_query_answers(scraped):
    queries = dashboard_queries()
    empty = [
        (title, expr) for title, expr in queries if not _answers(scraped, expr.replace("$__rate_interval", RATE_WINDOW))
    ]
    assert not empty, f"{len(empty)} of {len(queries)} panel queries have no series: {empty}"


def test_every_alert_measures_something(scraped):
    rules = alert_rules()
    empty = [
        (r["alert"], inner_expression(r["expr"])) for r in rules if not _answers(scraped, inner_expression(r["expr"]))
    ]
    assert not empty, f"alerts whose inner expression has no series: {empty}"


def test_prometheus_evaluates_the_rules(scraped):
    t_end = time.monotonic() + 20
    while True:
        loaded = {r["name"]: r for g in scraped.api("rules")["groups"] for r in g["rules"]}
        if all(r.get("lastEvaluation", "").startswith("0001") is False for r in loaded.values()):
            break
        assert time.monotonic() < t_end, loaded
        time.sleep(0.5)
    assert set(loaded) == {r["alert"] for r in alert_rules()}
    assert {name: r["health"] for name, r in loaded.items()} == dict.fromkeys(loaded, "ok"), loaded
