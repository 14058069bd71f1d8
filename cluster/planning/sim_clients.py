"""``specdec bench serve``'s closed-loop clients, as the simulator replays them."""

from __future__ import annotations

import math

from cluster.planning.workload import SimRequestSpec

__all__ = ["CLIENT_STAGGER_S", "ClosedLoopClients"]

# A closed loop's clients send requests that fall due together this far apart (bench serve's
# records show 0.2-0.4 ms), so the router's next round starts on the first alone, as the service's
# does; sent at one instant, a simulated round would take them all and split their prompts into
# chunks the service never sends.
CLIENT_STAGGER_S = 0.00025


class ClosedLoopClients:
    """The requests in order, each sent when asked for (a client's last request ended) and
    CLIENT_STAGGER_S after the one sent before it."""

    def __init__(self, requests: list[SimRequestSpec]):
        self.requests = requests
        self.sent = 0
        self._last_send = -math.inf

    def send(self, now: float) -> tuple[int, SimRequestSpec, float] | None:
        """The next request's index, the request, and when it arrives; None when all were sent."""
        if self.sent >= len(self.requests):
            return None
        index, spec = self.sent, self.requests[self.sent]
        self.sent += 1
        self._last_send = max(now, self._last_send + CLIENT_STAGGER_S)
        return index, spec, self._last_send
