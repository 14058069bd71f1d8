"""The OpenAI-compatible HTTP gateway as a child process of ``specdec serve``: its own ASGI server
(``python -m gateway``), so it scales and fails apart from the router, and the router stays the only
scheduler (docs/architecture.md, Processes). Started once the router serves, stopped before it.

The gateway binds the router's host (the same binding rules as the gRPC port: 127.0.0.1 unless the
config says otherwise) and serves HTTPS with the gRPC port's certificate and client CA. It reaches the
router on its gRPC address; with TLS on, trusting the router's own certificate (a self-signed one, as
on one machine) unless ``SPECDEC_GATEWAY_ROUTER_CA`` names the CA; with mTLS on, presenting the
certificate ``SPECDEC_GATEWAY_ROUTER_CERT`` / ``_KEY`` name, else the API's own. Bearer tokens are
not its business: each caller's token travels with its gRPC call and the router checks it.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass

from specdec.core.log_format import JsonFormatter
from specdec.rpc.api_security import SecurityConfig

log = logging.getLogger(__name__)

__all__ = [
    "GatewayProcess",
    "gateway_command",
    "start_gateway",
    "dial_address",
    "ROUTER_CA_ENV",
    "ROUTER_CERT_ENV",
    "ROUTER_KEY_ENV",
]

ROUTER_CA_ENV = "SPECDEC_GATEWAY_ROUTER_CA"
ROUTER_CERT_ENV = "SPECDEC_GATEWAY_ROUTER_CERT"
ROUTER_KEY_ENV = "SPECDEC_GATEWAY_ROUTER_KEY"
_NOT_FOR_THE_GATEWAY = ("SPECDEC_WORKER_SECRET", "RAY_AUTH_TOKEN")


def _dial_host(host: str) -> str:
    """Where to reach a server bound to ``host`` from this machine."""
    return {"0.0.0.0": "127.0.0.1", "::": "::1", "[::]": "::1", "": "127.0.0.1"}.get(host, host)


def dial_address(host: str, port: int) -> str:
    """``host:port`` of a server bound to ``host``, as this machine reaches it."""
    return f"{_dial_host(host)}:{port}"


def _router_client_cert(security: SecurityConfig, env: Mapping[str, str]) -> tuple[str, str]:
    """The gateway's client certificate for the router under mTLS: the pair the variables name, else
    the API's own certificate (as the chart's probes do: issue it from the client CA, client-auth
    usage allowed; k8s/README.md, TLS and tokens)."""
    cert, key = env.get(ROUTER_CERT_ENV), env.get(ROUTER_KEY_ENV)
    if bool(cert) != bool(key):
        raise ValueError(f"{ROUTER_CERT_ENV} and {ROUTER_KEY_ENV} go together (a certificate and its key)")
    return (cert, key) if cert else (security.tls_cert, security.tls_key)


def _log_format() -> str:
    """This process's: `specdec serve --log-format json` gives the gateway's lines the same form."""
    json_lines = any(isinstance(h.formatter, JsonFormatter) for h in logging.getLogger().handlers)
    return "json" if json_lines else "text"


def gateway_command(
    router: str,
    host: str,
    port: int,
    security: SecurityConfig,
    log_format: str | None = None,
    env: Mapping[str, str] | None = None,
) -> list[str]:
    """``log_format``: text or json; None: the same as this process's root handlers. ``env``: where
    the ``SPECDEC_GATEWAY_ROUTER_*`` variables are read (default: this process's environment)."""
    env = os.environ if env is None else env
    cmd = [sys.executable, "-m", "gateway", "--router", router, "--host", host, "--port", str(port)]
    cmd += ["--log-format", log_format or _log_format()]
    cmd += ["--exit-with-parent", str(os.getpid())]  # it goes when `specdec serve` does, however it ends
    if security.tls:
        cmd += ["--tls-cert", security.tls_cert, "--tls-key", security.tls_key]
        cmd += ["--router-ca", env.get(ROUTER_CA_ENV) or security.tls_cert]
    if security.tls_client_ca:
        # mTLS: HTTP callers need a client certificate too (the gateway is no way around the client
        # CA), and the gateway shows the router one of its own
        cert, key = _router_client_cert(security, env)
        cmd += ["--tls-client-ca", security.tls_client_ca, "--router-cert", cert, "--router-key", key]
    return cmd


@dataclass
class GatewayProcess:
    proc: subprocess.Popen
    host: str
    port: int

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM (uvicorn ends its connections), then SIGKILL past ``timeout``."""
        if self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


def _listening(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def start_gateway(
    router: str,
    host: str,
    port: int,
    security: SecurityConfig,
    timeout: float = 60.0,
    log_format: str | None = None,
    **popen,
) -> GatewayProcess:
    """Start ``python -m gateway`` and return once it accepts connections (RuntimeError if it exits
    first, or does not listen within ``timeout``). ``popen``: extra ``subprocess.Popen`` arguments."""
    env = popen.pop("env", None) or os.environ
    cmd = gateway_command(router, host, port, security, log_format, env)
    # The gateway holds no secret but its TLS keys: not the worker secret, not Ray's token.
    env = {k: v for k, v in env.items() if k not in _NOT_FOR_THE_GATEWAY}
    proc = subprocess.Popen(cmd, env=env, **popen)
    gw = GatewayProcess(proc, host, port)
    t_end = time.monotonic() + timeout
    # listening, and still ours: a port taken by another process makes the gateway exit
    while not _listening(_dial_host(host), port) or proc.poll() is not None:
        if proc.poll() is not None:
            raise RuntimeError(f"the HTTP gateway exited with {proc.returncode} (is port {port} free?)")
        if time.monotonic() > t_end:
            gw.stop()
            raise RuntimeError(f"the HTTP gateway did not listen on {host}:{port} within {timeout:.0f} s")
        time.sleep(0.1)
    log.info("OpenAI-compatible HTTP API on http%s://%s:%d/v1", "s" if security.tls else "", host, port)
    return gw
