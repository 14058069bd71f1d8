"""Retry delays the router can stand behind, sent as google.rpc.RetryInfo.

RESOURCE_EXHAUSTED (a full queue): :class:`DrainEstimate` measures how fast a scheduler finishes
requests (its last ``window`` ends) and says when the requests now waiting, plus the caller's,
will have left the queue. UNAVAILABLE (a target restarting): :func:`recovery_estimate` says when
the worker is expected back, from how long its last recovery took.
"""

from __future__ import annotations

from collections import deque

from router import clock

__all__ = ["DrainEstimate", "recovery_estimate", "worker_recovery_estimate", "MIN_RETRY_S", "MAX_RETRY_S"]

MIN_RETRY_S = 0.05
MAX_RETRY_S = 60.0
UNKNOWN_RETRY_S = 1.0  # nothing measured yet: a short delay, the next answer will know more
UNKNOWN_RECOVERY_S = 5.0  # a worker that has never recovered: a restart takes seconds at least


def _clamp(seconds: float) -> float:
    return min(MAX_RETRY_S, max(MIN_RETRY_S, seconds))


class DrainEstimate:
    """Request ends of one scheduler -> seconds until its queue has room again."""

    def __init__(self, window: int = 32):
        self._ends: deque[float] = deque(maxlen=window)

    def finished(self, now: float | None = None) -> None:
        self._ends.append(clock.now() if now is None else now)

    def seconds(self, waiting: int, now: float | None = None) -> float:
        """Time for ``waiting`` queued requests and one more to be admitted, at the recent rate of
        request ends (a rate that decays while nothing ends, so an idle spell gives a longer delay)."""
        if not self._ends:
            return UNKNOWN_RETRY_S
        now = clock.now() if now is None else now
        rate = len(self._ends) / max(now - self._ends[0], 1e-3)
        return _clamp((waiting + 1) / rate)


def recovery_estimate(last_recovery_s: float | None, down_for_s: float) -> float:
    """When a worker down for ``down_for_s`` should be back: its last recovery's length minus the
    time already waited (at least a second); a worker that never recovered: UNKNOWN_RECOVERY_S."""
    if last_recovery_s is None:
        return max(UNKNOWN_RECOVERY_S - down_for_s, 1.0)
    return _clamp(max(last_recovery_s - down_for_s, 1.0))


def worker_recovery_estimate(worker, now: float | None = None) -> float:
    """:func:`recovery_estimate` for a :class:`router.workers.WorkerClient`."""
    now = clock.now() if now is None else now
    down_for = now - worker.down_since if not worker.up and worker.down_since is not None else 0.0
    return recovery_estimate(worker.last_recovery_s, down_for)
