"""The gateway's ASGI app: OpenAI's ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions`` and
``/health`` over one async gRPC client of the router (docs/design.md, The API; docs/architecture.md).

The caller's bearer token travels as the gRPC call's own credential, so the router alone decides who
may call (same token file, same per-client limit, same 401); ``x-request-id`` becomes the request's
id, hence the router's access-log ``request_id``, and is echoed; ``traceparent`` goes on to the
router, whose spans join the caller's trace, under the gateway's own span when the gateway traces
(gateway/http_spans.py). A stream's client going away cancels the gRPC call, which frees the
request's KV slots at once.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
import uuid
from collections.abc import Awaitable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from gateway.access import log_refusal
from gateway.api_error import ApiError, from_specdec_error
from gateway.event_stream import EventStreamResponse
from gateway.http_spans import HttpSpans
from gateway.metrics import GatewayMetrics
from gateway.observe import Observed, timing
from gateway.openai_request import OpenAIRequest, parse_chat, parse_completion
from gateway.openai_response import DONE, Reply, models_list, sse
from specdec.rpc import tracing
from specdec.rpc.aio_client import AsyncSpecdecClient
from specdec.rpc.client_credentials import ClientCredentials
from specdec.rpc.client_errors import SpecdecError

log = logging.getLogger(__name__)

__all__ = ["GatewayConfig", "create_app"]

REQUEST_ID_HEADER = "x-request-id"
T = TypeVar("T")


@dataclass
class GatewayConfig:
    """``router``: the router's gRPC address; ``credentials``: how the gateway reaches it (TLS; the
    token is each caller's own); ``timeout``: a deadline per request in seconds (None: none)."""

    router: str = "127.0.0.1:50051"
    credentials: ClientCredentials = field(default_factory=ClientCredentials)
    timeout: float | None = None
    router_server_name: str | None = None  # TLS: the name the router's certificate has, if not its host


class _Models:
    """The router's models: listed on each /v1/models; their default name and fingerprint, which
    every reply carries, worked out once the targets are ready."""

    def __init__(self) -> None:
        self.default_and_fp: tuple[str, str] | None = None
        self.created = int(time.time())

    async def get(self, client: AsyncSpecdecClient, metadata) -> list[dict[str, Any]]:
        models = await client.list_models(metadata=metadata)
        if all(m["ready"] for m in models if m["role"] == "target"):
            self.default_and_fp = _default_and_fingerprint(models)
        return models

    async def default_and_fingerprint(self, client: AsyncSpecdecClient, metadata) -> tuple[str, str]:
        if self.default_and_fp is None:
            return _default_and_fingerprint(await self.get(client, metadata))
        return self.default_and_fp


def _default_and_fingerprint(models: list[dict[str, Any]]) -> tuple[str, str]:
    targets = [m for m in models if m["role"] == "target"]
    facts = json.dumps([[m["name"], m["dtype"], m["device"]] for m in models], sort_keys=True)
    return (targets[0]["name"] if targets else ""), "fp_" + hashlib.sha256(facts.encode()).hexdigest()[:12]


def _metadata(request: Request) -> tuple[tuple[str, str], ...]:
    """The caller's token and trace context (W3C ``traceparent``: the router's span joins its trace,
    as the child of the gateway's span while the gateway traces)."""
    auth = request.headers.get("authorization")
    context = (tracing.outgoing() if tracing.active else ()) or tracing.forwarded(request.headers)
    return ((("authorization", auth),) if auth else ()) + context


def _request_id(request: Request) -> str:
    return request.headers.get(REQUEST_ID_HEADER) or f"req-{uuid.uuid4().hex[:24]}"


