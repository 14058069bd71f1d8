"""`specdec-client` (clients/python) stays in step with the code it packages, without building it (the
build, install and run are tests/integration/test_client_dist.py's):

* its module list is exactly what the two client modules import of specdec (a module added to
  their imports and not to the list would be missing from the wheel; one listed and not imported
  would ship dead weight, or torch-bound code);
* its dependencies are the service's own pins for those packages, and nothing else.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CLIENT = REPO / "clients" / "python"


def _listed() -> set[str]:
    """``CLIENT_MODULES`` of clients/python/setup.py, as dotted module names."""
    tree = ast.parse((CLIENT / "setup.py").read_text())
    (value,) = [n.value for n in tree.body if isinstance(n, ast.Assign) and n.targets[0].id == "CLIENT_MODULES"]
    modules = ast.literal_eval(value)
    return {pkg if m == "__init__" else f"{pkg}.{m}" for pkg, names in modules.items() for m in names}


def _imported() -> set[str]:
    code = (
        "import sys, specdec.rpc.client, specdec.rpc.aio_client; "
        "print(' '.join(m for m in sys.modules if m == 'specdec' or m.startswith('specdec.')))"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True, check=True)
    return set(out.stdout.split())


def check_modules(listed: set[str], imported: set[str]) -> None:
    assert not imported - listed, f"imported by the clients, not in the wheel: {sorted(imported - listed)}"
    assert not listed - imported, f"in the wheel, imported by neither client: {sorted(listed - imported)}"


def test_the_wheel_holds_what_the_clients_import():
    check_modules(_listed(), _imported())


@pytest.mark.parametrize("broken", ["a module missing", "a module extra"])
def test_a_module_list_out_of_step_fails(broken):
    listed = _listed()
    listed = listed - {"specdec.rpc.convert"} if broken == "a module missing" else listed | {"specdec.core.engine"}
    with pytest.raises(AssertionError):
        check_modules(listed, _imported())


def _pins(pyproject: Path) -> dict[str, str]:
    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    return {d.split("=")[0].split(">")[0].split("<")[0].split("[")[0].strip(): d for d in deps}


def test_the_clients_dependencies_are_the_services_pins():
    client, service = _pins(CLIENT / "pyproject.toml"), _pins(REPO / "pyproject.toml")
    assert set(client) == {"grpcio", "grpcio-health-checking", "grpcio-status", "protobuf"}
    assert {name: service[name] for name in client} == client
