"""An asyncio client for the public ``specdec.v1.Generation`` API: the grpc.aio twin of
:class:`specdec.rpc.client.SpecdecClient`, with the same parameters, results and exceptions.

    from specdec.rpc.aio_client import AsyncSpecdecClient

    async with AsyncSpecdecClient("127.0.0.1:50051") as client:
        out = await client.generate(messages=[("user", "Write a prime test")], max_tokens=64)
        async for chunk in client.generate_stream("def fib(n):", max_tokens=64):
            print(chunk.text, end="", flush=True)

``metadata``: extra pairs for one call (the HTTP gateway passes its caller's bearer token this way).
Leaving a stream early (``break``, cancelling the task) cancels the call, and the server frees the
request's KV slots. Needs only grpcio, grpcio-status and protobuf: no torch, Ray or transformers.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.rpc import generate_pb2, generate_pb2_grpc
from specdec.rpc.client import (
    GenerateResult,
    Message,
    StreamChunk,
    TokenizeResult,
    build_request,
    model_dict,
    tokenize_request,
)
from specdec.rpc.client_credentials import ClientCredentials
from specdec.rpc.client_errors import from_rpc_error
from specdec.rpc.grpc_options import channel_options

__all__ = ["AsyncSpecdecClient"]

Metadata = Sequence[tuple[str, str]]


class AsyncSpecdecClient:
    """Client of one specdec router (``host:port``) on the running event loop."""

    def __init__(
        self,
        address: str,
        *,
        timeout: float | None = None,
        credentials: ClientCredentials | None = None,
        server_name: str | None = None,
    ) -> None:
        """``server_name``: with TLS, the name the server's certificate is checked against when it
        is not the address's host (a Kubernetes Service's short name, say)."""
        self.address = address
        self.timeout = timeout
        self.credentials = credentials if credentials is not None else ClientCredentials.load()
        options = channel_options(64 << 20)
        if server_name:
            options.append(("grpc.ssl_target_name_override", server_name))
        self.channel = self.credentials.aio_channel(address, options)
        self.stub = generate_pb2_grpc.GenerationStub(self.channel)

    def _timeout(self, timeout: float | None) -> float | None:
        return timeout if timeout is not None else self.timeout

    async def generate(
        self, prompt: str | None = None, *, timeout: float | None = None, metadata: Metadata = (), **kwargs
    ) -> GenerateResult:
        """One completion (see :func:`specdec.rpc.client.build_request` for the parameters)."""
        return await self.generate_request(build_request(prompt, **kwargs), timeout=timeout, metadata=metadata)

    async def generate_request(
        self, req: generate_pb2.GenerateRequest, *, timeout: float | None = None, metadata: Metadata = ()
    ) -> GenerateResult:
        """:meth:`generate` for a request already built; cancelling the awaiting task cancels the call."""
        try:
            resp = await self.stub.Generate(req, timeout=self._timeout(timeout), metadata=tuple(metadata) or None)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None
        return GenerateResult.from_proto(resp)

    async def generate_stream(
        self, prompt: str | None = None, *, timeout: float | None = None, metadata: Metadata = (), **kwargs
    ) -> AsyncIterator[StreamChunk]:
        """Committed chunks as they come; the last has finish_reason, usage and stats."""
        req = build_request(prompt, **kwargs)
        async for chunk in self.stream_request(req, timeout=timeout, metadata=metadata):
            yield chunk

    async def stream_request(
        self, req: generate_pb2.GenerateRequest, *, timeout: float | None = None, metadata: Metadata = ()
    ) -> AsyncIterator[StreamChunk]:
        """:meth:`generate_stream` for a request already built; closing it early cancels the call."""
        call = self.stub.GenerateStream(req, timeout=self._timeout(timeout), metadata=tuple(metadata) or None)
        try:
            async for c in call:
                yield StreamChunk.from_proto(c)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None
        finally:
            call.cancel()  # no-op when finished; else the server drops the job and frees its slots

    async def list_models(self, timeout: float | None = 10.0, metadata: Metadata = ()) -> list[dict[str, Any]]:
        try:
            resp = await self.stub.ListModels(
                generate_pb2.ListModelsRequest(), timeout=timeout, metadata=tuple(metadata) or None
            )
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None
        return [model_dict(m) for m in resp.models]

    async def tokenize(
        self,
        prompt: str | None = None,
        *,
        prompt_token_ids: Sequence[int] | None = None,
        messages: Sequence[Message] | None = None,
        model: str = "",
        chat: bool = False,
        timeout: float | None = 30.0,
        metadata: Metadata = (),
    ) -> TokenizeResult:
        """The prompt's token ids exactly as :meth:`generate` would run them, and their count."""
        req = tokenize_request(prompt, prompt_token_ids, messages, model, chat)
        try:
            resp = await self.stub.Tokenize(req, timeout=timeout, metadata=tuple(metadata) or None)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None
        return TokenizeResult(list(resp.token_ids), resp.count)

    async def health(self, service: str = "", timeout: float | None = 10.0, metadata: Metadata = ()) -> str:
        """grpc.health.v1 status name ("SERVING", "NOT_SERVING", ...)."""
        stub = health_pb2_grpc.HealthStub(self.channel)
        resp = await stub.Check(
            health_pb2.HealthCheckRequest(service=service), timeout=timeout, metadata=tuple(metadata) or None
        )
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> AsyncSpecdecClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
