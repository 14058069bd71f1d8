"""ASGI middleware that times each request and counts it by endpoint and status (gateway/metrics.py).

It puts a :class:`Timing` in the request's scope; the handler fills in when the gRPC call was issued
and when its last message came, and the middleware notes when the response's last bytes were handed
to the server. A request that never reached the router (refused by the gateway itself) counts, but
has no own-work time; nor has a response cut short by its client going away.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from gateway.metrics import GatewayMetrics

__all__ = ["Observed", "Timing", "timing"]

_KEY = "specdec.timing"


@dataclass
class Timing:
    """``time.perf_counter`` readings (StreamChunk.time is one too)."""

    t_arrive: float
    t_issued: float | None = None
    t_last: float | None = None
    t_done: float | None = None

    def own_work(self) -> float | None:
        if self.t_issued is None or self.t_last is None or self.t_done is None:
            return None
        return (self.t_issued - self.t_arrive) + (self.t_done - self.t_last)


def timing(scope: dict[str, Any]) -> Timing:
    """The request's timing (a fresh one when the middleware is not installed: nothing is lost)."""
    return scope.get(_KEY) or scope.setdefault(_KEY, Timing(time.perf_counter()))


class Observed:
    """``routes``: the app's paths; any other path is counted as endpoint ``other`` (a scanner's
    probes must not make a series each)."""

    def __init__(self, app: Any, metrics: GatewayMetrics, routes: frozenset[str]):
        self.app, self.metrics, self.routes = app, metrics, routes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t = scope[_KEY] = Timing(time.perf_counter())
        status = 500  # what the server answers when the app raises before starting a response

        async def observed_send(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                t.t_done = time.perf_counter()

        try:
            await self.app(scope, receive, observed_send)
        finally:
            endpoint = scope["path"] if scope["path"] in self.routes else "other"
            self.metrics.requests.labels(endpoint, str(status)).inc()
            own = t.own_work()
            if own is not None:
                self.metrics.request_seconds.observe(own)
