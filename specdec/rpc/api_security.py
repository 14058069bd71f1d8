"""Who may call the public API, and the worker secret's source: the ``security`` section of the
deployment config (``configs/default.yaml`` documents it), turned into server credentials and
interceptors (:mod:`specdec.rpc.auth` holds the mechanisms).

* TLS: ``tls_cert`` + ``tls_key`` (PEM) turn TLS on; ``tls_client_ca`` also requires a client
  certificate signed by that CA (mTLS).
* Bearer tokens: ``tokens_file`` (one per line, ``#`` comments) and/or ``tokens_env`` (the name of an
  environment variable holding comma-separated tokens). Several tokens are accepted at once, so a
  new one can be rolled out before the old one is removed. Neither set: no token is asked for.
* ``exempt``: methods open without a token: ``health`` (load balancers and Kubernetes probes),
  ``reflection`` (grpcurl's ``list``/``describe``).
* ``worker_secret_file``: the router <-> worker shared secret (:mod:`specdec.rpc.worker_secret`);
  None: a fresh one per start.

Values never appear in the config itself (only paths and variable names), so ``--print-config``
and the logs never show a secret.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from specdec.rpc.auth import PUBLIC_HEADER, OnDenied, Tokens, aio_server_interceptor, server_tls
from specdec.rpc.worker_config import strict_from_dict

__all__ = ["SecurityConfig", "EXEMPT_PREFIXES"]

EXEMPT_PREFIXES = {"health": "/grpc.health.v1.Health/", "reflection": "/grpc.reflection."}


@dataclass
class SecurityConfig:
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    tokens_file: str | None = None
    tokens_env: str | None = None
    exempt: list[str] = field(default_factory=lambda: ["health"])
    worker_secret_file: str | None = None
    allow_insecure: bool = False  # serve beyond loopback without TLS and tokens (cluster.launch.check_exposure)

    def __post_init__(self) -> None:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("security: tls_cert and tls_key go together (PEM certificate and its private key)")
        if self.tls_client_ca and not self.tls_cert:
            raise ValueError("security: tls_client_ca (mTLS) needs TLS on: set tls_cert and tls_key")
        if not isinstance(self.exempt, list | tuple) or any(e not in EXEMPT_PREFIXES for e in self.exempt):
            raise ValueError(f"security.exempt: a list of {sorted(EXEMPT_PREFIXES)} (got {self.exempt!r})")
        self.exempt = list(self.exempt)

    @classmethod
    def from_dict(cls, d: dict[str, Any] | SecurityConfig | None) -> SecurityConfig:
        if isinstance(d, SecurityConfig):
            return d
        return strict_from_dict(cls, d, "security")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def tls(self) -> bool:
        return bool(self.tls_cert)

    @property
    def token_auth(self) -> bool:
        return bool(self.tokens_file or self.tokens_env)

    def tokens(self) -> Tokens | None:
        """The accepted tokens (read now: a rotated file takes effect at the next start), or None."""
        if not self.token_auth:
            return None
        return Tokens.load(self.tokens_file, self.tokens_env)

    def server_credentials(self) -> grpc.ServerCredentials | None:
        if not self.tls:
            return None
        return server_tls(self.tls_cert, self.tls_key, self.tls_client_ca)

    def aio_interceptors(self, on_denied: OnDenied | None = None) -> list[grpc.aio.ServerInterceptor]:
        """The public server's authentication (empty without tokens)."""
        tokens = self.tokens()
        if tokens is None:
            return []
        exempt = tuple(EXEMPT_PREFIXES[e] for e in self.exempt)
        return [aio_server_interceptor(tokens, PUBLIC_HEADER, exempt, on_denied)]

    def check_files(self) -> None:
        """Fail before anything starts when a named file cannot be read."""
        for key in ("tls_cert", "tls_key", "tls_client_ca", "tokens_file", "worker_secret_file"):
            path = getattr(self, key)
            if path and not Path(path).expanduser().is_file():
                raise ValueError(f"security.{key}: no such file: {path}")
        self.tokens()  # no tokens in the file / variable: say so now
