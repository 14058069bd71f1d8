"""The repository's PromQL, as the tests read it: the alert rules of k8s/specdec/files/alerts.yaml,
the dashboard's panel queries (k8s/specdec/files/dashboard.json), and an alert's inner expression
(its threshold comparisons dropped) that a live service must answer with series."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
ALERTS = REPO / "k8s" / "specdec" / "files" / "alerts.yaml"
ALERTS_TEST = REPO / "tests" / "unit" / "alerts_test.yaml"
DASHBOARD = REPO / "k8s" / "specdec" / "files" / "dashboard.json"

# `> 0.05`, `>= 2`, `< 0.5`: a comparison with a number (label matchers compare with strings)
_THRESHOLD = re.compile(r"\s*(?:==|!=|>=|<=|>|<)\s*(?:bool\s+)?[-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")


def alert_rules() -> list[dict]:
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    return [r for g in groups for r in g["rules"] if "alert" in r]


def inner_expression(expr: str) -> str:
    """``expr`` with every comparison against a number removed: what the alert measures."""
    return _THRESHOLD.sub("", expr)


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, query) for every target of every panel."""
    dash = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in dash["panels"] for t in p.get("targets", [])]
