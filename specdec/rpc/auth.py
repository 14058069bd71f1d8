"""Who may call: bearer tokens on the public API, a shared secret on the workers, and TLS.

* :class:`Tokens`: the accepted secrets (several, for rotation), from a file (one per line) or an
  environment variable (comma-separated); compared in constant time.
* :func:`server_interceptor` / :func:`aio_server_interceptor`: refuse a call without a valid
  ``authorization: Bearer <token>`` (public API) or ``x-specdec-internal: <secret>`` (workers) with
  UNAUTHENTICATED and a message that gives nothing away; some methods (health, reflection) can
  be exempt; ``on_denied(method, peer)`` is told of each refusal (counting, the access log).
* :func:`credentials_metadata`: what a client adds to each call; :func:`server_tls` /
  :func:`channel_tls`: TLS (and mTLS with a client CA) credentials from PEM files.
"""

from __future__ import annotations

import hmac
import logging
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

log = logging.getLogger(__name__)

__all__ = [
    "PUBLIC_HEADER",
    "INTERNAL_HEADER",
    "HEALTH_AND_REFLECTION",
    "Tokens",
    "server_interceptor",
    "aio_server_interceptor",
    "credentials_metadata",
    "server_tls",
    "channel_tls",
]

PUBLIC_HEADER = "authorization"  # value "Bearer <token>"
INTERNAL_HEADER = "x-specdec-internal"  # value: the deployment's shared secret
HEALTH_AND_REFLECTION = ("/grpc.health.v1.Health/", "/grpc.reflection.")
_REFUSED = "missing or invalid credentials"


@dataclass(frozen=True)
class Tokens:
    values: tuple[bytes, ...]

    @classmethod
    def load(cls, file: str | Path | None = None, env: str | None = None) -> Tokens:
        """Tokens from ``file`` (one per line, # comments) and/or the environment variable ``env``."""
        found: list[str] = []
        if file:
            for line in Path(file).expanduser().read_text().splitlines():
                line = line.split("#", 1)[0].strip()
                if line:
                    found.append(line)
        if env and os.environ.get(env):
            found += [t.strip() for t in os.environ[env].split(",") if t.strip()]
        if not found:
            raise ValueError(f"no tokens found (file {file!r}, environment variable {env!r})")
        for t in found:
            if len(t) < 16:
                raise ValueError("a token must be at least 16 characters")
        return cls(tuple(t.encode() for t in found))

    def accepts(self, presented: str | None) -> bool:
        if not presented:
            return False
        got = presented.encode()
        # compare with every token, never stopping early: the time says nothing of which was close
        return any([hmac.compare_digest(got, t) for t in self.values])


def _presented(metadata: Iterable[tuple[str, str | bytes]] | None, header: str) -> str | None:
    for key, value in metadata or ():
        if key == header:
            text = value.decode() if isinstance(value, bytes) else value
            if header == PUBLIC_HEADER:
                scheme, _, token = text.partition(" ")
                return token.strip() if scheme.lower() == "bearer" else None
            return text
    return None


def _checker(tokens: Tokens, header: str, exempt: Sequence[str]) -> Callable[[grpc.HandlerCallDetails], bool]:
    def allowed(details: grpc.HandlerCallDetails) -> bool:
        method = details.method or ""
        if any(method.startswith(prefix) for prefix in exempt):
            return True
        return tokens.accepts(_presented(details.invocation_metadata, header))

    return allowed


OnDenied = Callable[[str, str], None]  # (method, peer)


def _tell(on_denied: OnDenied | None, method: str, context) -> None:
    if on_denied is None:
        return
    try:
        on_denied(method, context.peer())
    except Exception:  # noqa: BLE001 - counting must not change the answer
        log.exception("on_denied callback failed")


def _deny_handler(
    handler: grpc.RpcMethodHandler | None, is_aio: bool, method: str = "", on_denied: OnDenied | None = None
) -> grpc.RpcMethodHandler | None:
    if handler is None:
        return None

    if is_aio:

        async def deny(request, context):
            _tell(on_denied, method, context)
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, _REFUSED)

    else:

        def deny(request, context):
            _tell(on_denied, method, context)
            context.abort(grpc.StatusCode.UNAUTHENTICATED, _REFUSED)

    kw = dict(request_deserializer=None, response_serializer=None)  # the request is never read
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(deny, **kw)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(deny, **kw)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(deny, **kw)
    return grpc.unary_unary_rpc_method_handler(deny, **kw)


class _Interceptor(grpc.ServerInterceptor):
    def __init__(self, allowed: Callable[[grpc.HandlerCallDetails], bool], on_denied: OnDenied | None):
        self.allowed = allowed
        self.on_denied = on_denied

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if self.allowed(handler_call_details):
            return handler
        return _deny_handler(handler, False, handler_call_details.method, self.on_denied)


class _AioInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, allowed: Callable[[grpc.HandlerCallDetails], bool], on_denied: OnDenied | None):
        self.allowed = allowed
        self.on_denied = on_denied

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if self.allowed(handler_call_details):
            return handler
        return _deny_handler(handler, True, handler_call_details.method, self.on_denied)


def server_interceptor(
    tokens: Tokens, header: str, exempt: Sequence[str] = (), on_denied: OnDenied | None = None
) -> grpc.ServerInterceptor:
    return _Interceptor(_checker(tokens, header, exempt), on_denied)


def aio_server_interceptor(
    tokens: Tokens, header: str, exempt: Sequence[str] = (), on_denied: OnDenied | None = None
) -> grpc.aio.ServerInterceptor:
    return _AioInterceptor(_checker(tokens, header, exempt), on_denied)


def credentials_metadata(token: str | None, header: str = PUBLIC_HEADER) -> tuple[tuple[str, str], ...]:
    """The metadata a client sends with every call (empty without a token)."""
    if not token:
        return ()
    return ((header, f"Bearer {token}" if header == PUBLIC_HEADER else token),)


def server_tls(cert: str | Path, key: str | Path, client_ca: str | Path | None = None) -> grpc.ServerCredentials:
    """TLS for a server; with ``client_ca`` the client must present a certificate it signed (mTLS)."""
    pair = [(Path(key).read_bytes(), Path(cert).read_bytes())]
    if client_ca is None:
        return grpc.ssl_server_credentials(pair)
    return grpc.ssl_server_credentials(pair, root_certificates=Path(client_ca).read_bytes(), require_client_auth=True)


def channel_tls(
    ca: str | Path | None = None, cert: str | Path | None = None, key: str | Path | None = None
) -> grpc.ChannelCredentials:
    """TLS for a client: ``ca`` to trust (None: the system's roots); ``cert``/``key`` for mTLS."""
    return grpc.ssl_channel_credentials(
        root_certificates=Path(ca).read_bytes() if ca else None,
        private_key=Path(key).read_bytes() if key else None,
        certificate_chain=Path(cert).read_bytes() if cert else None,
    )