async def _json(request: Request) -> dict:
    try:
        body = json.loads(await request.body())
    except (ValueError, UnicodeDecodeError):
        raise ApiError(400, "the request body is not valid JSON", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
    return body


def _error_response(request: Request, err: ApiError) -> JSONResponse:
    """The error, with the request's id; a refusal of the gateway's own (the router never saw the
    request, so wrote no line) gets its access line here (gateway/access.py)."""
    headers = err.headers()
    request_id = request.headers.get(REQUEST_ID_HEADER)
    if not err.relayed:
        request_id = request_id or _request_id(request)
        log_refusal(request.scope, timing(request.scope).t_arrive, err.status, err.code, request_id)
    if request_id:
        headers[REQUEST_ID_HEADER] = request_id
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


async def _cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T:
    """``work``, cancelled (and with it its gRPC call) if the client goes away before it ends."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        task.cancel()

    watcher = asyncio.ensure_future(watch())
    try:
        return await task
    finally:
        watcher.cancel()


def create_app(config: GatewayConfig) -> FastAPI:
    state: dict[str, Any] = {}
    metrics = GatewayMetrics()
    traced = tracing.wanted()  # the OTEL_* variables (specdec/rpc/tracing.py); off: no span code at all

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        traced_now = traced and tracing.setup("specdec-gateway")
        state["client"] = AsyncSpecdecClient(
            config.router,
            timeout=config.timeout,
            credentials=config.credentials,
            server_name=config.router_server_name,
        )
        state["models"] = _Models()
        log.info("gateway: OpenAI-compatible API over the router at %s", config.router)
        try:
            yield
        finally:
            await state["client"].close()
            if traced_now:
                tracing.shutdown()  # exports the spans still batched

    app = FastAPI(title="specdec", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, err: ApiError) -> JSONResponse:
        return _error_response(request, err)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
        kind = "not_found" if exc.status_code == 404 else "invalid_request_error"
        return _error_response(request, ApiError(exc.status_code, str(exc.detail), kind, code=kind))

    @app.get("/metrics")
    async def metrics_text() -> Response:
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/health")
    async def health(request: Request) -> Response:
        # the caller's token goes on: with a token on health (security.exempt without it) the router asks
        try:
            status = await state["client"].health(timeout=5, metadata=_metadata(request))
        except Exception:  # noqa: BLE001 - any failure to reach the router is "not serving"
            status = "UNREACHABLE"
        return JSONResponse(
            {"status": "ok" if status == "SERVING" else status.lower()}, 200 if status == "SERVING" else 503
        )

    @app.get("/v1/models")
    async def list_models(request: Request) -> Response:
        models: _Models = state["models"]
        try:
            found = await models.get(state["client"], _metadata(request))
        except SpecdecError as exc:
            raise from_specdec_error(exc) from None
        return JSONResponse(models_list(found, models.created))

    async def generate(request: Request, parsed: OpenAIRequest, chat: bool) -> Response:
        client: AsyncSpecdecClient = state["client"]
        metadata = _metadata(request)
        rid = parsed.request.request_id
        headers = {REQUEST_ID_HEADER: rid}
        t = timing(request.scope)  # the gateway's own work (gateway/metrics.py)
        if not parsed.stream:
            try:
                t.t_issued = time.perf_counter()
                out = await _cancel_on_disconnect(request, client.generate_request(parsed.request, metadata=metadata))
                t.t_last = time.perf_counter()
                model, fingerprint = await state["models"].default_and_fingerprint(client, metadata)
            except SpecdecError as exc:
                raise from_specdec_error(exc, parsed.renames) from None
            return JSONResponse(Reply(chat, rid, parsed.model or model, fingerprint).whole(out), headers=headers)
        # The first chunk before the status line: a refused request gets its HTTP error status.
        stream = client.stream_request(parsed.request, metadata=metadata)
        try:
            t.t_issued = time.perf_counter()
            first = await anext(stream)
            model, fingerprint = await state["models"].default_and_fingerprint(client, metadata)
        except SpecdecError as exc:
            await stream.aclose()
            raise from_specdec_error(exc, parsed.renames) from None
        except BaseException:
            await stream.aclose()
            raise
        reply = Reply(chat, rid, parsed.model or model, fingerprint)

        async def events():
            chunk = first
            try:
                while True:
                    yield sse(reply.chunk(chunk, parsed.include_usage))
                    # resumed once the server took the bytes: the chunk's time in the gateway
                    metrics.chunk_seconds.observe(time.perf_counter() - chunk.time)
                    if chunk.finish_reason is not None:
                        t.t_last = chunk.time
                        if parsed.include_usage:
                            yield sse(reply.usage_chunk(chunk.usage))
                        yield DONE
                        return
                    try:
                        chunk = await anext(stream)
                    except SpecdecError as exc:  # the status is sent already: the error is an event
                        yield sse(from_specdec_error(exc, parsed.renames).body())
                        return
            finally:
                await stream.aclose()

        return EventStreamResponse(events(), headers=headers)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, parse_completion(await _json(request), _request_id(request)), chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(request, parse_chat(await _json(request), _request_id(request)), chat=True)

    routes = frozenset(r.path for r in app.routes)
    app.add_middleware(Observed, metrics=metrics, routes=routes)
    if traced:
        app.add_middleware(HttpSpans, routes=routes)
    return app
