"""HTTPS on the gateway and mTLS to the router, as `specdec serve` wires them (cluster/gateway_process.py):
the official `openai` client (an httpx client with the test CA and a client certificate) completes
over HTTPS through a gateway whose router requires client certificates, the same text as gRPC.

Broken variants: a client that does not trust the CA is refused, and so is one without a client
certificate (the HTTPS port asks for one under mTLS, as the gRPC port does); a gateway that shows the
router no certificate gets nothing through (503).
"""

from __future__ import annotations

import os
import ssl
from pathlib import Path

import httpx
import openai
import pytest

from cluster.gateway_process import ROUTER_CA_ENV, ROUTER_CERT_ENV, ROUTER_KEY_ENV, start_gateway
from gateway import health_probe
from specdec.rpc.api_security import SecurityConfig
from specdec.rpc.client_credentials import ClientCredentials
from tests.e2e.serve_process import free_port
from tests.integration.service_fixture import MODEL, running_service
from tests.pki import make_pki

REPO = Path(__file__).resolve().parents[2]
PROMPT = "hello there"
N = 6


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def mtls(pki) -> SecurityConfig:
    return SecurityConfig(
        tls_cert=str(pki["server.crt"]), tls_key=str(pki["server.key"]), tls_client_ca=str(pki["ca.crt"])
    )


@pytest.fixture(scope="module")
def svc(ray_cluster, actor_reaper, tiny_paths, pki, mtls):
    creds = ClientCredentials(ca=str(pki["ca.crt"]), cert=str(pki["client.crt"]), key=str(pki["client.key"]))
    with running_service(actor_reaper, tiny_paths, security=mtls, credentials=creds) as svc:
        yield svc


def _env(**extra: str) -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), **extra)


@pytest.fixture()
def gateway(svc, tmp_path):
    """``gateway(security, **env) -> https://127.0.0.1:PORT``, stopped after the test."""
    started = []

    def start(security: SecurityConfig, **env: str) -> str:
        port = free_port()
        log = open(tmp_path / f"gateway-{port}.log", "w")
        started.append(
            (
                start_gateway(svc.router.address, "127.0.0.1", port, security, env=_env(**env), stdout=log, stderr=log),
                log,
            )
        )
        return f"https://127.0.0.1:{port}"

    yield start
    for gw, log in started:
        gw.stop()
        log.close()


def _openai(url: str, verify: ssl.SSLContext | bool) -> openai.OpenAI:
    http_client = httpx.Client(verify=verify, timeout=60)
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, http_client=http_client)


def _trusting(pki, client_cert: bool = True) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(pki["ca.crt"]))
    if client_cert:
        ctx.load_cert_chain(str(pki["client.crt"]), str(pki["client.key"]))
    return ctx


def test_openai_over_https_through_a_gateway_with_mtls_to_the_router(svc, pki, mtls, gateway):
    url = gateway(
        mtls,
        **{
            ROUTER_CA_ENV: str(pki["ca.crt"]),
            ROUTER_CERT_ENV: str(pki["client.crt"]),
            ROUTER_KEY_ENV: str(pki["client.key"]),
        },
    )
    client = _openai(url, _trusting(pki))
    out = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=N, temperature=0, extra_body={"ignore_eos": True}
    )
    by_grpc = svc.client.generate(PROMPT, max_tokens=N, temperature=0.0, ignore_eos=True, timeout=60)
    assert out.choices[0].text == by_grpc.text and out.usage.completion_tokens == N
    streamed = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=N, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    assert "".join(c.choices[0].text for c in streamed) == by_grpc.text
    port = int(url.rsplit(":", 1)[1])
    ca, cert, key = str(pki["ca.crt"]), str(pki["client.crt"]), str(pki["client.key"])
    assert health_probe.main(["--port", str(port), "--ca", ca, "--cert", cert, "--key", key]) == 0

    # broken variants: the client does not trust the CA; it has no client certificate
    with pytest.raises(openai.APIConnectionError):
        _openai(url, True).completions.create(model=MODEL, prompt=PROMPT, max_tokens=1)
    with pytest.raises(openai.APIConnectionError):
        _openai(url, _trusting(pki, client_cert=False)).completions.create(model=MODEL, prompt=PROMPT, max_tokens=1)
    assert health_probe.main(["--port", str(port), "--ca", ca]) == 1


def test_by_default_the_gateway_shows_the_router_the_apis_own_certificate(svc, pki, mtls, gateway):
    """`specdec serve` with mTLS and no SPECDEC_GATEWAY_ROUTER_CERT: the API's certificate (signed by
    the client CA here, as the chart's probes need too) is the gateway's client certificate."""
    url = gateway(mtls, **{ROUTER_CA_ENV: str(pki["ca.crt"])})
    out = _openai(url, _trusting(pki)).completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0)
    assert out.usage.completion_tokens >= 1


def test_a_gateway_without_a_client_certificate_gets_nothing_through(svc, pki, gateway):
    """Broken variant: the same gateway, told of TLS but not of mTLS, shows the router no certificate."""
    tls_only = SecurityConfig(tls_cert=str(pki["server.crt"]), tls_key=str(pki["server.key"]))
    url = gateway(tls_only, **{ROUTER_CA_ENV: str(pki["ca.crt"])})
    with pytest.raises(openai.InternalServerError) as err:
        _openai(url, ssl.create_default_context(cafile=str(pki["ca.crt"]))).completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=1
        )
    assert err.value.status_code == 503
