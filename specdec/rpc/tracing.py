"""OpenTelemetry traces, off unless the standard environment variables ask for them (docs/design.md,
Telemetry).

On when ``OTEL_TRACES_EXPORTER`` names ``otlp``, or when it is unset and
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set; off whatever
else is set when ``OTEL_SDK_DISABLED=true`` or the exporter is ``none``. The spec's default
exporter is otlp; here nothing is exported to a collector nobody named. Spans go by OTLP over gRPC
(the exporter reads its own variables: endpoint, headers, certificates, timeout), batched in a
background thread; ``OTEL_SERVICE_NAME`` / ``OTEL_RESOURCE_ATTRIBUTES`` name the process (default
``specdec-router``, ``specdec-target-worker``, ...), ``OTEL_TRACES_SAMPLER`` samples.

Off, nothing is built: no SDK is imported, no provider exists, and each instrumented place costs
one check of :data:`active` (a module global). The provider is this module's own, not the
process-wide global of ``opentelemetry.trace``, so a process stops tracing cleanly
(:func:`shutdown`) and tracing one service never traces another in the same process.

Context crosses processes as W3C ``traceparent`` (and ``tracestate``) in gRPC metadata: the router
injects it into its calls to the workers (:func:`outgoing`), the workers and the router extract it
from theirs (:func:`incoming`), and the HTTP gateway forwards the caller's headers
(:func:`forwarded`), which needs no SDK at all.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections.abc import Iterable, Mapping
from contextlib import nullcontext
from typing import Any

import grpc
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

log = logging.getLogger(__name__)

__all__ = [
    "active",
    "wanted",
    "setup",
    "shutdown",
    "flush",
    "tracer",
    "outgoing",
    "incoming",
    "forwarded",
    "current",
    "child",
    "server_interceptors",
    "worker_env",
    "WORKER_RPCS",
]

# Whether this process traces: the one check the hot paths make. Read it as ``tracing.active``.
active = False

_PROPAGATOR = TraceContextTextMapPropagator()
_HEADERS = ("traceparent", "tracestate")
# version-traceid-spanid-flags; later versions may append fields (W3C Trace Context, "Versioning")
_TRACEPARENT = re.compile(r"[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}(-[ -~]*)?")
_MAX_HEADER = 512  # tracestate's own bound is 32 members; a longer value is not forwarded

# The worker calls that get spans, on both sides: a round's work and the prompt's tokenizing, not
# the health, Info and Release calls around them.
WORKER_RPCS = frozenset({"Propose", "Prefill", "Verify", "Tokenize"})

_lock = threading.Lock()
_provider: Any = None  # opentelemetry.sdk.trace.TracerProvider while active
_tracer: Any = None
_users = 0  # setup() calls not yet shut down: in-process workers and a router share one provider


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() == "true"


def wanted(env: Mapping[str, str] | None = None) -> bool:
    """Whether ``env`` (default: this process's) asks for traces (see the module's docstring)."""
    env = os.environ if env is None else env
    if _truthy(env.get("OTEL_SDK_DISABLED")):
        return False
    exporters = {e.strip().lower() for e in env.get("OTEL_TRACES_EXPORTER", "").split(",") if e.strip()}
    if exporters:
        other = exporters - {"otlp", "none"}
        if other:
            log.warning("OTEL_TRACES_EXPORTER: only otlp is supported here; ignoring %s", ", ".join(sorted(other)))
        return "otlp" in exporters
    return bool(env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT"))


def setup(service_name: str) -> bool:
    """Start tracing in this process if the environment asks for it; True when tracing is on.
    ``service_name`` is the default ``service.name`` (``OTEL_SERVICE_NAME`` wins). Each call that
    returns True is paired with one :func:`shutdown`."""
    global active, _provider, _tracer, _users
    with _lock:
        if _provider is not None:
            _users += 1
            return True
        if not wanted():
            return False
        # the SDK and the exporter are imported only here: a process that does not trace never loads them
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        if protocol and protocol.strip() != "grpc":
            log.warning("OTEL_EXPORTER_OTLP_PROTOCOL=%s: only grpc is installed; exporting over grpc", protocol)
        resource = Resource.create()  # OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES
        if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
            resource = resource.merge(Resource({SERVICE_NAME: service_name}))
        provider = TracerProvider(resource=resource)  # the sampler: OTEL_TRACES_SAMPLER
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        _provider, _tracer, _users, active = provider, provider.get_tracer("specdec"), 1, True
        log.info("tracing on: %s exports spans by OTLP", resource.attributes.get(SERVICE_NAME))
        return True


def shutdown() -> None:
    """Undo one :func:`setup`; the last one exports what is left and turns tracing off."""
    global active, _provider, _tracer, _users
    with _lock:
        if _provider is None:
            return
        _users -= 1
        if _users > 0:
            return
        provider, _provider, _tracer, active = _provider, None, None, False
    provider.shutdown()  # flushes the batch; outside the lock: it may wait on the collector


def flush() -> bool:
    """Export every span ended so far (benchmarks, tests); True when done, or when tracing is off."""
    provider = _provider
    return True if provider is None else provider.force_flush()


def tracer() -> Any:
    """This process's tracer (None while tracing is off)."""
    return _tracer


