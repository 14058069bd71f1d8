"""The top README stays a front page: at most 200 lines (detail goes to docs/, k8s/README.md,
cluster/README.md), yet it names every `specdec` command and every make target a user runs, and
its links lead to files that exist. Each rule also shown failing on a broken README."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from specdec.cli.main import _build_parser

REPO = Path(__file__).resolve().parents[2]
MAX_LINES = 200
MAKE_TARGETS = ("serve", "test", "test-slow", "bench")


def _commands() -> list[str]:
    (sub,) = [a for a in _build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return sorted(sub.choices)


def problems(text: str) -> list[str]:
    found = []
    if len(text.splitlines()) > MAX_LINES:
        found.append(f"{len(text.splitlines())} lines (at most {MAX_LINES})")
    found += [f"`specdec {c}` not named" for c in _commands() if not re.search(rf"\bspecdec {c}\b", text)]
    found += [f"`make {t}` not named" for t in MAKE_TARGETS if not re.search(rf"\bmake {t}(?![\w-])", text)]
    for link in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text):
        if "://" not in link and not (REPO / link).exists():
            found.append(f"link to {link}: no such file")
    return found


def readme() -> str:
    return (REPO / "README.md").read_text()


def test_the_readme_is_short_and_complete():
    assert problems(readme()) == []


@pytest.mark.parametrize(
    ("broken", "problem"),
    [
        (lambda t: t + "\n" * (MAX_LINES - len(t.splitlines()) + 1), "lines (at most 200)"),
        (lambda t: re.sub(r"\bspecdec plan\b", "specdec p1an", t), "`specdec plan` not named"),
        (lambda t: re.sub(r"\bmake test-slow\b", "make slow", t), "`make test-slow` not named"),
        (lambda t: t.replace("(docs/models.md)", "(docs/model.md)"), "link to docs/model.md: no such file"),
    ],
)
def test_a_broken_readme_is_reported(broken, problem):
    assert any(problem in p for p in problems(broken(readme()))), problems(broken(readme()))
