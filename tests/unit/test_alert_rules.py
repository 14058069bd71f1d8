"""The alert rules (k8s/specdec/files/alerts.yaml) through Prometheus' own promtool: the file
loads, and every alert fires on its unit case in tests/unit/alerts_test.yaml (and stays quiet on
the healthy series beside it)."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from tests.conftest import skip_for_environment
from tests.promql import ALERTS, ALERTS_TEST, alert_rules, inner_expression


@pytest.fixture(scope="module")
def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        skip_for_environment("promtool is not installed (make sysdeps installs Debian's prometheus)")
    return path


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=120)


def test_the_rules_file_is_valid(promtool):
    out = _run(promtool, "check", "rules", str(ALERTS))
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(alert_rules())} rules found" in out.stdout


def test_every_alert_fires_on_its_unit_case(promtool):
    out = _run(promtool, "test", "rules", str(ALERTS_TEST))
    assert out.returncode == 0, out.stdout + out.stderr
    tested = {line.split(":", 1)[1].strip() for line in ALERTS_TEST.read_text().splitlines() if "alertname:" in line}
    assert tested == {r["alert"] for r in alert_rules()}


def test_an_inner_expression_keeps_the_measure_and_drops_the_thresholds():
    expr = 'avg by (w) (m{role="target"}) < 0.5 and on () sum(q) > 0'
    assert inner_expression(expr) == 'avg by (w) (m{role="target"}) and on () sum(q)'
    quantile = "histogram_quantile(0.99, sum by (le) (rate(x_bucket[5m]))) >= 2e0"
    assert inner_expression(quantile) == "histogram_quantile(0.99, sum by (le) (rate(x_bucket[5m])))"