# ---- propagation -------------------------------------------------------------------------------


def outgoing() -> tuple[tuple[str, str], ...]:
    """The current span's context as gRPC metadata pairs (none without a span)."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier)
    return tuple(carrier.items())


def incoming(metadata: Iterable[tuple[str, Any]] | None) -> otel_context.Context:
    """The caller's context from a call's invocation metadata (an empty one without ``traceparent``)."""
    carrier = {k: v for k, v in metadata or () if k in _HEADERS and isinstance(v, str)}
    return _PROPAGATOR.extract(carrier)


def forwarded(headers: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """The caller's ``traceparent`` / ``tracestate`` HTTP headers as gRPC metadata, kept only when
    well formed (printable ASCII, bounded): a value gRPC refuses would fail the call."""
    parent = headers.get("traceparent", "").strip()
    if len(parent) > _MAX_HEADER or not _TRACEPARENT.fullmatch(parent):
        return ()
    pairs = [("traceparent", parent)]
    state = headers.get("tracestate", "").strip()
    if state and len(state) <= _MAX_HEADER and all(" " <= c <= "~" for c in state):
        pairs.append(("tracestate", state))
    return tuple(pairs)


# ---- spans -------------------------------------------------------------------------------------


def current(span: Any) -> Any:
    """A context manager making ``span`` the current one (nothing for None), so calls started
    inside carry it."""
    if span is None:
        return nullcontext()
    return trace.use_span(span, end_on_exit=False)


class Child:
    """A span under the current one, current itself until :meth:`close` (same task)."""

    def __init__(self, name: str, attributes: Mapping[str, Any] | None = None):
        self.span = _tracer.start_span(name, attributes=attributes)
        self._token = otel_context.attach(trace.set_span_in_context(self.span))

    def close(self, error: BaseException | None = None) -> None:
        if error is not None:
            self.span.set_status(trace.Status(trace.StatusCode.ERROR, str(error)))
        otel_context.detach(self._token)
        self.span.end()


def child(name: str, attributes: Mapping[str, Any] | None = None) -> Child | None:
    """:class:`Child`, or None while tracing is off."""
    return Child(name, attributes) if active else None


# ---- the workers' side -------------------------------------------------------------------------


def _rows(request: Any) -> int | None:
    for name in ("items", "sequences"):  # Verify's items; Propose's and Prefill's sequences
        if hasattr(request, name):
            return len(getattr(request, name))
    return None


class _ServerSpans(grpc.ServerInterceptor):
    """A SERVER span around each call of :data:`WORKER_RPCS`, child of the caller's ``traceparent``."""

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        method = handler_call_details.method or ""
        service, _, name = method[1:].rpartition("/")
        if handler is None or handler.unary_unary is None or name not in WORKER_RPCS or not active:
            return handler
        inner, parent = handler.unary_unary, incoming(handler_call_details.invocation_metadata)

        def traced(request, context):
            attributes = {"rpc.system": "grpc", "rpc.service": service, "rpc.method": name}
            with _tracer.start_as_current_span(
                method[1:], context=parent, kind=trace.SpanKind.SERVER, attributes=attributes
            ) as span:
                rows = _rows(request)
                if rows is not None:
                    span.set_attribute("specdec.rows", rows)
                return inner(request, context)

        return grpc.unary_unary_rpc_method_handler(
            traced,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


def server_interceptors() -> list[grpc.ServerInterceptor]:
    """Interceptors tracing a worker's :data:`WORKER_RPCS` on its sync server (none while tracing is off)."""
    return [_ServerSpans()] if active else []


def worker_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The ``OTEL_*`` variables a worker actor needs to trace as this process does: its
    ``runtime_env`` carries them to nodes whose Ray was started elsewhere. Not the exporter's
    headers: they may hold a collector's credentials, and Ray writes a runtime_env's env_vars to
    its logs; workers take those from their node's environment."""
    env = os.environ if env is None else env
    return {k: v for k, v in env.items() if k.startswith("OTEL_") and "HEADERS" not in k}
