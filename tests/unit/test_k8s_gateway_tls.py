"""The chart's gateway under TLS, mTLS and a token on health (k8s/specdec/templates/gateway.yaml).

* Every file its arguments and its readiness probe name lies in a Secret mounted read-only into the
  gateway container; with mTLS its HTTPS port asks for client certificates from the client CA and
  it shows the router a certificate (gateway.clientTLSSecretName's, else the API's own); under mTLS
  or a token on health the readiness probe is an exec of gateway.health_probe with what it needs.
* Run for real: a gRPC server set up from the rendered serve config (mTLS, a token on health) over
  certificates laid out like the Secrets, the gateway started with its rendered arguments, and the
  rendered probe: ready; without the client certificate or the token: not.
* Broken copies fail the check: a file outside the mounts, an httpGet probe under mTLS, no client CA.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gateway.health_probe import main as gateway_probe
from specdec.rpc.api_security import EXEMPT_PREFIXES
from specdec.rpc.auth import PUBLIC_HEADER, server_interceptor
from specdec.rpc.server import start_server, stop_server
from tests.e2e.serve_process import free_port
from tests.unit.test_k8s_api_security import _lay_out, _parts
from tests.unit.test_k8s_manifests import HEALTH_SERVICE, _container, rendered

REPO = Path(__file__).resolve().parents[2]
FILE_FLAGS = ("--tls-cert", "--tls-key", "--tls-client-ca", "--router-ca", "--router-cert", "--router-key")
PROBE_FILE_FLAGS = ("--ca", "--cert", "--key", "--token-file")
OWN_CLIENT_SECRET = "specdec-gateway-client"


def _gateway(docs: list[dict]) -> tuple[dict, dict]:
    (gw,) = [d for d in docs if d["kind"] == "Deployment"]
    template = gw["spec"]["template"]
    return _container(template, "gateway"), template["spec"]


def _secret_dirs(container: dict, pod: dict) -> dict[str, str]:
    secrets = {v["name"]: v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v}
    return {
        m["mountPath"]: secrets[m["name"]]
        for m in container["volumeMounts"]
        if m["name"] in secrets and m.get("readOnly")
    }


def _files(args: list[str], flags: tuple[str, ...]) -> list[tuple[str, str]]:
    return [(f, v) for f, _, v in (a.partition("=") for a in args) if f in flags]


def check_gateway_tls(docs: list[dict]) -> None:
    sec = _parts(docs)[0]  # the router's security, from the rendered serve config
    c, pod = _gateway(docs)
    dirs = _secret_dirs(c, pod)
    probe = c["readinessProbe"]
    command = probe.get("exec", {}).get("command", [])
    for flag, path in _files(c["args"], FILE_FLAGS) + _files(command, PROBE_FILE_FLAGS):
        assert any(Path(path).parent == Path(d) for d in dirs), f"{flag}={path}: in no Secret mounted into the gateway"
    flags = {f for f, _ in _files(c["args"], FILE_FLAGS)}
    assert ("--tls-cert" in flags) == sec.tls, "HTTPS exactly when the gRPC API has TLS"
    mtls = bool(sec.tls_client_ca)
    assert {"--tls-client-ca", "--router-cert", "--router-key"} <= flags if mtls else not flags & {"--tls-client-ca"}
    token_on_health = sec.token_auth and "health" not in sec.exempt
    if mtls or token_on_health:
        assert "httpGet" not in probe, "the kubelet has no client certificate and cannot read the token"
        assert command[:3] == ["python", "-m", "gateway.health_probe"], command
        probe_flags = {f for f, _ in _files(command, PROBE_FILE_FLAGS)}
        assert ("--cert" in probe_flags) == mtls and ("--token-file" in probe_flags) == token_on_health
        assert ("--ca" in probe_flags) == sec.tls
    else:
        assert probe["httpGet"]["path"] == "/health"


@pytest.mark.parametrize("own_secret", [False, True])
def test_gateway_under_mtls_and_a_token_on_health_mounts_what_it_names(own_secret):
    extra = {"gateway": {"clientTLSSecretName": OWN_CLIENT_SECRET}} if own_secret else {}
    docs = rendered("gpu-api-tls-tokens", **extra)
    check_gateway_tls(docs)
    c, pod = _gateway(docs)
    (cert,) = [v for f, v in _files(c["args"], FILE_FLAGS) if f == "--router-cert"]
    dirs = _secret_dirs(c, pod)
    assert dirs[str(Path(cert).parent)] == (OWN_CLIENT_SECRET if own_secret else "specdec-api-tls")


@pytest.mark.parametrize("overlay", ["gpu", "cpu-demo-api-tls", "cpu-demo-api-tokens"])
def test_gateway_without_mtls_keeps_the_kubelets_probe(overlay):
    check_gateway_tls(rendered(overlay))


def _moved(args: list[str], moved: dict[str, Path], **replace: str) -> list[str]:
    out = []
    for a in args:
        flag, _, value = a.partition("=")
        value = replace.get(flag.lstrip("-").replace("-", "_"), value)
        for d, local in moved.items():
            value = value.replace(d, str(local))
        out.append(f"{flag}={value}")
    return out


def test_the_rendered_gateway_is_ready_behind_a_real_mtls_router(tmp_path):
    docs = rendered("gpu-api-tls-tokens", gateway={"clientTLSSecretName": OWN_CLIENT_SECRET})
    sec, moved = _lay_out(docs, tmp_path)  # the router's Secrets, certificates for the probes' server name
    c, pod = _gateway(docs)
    for d, secret in _secret_dirs(c, pod).items():
        if secret == OWN_CLIENT_SECRET:  # the gateway's own client certificate, from the same CA
            moved[d] = tmp_path / "gateway-client"
            moved[d].mkdir()
            (moved[d] / "tls.crt").write_bytes((tmp_path / "pki" / "client.crt").read_bytes())
            (moved[d] / "tls.key").write_bytes((tmp_path / "pki" / "client.key").read_bytes())
    assert sec.tls_client_ca and sec.exempt == []
    exempt = tuple(EXEMPT_PREFIXES[e] for e in sec.exempt)
    server, router_port = start_server(
        [(lambda servicer, server: None, None, HEALTH_SERVICE)],
        credentials=sec.server_credentials(),
        interceptors=[server_interceptor(sec.tokens(), PUBLIC_HEADER, exempt)],
    )
    port = free_port()
    args = _moved(c["args"], moved, router=f"127.0.0.1:{router_port}", host="127.0.0.1", port=str(port))
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    gateway = subprocess.Popen([sys.executable, "-m", "gateway", *args], env=env, stderr=subprocess.DEVNULL)
    probe = _moved(c["readinessProbe"]["exec"]["command"][3:], moved, port=str(port))
    try:
        t_end = time.monotonic() + 120  # until it listens (a loaded machine starts Python slowly)
        while gateway_probe(probe) != 0 and time.monotonic() < t_end:
            assert gateway.poll() is None, "the gateway exited"
            time.sleep(0.2)
        assert gateway_probe(probe) == 0
        # broken variants: no client certificate (the HTTPS port wants one); no token (the router does)
        assert gateway_probe([a for a in probe if not a.startswith(("--cert=", "--key="))]) == 1
        assert gateway_probe([a for a in probe if not a.startswith("--token-file=")]) == 1
    finally:
        gateway.terminate()
        gateway.wait(10)
        stop_server(server, 0)


def _gw(docs: list[dict]) -> dict:
    return _gateway(docs)[0]


BROKEN = {
    "the client certificate outside the mounts": lambda d: _gw(d)["args"].append("--router-cert=/etc/gw/tls.crt"),
    "the kubelet's httpGet probe under mTLS": lambda d: _gw(d).update(
        readinessProbe={"httpGet": {"path": "/health", "port": "http", "scheme": "HTTPS"}}
    ),
    "no client CA on the HTTPS port": lambda d: _gw(d).update(
        args=[a for a in _gw(d)["args"] if not a.startswith("--tls-client-ca=")]
    ),
    "the probe's token not mounted": lambda d: _gw(d).update(
        volumeMounts=[m for m in _gw(d)["volumeMounts"] if m["name"] != "api-tokens"]
    ),
}


@pytest.mark.parametrize("case", BROKEN)
def test_broken_gateway_tls_fails(case):
    docs = copy.deepcopy(rendered("gpu-api-tls-tokens"))
    BROKEN[case](docs)
    with pytest.raises(AssertionError):
        check_gateway_tls(docs)
