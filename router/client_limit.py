"""A per-client bound on calls in flight on the public API: one client cannot take the whole queue.

A client is its bearer token when it sends one (so clients behind one proxy are told apart), else
its peer address without the port. Beyond ``router.max_inflight_per_client`` calls of
``specdec.v1.Generation`` at once, a call is refused before it is decoded with RESOURCE_EXHAUSTED
and a RetryInfo: about when one of the client's own calls ends (their recent mean duration divided
by how many it has running). Health and reflection are not counted.

A grpc.aio server interceptor (the router's loop is one thread: plain counters, no lock).
"""

from __future__ import annotations

import hashlib
import inspect
import logging
from collections.abc import Callable

import grpc

from router import clock
from specdec.rpc.auth import PUBLIC_HEADER
from specdec.rpc.errors import RpcStatusError, abort_with_async

log = logging.getLogger(__name__)

__all__ = ["ClientLimiter", "client_key", "COUNTED_PREFIX"]

COUNTED_PREFIX = "/specdec.v1.Generation/"
_EMA = 0.2  # weight of the latest call in the mean duration


def client_key(metadata, peer: str) -> str:
    """ "token:<hash>" for a bearer token, else "peer:<address without port>"."""
    for key, value in metadata or ():
        if key == PUBLIC_HEADER:
            text = value.decode() if isinstance(value, bytes) else value
            return "token:" + hashlib.sha256(text.encode()).hexdigest()[:16]
    host = peer.rsplit(":", 1)[0] if peer.startswith(("ipv4:", "ipv6:")) else peer
    return "peer:" + host


class ClientLimiter(grpc.aio.ServerInterceptor):
    """``limit`` calls in flight per client (0: no limit); ``on_limited(method, peer)`` is told of
    each refusal."""

    def __init__(self, limit: int, on_limited: Callable[[str, str], None] | None = None):
        self.limit = limit
        self.on_limited = on_limited
        self.inflight: dict[str, int] = {}
        self.mean_s = 1.0  # until a call has ended: a guess of one second

    def _enter(self, method: str, context) -> str:
        key = client_key(context.invocation_metadata(), context.peer())
        n = self.inflight.get(key, 0)
        if n >= self.limit:
            if self.on_limited is not None:
                self.on_limited(method, context.peer())
            raise RpcStatusError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"this client has {n} calls in flight; the server takes at most {self.limit} per client",
                retry_after=min(30.0, max(0.05, self.mean_s / max(1, n))),
            )
        self.inflight[key] = n + 1
        return key

    def _leave(self, key: str, t0: float) -> None:
        n = self.inflight[key] - 1
        if n:
            self.inflight[key] = n
        else:
            del self.inflight[key]
        self.mean_s += _EMA * (clock.now() - t0 - self.mean_s)

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method or ""
        if self.limit <= 0 or handler is None or not method.startswith(COUNTED_PREFIX) or handler.request_streaming:
            return handler
        kind = "unary_stream" if handler.response_streaming else "unary_unary"
        behaviour = getattr(handler, kind)
        limiter = self

        if inspect.isasyncgenfunction(behaviour):

            async def stream(request, context):
                try:
                    key = limiter._enter(method, context)
                except RpcStatusError as exc:
                    await abort_with_async(context, exc, method, quiet=True)
                t0 = clock.now()
                try:
                    async for item in behaviour(request, context):
                        yield item
                finally:
                    limiter._leave(key, t0)

            return handler._replace(**{kind: stream})

        async def unary(request, context):
            try:
                key = limiter._enter(method, context)
            except RpcStatusError as exc:
                await abort_with_async(context, exc, method, quiet=True)
            t0 = clock.now()
            try:
                return await behaviour(request, context)
            finally:
                limiter._leave(key, t0)

        return handler._replace(**{kind: unary})
