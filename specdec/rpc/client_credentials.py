"""What a client of the public API presents: a bearer token, and TLS (a CA to trust; a client
certificate and key for mTLS). Used by :class:`specdec.rpc.client.SpecdecClient`, ``specdec
generate --server`` and ``specdec bench serve``.

The token comes from a file (its first line that is not a ``#`` comment) or an environment
variable (default ``SPECDEC_API_TOKEN``), never from a command-line argument (other users see
those in ``ps``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import grpc

from specdec.rpc.auth import channel_tls, credentials_metadata
from specdec.rpc.call_metadata import aio_interceptors, with_metadata

__all__ = ["ClientCredentials", "TOKEN_ENV"]

TOKEN_ENV = "SPECDEC_API_TOKEN"


def _first_token(path: str | Path) -> str:
    for line in Path(path).expanduser().read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            return line
    raise ValueError(f"token file {path}: no token in it")


@dataclass(frozen=True)
class ClientCredentials:
    """``token``: sent as ``authorization: Bearer <token>``. ``tls``: TLS with the system's roots
    (implied by ``ca`` or ``cert``); ``ca``: a PEM file of the CA to trust; ``cert`` / ``key``: the
    client's certificate for mTLS. ``__repr__`` never shows the token."""

    token: str | None = None
    tls: bool = False
    ca: str | None = None
    cert: str | None = None
    key: str | None = None

    def __post_init__(self) -> None:
        if bool(self.cert) != bool(self.key):
            raise ValueError("a client certificate and its key go together (cert and key)")

    def __repr__(self) -> str:
        return (
            f"ClientCredentials(token={'***' if self.token else None}, tls={self.secure}, "
            f"ca={self.ca!r}, cert={self.cert!r})"
        )

    @classmethod
    def load(
        cls,
        token_file: str | None = None,
        token_env: str | None = TOKEN_ENV,
        *,
        tls: bool = False,
        ca: str | None = None,
        cert: str | None = None,
        key: str | None = None,
    ) -> ClientCredentials:
        """The token from ``token_file``, else from the variable ``token_env`` when it is set."""
        token = _first_token(token_file) if token_file else (os.environ.get(token_env or "") or "").strip() or None
        return cls(token=token, tls=tls, ca=ca, cert=cert, key=key)

    @property
    def secure(self) -> bool:
        return self.tls or bool(self.ca or self.cert)

    def channel(self, address: str, options: list[tuple[str, int]] | None = None) -> grpc.Channel:
        """A channel to ``address`` (TLS when :attr:`secure`) whose calls carry the token."""
        opts = list(options or [])
        if self.secure:
            channel = grpc.secure_channel(address, channel_tls(self.ca, self.cert, self.key), options=opts)
        else:
            channel = grpc.insecure_channel(address, options=opts)
        return with_metadata(channel, credentials_metadata(self.token))

    def aio_channel(self, address: str, options: list[tuple[str, int]] | None = None) -> grpc.aio.Channel:
        """The grpc.aio twin of :meth:`channel` (for :class:`specdec.rpc.aio_client.AsyncSpecdecClient`)."""
        opts = list(options or [])
        interceptors = aio_interceptors(credentials_metadata(self.token)) or None
        if self.secure:
            tls = channel_tls(self.ca, self.cert, self.key)
            return grpc.aio.secure_channel(address, tls, options=opts, interceptors=interceptors)
        return grpc.aio.insecure_channel(address, options=opts, interceptors=interceptors)
