"""An OTLP trace receiver for tests and benchmarks: a real gRPC server implementing
``opentelemetry.proto.collector.trace.v1.TraceService/Export`` on a free loopback port, keeping every
span it is sent (what a collector would get, decoded from the wire)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from contextlib import contextmanager
from dataclasses import dataclass, field

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


def _value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


@dataclass(frozen=True)
class ReceivedSpan:
    service: str  # the exporting process's service.name
    name: str
    trace_id: str  # hex, as in a traceparent
    span_id: str
    parent_id: str  # "" for a root
    kind: int
    attributes: dict = field(hash=False)
    links: tuple[str, ...] = ()  # the linked spans' ids
    status_code: int = 0  # 2: error
    start_ns: int = 0  # Unix nanoseconds, as exported
    end_ns: int = 0


class _Collector(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.exports = 0
        self.changed = threading.Condition()

    def Export(self, request, context):
        got = []
        for rs in request.resource_spans:
            attrs = {a.key: _value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    got.append(
                        ReceivedSpan(
                            service=str(attrs.get("service.name", "")),
                            name=s.name,
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent_id=s.parent_span_id.hex(),
                            kind=s.kind,
                            attributes={a.key: _value(a.value) for a in s.attributes},
                            links=tuple(link.span_id.hex() for link in s.links),
                            status_code=s.status.code,
                            start_ns=s.start_time_unix_nano,
                            end_ns=s.end_time_unix_nano,
                        )
                    )
        with self.changed:
            self.spans.extend(got)
            self.exports += 1
            self.changed.notify_all()
        return trace_service_pb2.ExportTraceServiceResponse()


class Receiver:
    def __init__(self, collector: _Collector, port: int):
        self._collector = collector
        self.port = port
        self.endpoint = f"http://127.0.0.1:{port}"

    @property
    def spans(self) -> list[ReceivedSpan]:
        with self._collector.changed:
            return list(self._collector.spans)

    @property
    def exports(self) -> int:
        return self._collector.exports

    def clear(self) -> None:
        with self._collector.changed:
            self._collector.spans.clear()

    def wait_for(self, done: Callable[[list[ReceivedSpan]], bool], timeout: float = 20.0) -> list[ReceivedSpan]:
        """The spans once ``done(spans)`` holds; AssertionError with what came after ``timeout``."""
        t_end = time.monotonic() + timeout
        with self._collector.changed:
            while not done(list(self._collector.spans)):
                left = t_end - time.monotonic()
                assert left > 0, (
                    f"spans received so far: {sorted({(s.service, s.name) for s in self._collector.spans})}"
                )
                self._collector.changed.wait(left)
            return list(self._collector.spans)


@contextmanager
def otlp_receiver() -> Iterator[Receiver]:
    collector = _Collector()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield Receiver(collector, port)
    finally:
        server.stop(None)
