"""The gateway's own span: one SERVER span per HTTP request, child of the caller's ``traceparent``
header and parent of the router's request span (docs/design.md, Telemetry), so a trace shows the
HTTP hop (parsing, the SSE stream to the client) above the router's and the workers' spans.

Installed only while tracing is on (:func:`specdec.rpc.tracing.wanted` when the app is built):
off, the app has no middleware at all and each request costs nothing more. The span covers the
whole response, a stream's last event included, and is named as OpenTelemetry's HTTP conventions
name a server span: ``{method} {route}`` for a route of the app, the method alone otherwise.
"""

from __future__ import annotations

from typing import Any

from opentelemetry import trace

from specdec.rpc import tracing

__all__ = ["HttpSpans"]

_TRACE_HEADERS = (b"traceparent", b"tracestate")


class HttpSpans:
    """ASGI middleware: ``routes`` are the app's paths (a span's name never holds an unknown path,
    which would make every probe of a scanner a span name of its own)."""

    def __init__(self, app: Any, routes: frozenset[str]):
        self.app, self.routes = app, routes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not tracing.active:
            await self.app(scope, receive, send)
            return
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"] if k in _TRACE_HEADERS]
        method, path = scope["method"], scope["path"]
        route = path if path in self.routes else None
        attributes = {"http.request.method": method, "url.path": path, "url.scheme": scope.get("scheme", "http")}
        if route:
            attributes["http.route"] = route
        span = tracing.tracer().start_span(
            f"{method} {route}" if route else method,
            context=tracing.incoming(headers),
            kind=trace.SpanKind.SERVER,
            attributes=attributes,
        )

        async def send_status(message: dict) -> None:
            if message["type"] == "http.response.start":
                status = message["status"]
                span.set_attribute("http.response.status_code", status)
                if status >= 500:  # a server span's error: the server's fault, not the caller's
                    span.set_status(trace.Status(trace.StatusCode.ERROR, str(status)))
                for key, value in message.get("headers", ()):
                    if key == b"x-request-id":
                        span.set_attribute("specdec.request_id", value.decode("latin-1"))
            await send(message)

        with trace.use_span(span, end_on_exit=True):
            await self.app(scope, receive, send_status)
