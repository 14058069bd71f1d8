"""The image: the Dockerfile passes hadolint and the image rules (python:3.11-slim, the package
installed, no model weights), and broken variants fail them."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def hadolint(path: Path) -> subprocess.CompletedProcess:
    exe = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    assert exe, "hadolint not found: install the dev extra (pip install -e '.[dev]')"
    return subprocess.run([exe, "--no-color", str(path)], capture_output=True, text=True, timeout=60)


def check_image_rules(text: str) -> None:
    froms = re.findall(r"^FROM\s+(\S+)", text, flags=re.M)
    assert froms == ["python:3.11-slim"], f"base images {froms}"
    joined = re.sub(r"\\\n(\s*#.*\n)*", " ", text)  # continuation lines (and comments between them)
    runs = " ".join(re.findall(r"^RUN\s+(.*)$", joined, flags=re.M))
    assert "pip install" in runs and "./src" in runs, "the image installs the package"
    assert not re.search(r"models\s+prepare|\.gguf|safetensors", runs), "no model weights in the image"


def test_dockerfile():
    result = hadolint(REPO / "Dockerfile")
    assert result.returncode == 0, result.stdout + result.stderr
    check_image_rules((REPO / "Dockerfile").read_text())
    ignored = [
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert not {"pyproject.toml", "README.md", "specdec", "router", "cluster"} & set(ignored)


@pytest.mark.parametrize(
    "edit", [("FROM python:3.11-slim", "FROM python"), ("WORKDIR /home/specdec", "RUN cd /home/specdec")]
)
def test_broken_dockerfile_fails_hadolint(tmp_path, edit):
    broken = tmp_path / "Dockerfile"
    broken.write_text((REPO / "Dockerfile").read_text().replace(*edit))
    assert hadolint(broken).returncode != 0


@pytest.mark.parametrize(
    "edit",
    [
        ("FROM python:3.11-slim", "FROM python:3.12-slim"),
        ("&& rm -rf src", "&& specdec models prepare qwen2.5-coder-1.5b-instruct"),
    ],
)
def test_broken_dockerfile_fails_image_rules(edit):
    text = (REPO / "Dockerfile").read_text()
    assert edit[0] in text
    with pytest.raises(AssertionError):
        check_image_rules(text.replace(*edit))
