"""The house's layers (docs/design.md, Rules of the house), checked by import-linter's contracts in pyproject.toml."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("specdec", "router", "cluster", "draft_worker", "target_worker", "gateway")
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def _lint_imports(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(LINT_IMPORTS), "--config", str(root / "pyproject.toml"), "--no-cache"],
        cwd=root,
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"},
    )


def test_contracts_hold() -> None:
    out = _lint_imports(REPO)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 broken" in out.stdout


@pytest.fixture
def scratch(tmp_path: Path) -> Path:
    """A copy of the packages and the contracts, to break on purpose."""
    for name in PACKAGES:
        shutil.copytree(REPO / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


@pytest.mark.parametrize(
    ("module", "bad_import", "contract"),
    [
        ("specdec/core/params.py", "import grpc", "The core imports no grpc"),
        ("specdec/core/ngram.py", "import router.config", "Layers"),
        ("router/validate.py", "import specdec.core.runner", "do not import torch"),
        ("draft_worker/servicer.py", "import target_worker.servicer", "Layers"),
        ("gateway/app.py", "import router.service", "Layers"),
        ("gateway/app.py", "import ray", "The HTTP gateway imports no torch"),
        ("specdec/core/adaptive_k.py", "import specdec.core.request_state", "No cycles"),
    ],
)
def test_a_bad_import_breaks_a_contract(scratch: Path, module: str, bad_import: str, contract: str) -> None:
    path = scratch / module
    path.write_text(path.read_text() + f"\n{bad_import}  # deliberately wrong\n")
    out = _lint_imports(scratch)
    assert out.returncode != 0
    broken = [line for line in out.stdout.splitlines() if line.endswith("BROKEN")]
    assert any(contract in line for line in broken), out.stdout


def test_the_cli_loads_no_grpc_until_it_needs_it() -> None:
    """`specdec` commands that do not talk to a server start without grpc (lazy imports)."""
    code = "import sys, specdec.cli; assert 'grpc' not in sys.modules and 'specdec.rpc' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_router_and_client_do_not_import_torch_ray_or_workers():
    code = (
        "import sys\n"
        "import router.server, router.scheduler, router.service, specdec.bench.serve, router.workers\n"
        "import specdec.rpc.client, cluster.config\n"
        "bad = [m for m in ('torch', 'ray', 'transformers', 'draft_worker', 'target_worker') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)
