"""Channels whose every call carries some metadata (a bearer token, the worker secret): client
interceptors for sync channels (:func:`with_metadata`) and grpc.aio channels
(:func:`aio_interceptors`)."""

from __future__ import annotations

from collections.abc import Sequence

import grpc

__all__ = ["Pairs", "with_metadata", "interceptors", "aio_interceptors"]

Pairs = Sequence[tuple[str, str]]


def _details(details, pairs: Pairs, aio: bool):
    merged = [*(details.metadata or ()), *pairs]
    metadata = grpc.aio.Metadata(*merged) if aio else merged
    return details._replace(metadata=metadata)  # grpc's ClientCallDetails are namedtuples


class _Sync(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    def __init__(self, pairs: Pairs):
        self.pairs = tuple(pairs)

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(_details(details, self.pairs, False), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(_details(details, self.pairs, False), request)

    def intercept_stream_unary(self, continuation, details, requests):
        return continuation(_details(details, self.pairs, False), requests)

    def intercept_stream_stream(self, continuation, details, requests):
        return continuation(_details(details, self.pairs, False), requests)


class _AioUnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, pairs: Pairs):
        self.pairs = tuple(pairs)

    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(_details(details, self.pairs, True), request)


class _AioUnaryStream(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, pairs: Pairs):
        self.pairs = tuple(pairs)

    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(_details(details, self.pairs, True), request)


def interceptors(pairs: Pairs) -> list:
    """Interceptors for ``grpc.intercept_channel`` (none when ``pairs`` is empty)."""
    return [_Sync(pairs)] if pairs else []


def aio_interceptors(pairs: Pairs) -> list:
    """The same for ``grpc.aio.*_channel(..., interceptors=...)`` (unary requests: all our RPCs)."""
    return [_AioUnaryUnary(pairs), _AioUnaryStream(pairs)] if pairs else []


def with_metadata(channel: grpc.Channel, pairs: Pairs) -> grpc.Channel:
    """``channel`` whose calls carry ``pairs`` (``channel`` itself when there are none)."""
    found = interceptors(pairs)
    return grpc.intercept_channel(channel, *found) if found else channel
