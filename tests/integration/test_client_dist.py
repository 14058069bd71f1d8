"""`specdec-client` (clients/python): the gRPC clients, sync and asyncio, as a distribution of their own
that installs without torch, Ray, transformers or numpy.

The wheel is built from the repository's own modules, installed into a fresh venv (pip fetches
grpcio and protobuf, from its cache when warm), and both clients run from that venv's python, with
nothing of this checkout on its path, against a real router: a greedy generate equal to the same
request through the normal client. Broken variant: the installed client module importing torch (as
a careless edit would) makes the same run fail.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.service_fixture import running_service

REPO = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "ray", "transformers", "numpy")
PROMPT = "hello there"
N = 6

CLIENTS = """
import asyncio, json, sys
from specdec.rpc.client import SpecdecClient
from specdec.rpc.aio_client import AsyncSpecdecClient
from specdec.rpc.client_credentials import ClientCredentials

address, prompt, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
creds = ClientCredentials()
with SpecdecClient(address, credentials=creds) as client:
    sync = client.generate(prompt, max_tokens=n, temperature=0.0, ignore_eos=True, timeout=60)

async def run():
    async with AsyncSpecdecClient(address, credentials=creds) as client:
        whole = await client.generate(prompt, max_tokens=n, temperature=0.0, ignore_eos=True, timeout=60)
        chunks = [c async for c in client.generate_stream(prompt, max_tokens=n, temperature=0.0, ignore_eos=True)]
        return whole, chunks

whole, chunks = asyncio.run(run())
import specdec
print(json.dumps({
    "sync": sync.token_ids, "aio": whole.token_ids, "stream": [t for c in chunks for t in c.token_ids],
    "text": sync.text, "specdec": specdec.__file__,
    "heavy": sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "ray", "transformers", "numpy")),
}))
"""


@pytest.fixture(scope="module")
def svc(ray_cluster, actor_reaper, tiny_paths):
    with running_service(actor_reaper, tiny_paths) as svc:
        yield svc


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    """A fresh venv with the specdec-client wheel (and what it depends on) installed."""
    tmp = tmp_path_factory.mktemp("client")
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    build = [*pip, "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp), "clients/python"]
    subprocess.run(build, cwd=REPO, check=True, timeout=120)
    (wheel,) = tmp.glob("specdec_client-*.whl")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp / "venv")], check=True, timeout=60)
    python = tmp / "venv" / "bin" / "python"
    # this environment's pip installs into the new venv (no pip of its own to bootstrap); its cache
    subprocess.run([*pip, "--python", str(python), "install", "-q", str(wheel)], check=True, timeout=300)
    return python


def _clean_env() -> dict[str, str]:
    """No PYTHONPATH, no venv of ours: the venv's python sees only what was installed into it."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}


def _run(python: Path, address: str, tmp_path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(python), "-c", CLIENTS, address, PROMPT, str(N)],
        cwd=tmp_path, env=_clean_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_the_client_alone_installs_without_a_model_runtime_and_generates(venv, svc, tmp_path):
    found = subprocess.run(
        [str(venv), "-c", f"import importlib.util as u; print([m for m in {HEAVY!r} if u.find_spec(m)])"],
        cwd=tmp_path, env=_clean_env(), capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert found.stdout.strip() == "[]", found.stdout  # not installed at all, not just not imported
    run = _run(venv, svc.router.address, tmp_path)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert Path(out["specdec"]).is_relative_to(venv.parents[1]), "the venv's copy ran, not this checkout's"
    assert out["heavy"] == []
    ref = svc.client.generate(PROMPT, max_tokens=N, temperature=0.0, ignore_eos=True, timeout=60)
    assert out["sync"] == out["aio"] == out["stream"] == ref.token_ids and len(ref.token_ids) == N
    assert out["text"] == ref.text


def test_a_client_module_that_imports_torch_fails_there(venv, svc, tmp_path):
    """Broken variant: the venv's installed client.py with an `import torch` (a heavy import slipped in)."""
    site = subprocess.run(
        [str(venv), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        env=_clean_env(), capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    client = Path(site) / "specdec" / "rpc" / "client.py"
    original = client.read_text()
    future = "from __future__ import annotations\n"
    assert future in original
    client.write_text(original.replace(future, future + "import torch\n", 1))
    try:
        run = _run(venv, svc.router.address, tmp_path)
    finally:
        client.write_text(original)
    assert run.returncode != 0 and "No module named 'torch'" in run.stderr
