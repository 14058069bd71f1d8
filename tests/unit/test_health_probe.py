"""specdec/rpc/health_probe.py, the exec probe for a router whose port has TLS or asks for a token:
SERVING only through the right CA, name, client certificate and token, over real gRPC."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from specdec.rpc.auth import PUBLIC_HEADER, Tokens, server_interceptor, server_tls
from specdec.rpc.health_probe import main
from specdec.rpc.server import set_serving, start_server, stop_server
from tests.pki import make_pki

REPO = Path(__file__).resolve().parents[2]
TOKEN = "t" * 32


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture
def serve(pki, tmp_path):
    """Start a health-only server: TLS always, mTLS and a token (health not exempt) on request."""
    started = []

    def start(mtls: bool = False, token: bool = False) -> tuple[str, object]:
        creds = server_tls(pki["server.crt"], pki["server.key"], pki["ca.crt"] if mtls else None)
        tokens_file = tmp_path / "tokens"
        tokens_file.write_text(TOKEN + "\n")
        interceptors = [server_interceptor(Tokens.load(tokens_file), PUBLIC_HEADER, exempt=())] if token else []
        server, port = start_server([], credentials=creds, interceptors=interceptors)
        started.append(server)
        return f"127.0.0.1:{port}", server

    yield start
    for server in started:
        stop_server(server, 0)


def probe(address: str, *args: str) -> int:
    return main(["--address", address, "--timeout", "5", *args])


def test_tls_needs_the_right_ca_and_name(serve, pki, tmp_path, capsys):
    address, _ = serve()
    assert probe(address, "--ca", str(pki["ca.crt"]), "--server-name", "localhost") == 0
    assert capsys.readouterr().out.strip() == "SERVING"
    # the first CA file that exists: a TLS Secret without ca.crt falls back to the next one
    assert probe(address, "--ca", str(tmp_path / "missing.crt"), "--ca", str(pki["ca.crt"])) == 0
    other = make_pki(tmp_path)
    assert probe(address, "--ca", str(other["ca.crt"]), "--server-name", "localhost") == 1
    assert probe(address, "--ca", str(pki["ca.crt"]), "--server-name", "specdec.default.svc") == 1
    assert probe(address) == 1  # plaintext against TLS (what the kubelet's grpc probe does)
    assert probe(address, "--ca", str(tmp_path / "missing.crt")) == 1
    assert "none of the CA files exists" in capsys.readouterr().out


def test_mtls_and_token(serve, pki, tmp_path, capsys):
    tls = ["--ca", str(pki["ca.crt"]), "--server-name", "localhost"]
    address, _ = serve(mtls=True)
    assert probe(address, *tls) == 1
    assert probe(address, *tls, "--cert", str(pki["client.crt"]), "--key", str(pki["client.key"])) == 0
    address, _ = serve(token=True)
    assert probe(address, *tls) == 1
    assert capsys.readouterr().out.split()[-1] == "UNAUTHENTICATED"
    (tmp_path / "probe-token").write_text(f"# the router's tokens file\n{TOKEN}\n")
    assert probe(address, *tls, "--token-file", str(tmp_path / "probe-token")) == 0
    assert probe(address, *tls, "--token-file", str(tmp_path / "no-such-file")) == 1
    assert capsys.readouterr().out.splitlines()[-1].startswith("probe not run: ")


def test_not_serving_fails_and_the_module_runs(serve, pki):
    address, server = serve()
    cmd = [sys.executable, "-m", "specdec.rpc.health_probe", "--address", address, "--ca", str(pki["ca.crt"])]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert (out.returncode, out.stdout.strip()) == (0, "SERVING"), out.stderr
    set_serving(server, False)
    assert probe(address, "--ca", str(pki["ca.crt"])) == 1
