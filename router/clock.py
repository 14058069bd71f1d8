"""The router's clock: the running event loop's time.

In the service that is ``time.monotonic()`` (asyncio's default loop clock). The capacity simulator
runs the router's own scheduler, drafting and rebalancing code on an event loop whose clock is
simulated time (:mod:`cluster.planning.virtual_loop`), so every timestamp, deadline and measured
duration the router takes must come from here, never from ``time`` directly.
"""

from __future__ import annotations

import asyncio
import time

__all__ = ["now"]


def now() -> float:
    """Seconds on the running loop's clock (``time.monotonic()`` outside a loop)."""
    try:
        return asyncio.get_running_loop().time()
    except RuntimeError:
        return time.monotonic()
