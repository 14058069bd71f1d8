"""The deployment's shared secret: what the router sends on every call to a worker, and what a
worker requires on every call but health (``x-specdec-internal``, :mod:`specdec.rpc.auth`).

Where it lives: the ``SPECDEC_WORKER_SECRET`` environment variable of the router's process (or a
file named by ``SPECDEC_WORKER_SECRET_FILE``). ``specdec serve`` makes one per start unless
``security.worker_secret_file`` names one (:func:`ensure_secret`); the worker actors get it as a
constructor argument (it reaches actors on other nodes too; not in their ``runtime_env``, whose
env_vars Ray writes to its runtime_env_agent.log), never through a log line or a command line. A
worker started without one refuses to start.

Health stays open on the workers (:data:`WORKER_EXEMPT`): it says SERVING or not, nothing more,
and probes (Ray, Kubernetes, grpcurl by hand) need no secret for it.
"""

from __future__ import annotations

import logging
import os
import secrets
from pathlib import Path

import grpc

from specdec.rpc.auth import (
    INTERNAL_HEADER,
    Tokens,
    credentials_metadata,
    server_interceptor,
)
from specdec.rpc.call_metadata import with_metadata

log = logging.getLogger(__name__)

__all__ = [
    "SECRET_ENV",
    "SECRET_FILE_ENV",
    "WORKER_EXEMPT",
    "MissingSecret",
    "current_secret",
    "ensure_secret",
    "require_secret",
    "worker_interceptor",
    "secret_metadata",
    "worker_channel",
]

SECRET_ENV = "SPECDEC_WORKER_SECRET"
SECRET_FILE_ENV = "SPECDEC_WORKER_SECRET_FILE"
WORKER_EXEMPT = ("/grpc.health.v1.Health/",)


class MissingSecret(RuntimeError):
    """No worker secret in this process's environment."""


def _read(path: str | Path) -> str:
    text = Path(path).expanduser().read_text().strip()
    if len(text) < 16:
        raise ValueError(f"worker secret file {path}: the secret must be at least 16 characters")
    return text


def current_secret() -> str | None:
    """The secret from ``SPECDEC_WORKER_SECRET``, else from the file ``SPECDEC_WORKER_SECRET_FILE``."""
    value = os.environ.get(SECRET_ENV, "").strip()
    if value:
        return value
    path = os.environ.get(SECRET_FILE_ENV)
    return _read(path) if path else None


def ensure_secret(file: str | Path | None = None) -> str:
    """The deployment's secret, set in this process's environment (the router and the actors
    spawned from here take it from there): read from ``file``, else the one already in the
    environment, else a fresh random one."""
    if file:
        secret = _read(file)
    else:
        secret = current_secret() or secrets.token_urlsafe(32)
    os.environ[SECRET_ENV] = secret
    return secret


def require_secret() -> str:
    """The secret a worker serves with; :class:`MissingSecret` (saying how to give one) when there is none."""
    secret = current_secret()
    if not secret:
        raise MissingSecret(
            f"no worker secret: set {SECRET_ENV} (or {SECRET_FILE_ENV}, a file holding it) to the value "
            "the router uses; `specdec serve` passes its own to the workers it starts"
        )
    if len(secret) < 16:
        raise MissingSecret(f"{SECRET_ENV}: the secret must be at least 16 characters")
    return secret


def worker_interceptor(secret: str) -> grpc.ServerInterceptor:
    return server_interceptor(Tokens((secret.encode(),)), INTERNAL_HEADER, exempt=WORKER_EXEMPT)


def secret_metadata(secret: str | None = None) -> tuple[tuple[str, str], ...]:
    """The metadata a call to a worker carries: the secret (default: :func:`current_secret`);
    none without one. The router passes it with each call rather than through a grpc.aio channel
    interceptor, which runs every call through a task of its own: about 0.1 ms of a round on a
    2-core machine (docs/results.md, "Small costs behind rules in the code")."""
    return credentials_metadata(secret or current_secret(), INTERNAL_HEADER)


def worker_channel(address: str, secret: str | None = None, options=()) -> grpc.Channel:
    """A sync channel to a worker whose calls carry the secret (tools and tests)."""
    return with_metadata(grpc.insecure_channel(address, options=list(options)), secret_metadata(secret))
