"""The gateway's own Prometheus metrics, served on its HTTP port at ``/metrics`` (docs/design.md, The
HTTP API): requests by endpoint and status, and the gateway's own work measured directly, apart from
the time it waits on the router:

* ``specdec_gateway_request_seconds``: per request, from the request arriving to its gRPC call
  issued, plus from the call's last message received to the response finished;
* ``specdec_gateway_chunk_seconds``: per streamed chunk, from its gRPC message received to its SSE
  bytes handed to the HTTP server.

A speculation round takes hundreds of milliseconds on a CPU, so the end-to-end HTTP - gRPC
difference of a benchmark is noise at the millisecond scale; these are what `specdec bench serve
--api http` reports as the gateway's cost (specdec/bench/serve_http.py).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

__all__ = ["GatewayMetrics", "REQUESTS", "REQUEST_SECONDS", "CHUNK_SECONDS", "OWN_WORK_BUCKETS"]

REQUESTS = "specdec_gateway_requests"
REQUEST_SECONDS = "specdec_gateway_request_seconds"
CHUNK_SECONDS = "specdec_gateway_chunk_seconds"
# From 25 us to 100 ms: the targets (5 ms per request, 1 ms per chunk) sit mid-range, resolved finely.
OWN_WORK_BUCKETS = (
    25e-6, 50e-6, 100e-6, 200e-6, 300e-6, 500e-6, 750e-6,
    1e-3, 1.5e-3, 2e-3, 3e-3, 5e-3, 7.5e-3, 10e-3, 20e-3, 50e-3, 100e-3,
)  # fmt: skip


class GatewayMetrics:
    """One registry per app (an app built twice in one process counts apart)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            REQUESTS, "HTTP requests by endpoint and status", ["endpoint", "status"], registry=self.registry
        )
        self.request_seconds = Histogram(
            REQUEST_SECONDS,
            "the gateway's own work per request: arrival to gRPC call issued, plus last gRPC message to "
            "response finished",
            buckets=OWN_WORK_BUCKETS,
            registry=self.registry,
        )
        self.chunk_seconds = Histogram(
            CHUNK_SECONDS,
            "the gateway's own work per streamed chunk: gRPC message received to its SSE bytes sent",
            buckets=OWN_WORK_BUCKETS,
            registry=self.registry,
        )

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
