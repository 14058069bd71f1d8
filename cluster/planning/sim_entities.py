"""What the simulator's schedulers work on: devices (processor sharing), workers (one call at a
time, in order), the calls, the requests, and the target groups. Their fields carry the names the
router's rebalancing code reads
(``router.target_balance.TargetBalance`` reads a scheduler's ``cfg``, ``target``, ``waiting``,
``running``, ``capacity``, ``cost``, ``metrics``, ``drafting.pool``; ``router.drafter_pool.DrafterPool``
a worker client's ``name``, ``up``, ``telemetry``, ``info``; both a job's drafting fields), so
that code runs here unchanged."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from cluster.planning.workload import SimRequestSpec
from specdec.core.request_state import RequestState

__all__ = [
    "CLIENT_STAGGER_S",
    "ClosedLoopClients",
    "Call",
    "Until",
    "Device",
    "Worker",
    "SimTelemetry",
    "SimClient",
    "PreDraft",
    "Job",
    "Group",
]


class Call:
    """One RPC's compute: ``work`` seconds at its device's full speed. ``start`` / ``end``: when it
    began and stopped running on the device (None until then)."""

    def __init__(self, work: float):
        self.work = work
        self.left = work  # as of its device's last update
        self.start: float | None = None
        self.end: float | None = None
        self._then: list[Callable[[], None]] = []
        self._finished: Callable[[], None] | None = None  # its worker's next call

    @property
    def done(self) -> bool:
        return self.end is not None

    def on_done(self, fn: Callable[[], None]) -> None:
        if self.done:
            fn()
        else:
            self._then.append(fn)


@dataclass
class Until:
    """What a simulated coroutine yields to wait for every call in ``calls``, or time ``t``,
    whichever comes first."""

    calls: list[Call]
    t: float


class Device:
    """A device as processor sharing: the calls running on it (one per worker at most: a worker
    runs one batch RPC at a time) split its speed equally. A draft worker on its target's device
    (``Deployment.colocated``, e.g. one CPU machine) then slows the target while both compute, as
    two processes on the same cores do, instead of waiting for it; and the target's telemetry
    reads busy for as long as its call runs."""

    def __init__(self, at: Callable[[float, Callable[[], None]], None], clock: Callable[[], float]):
        self.at, self.clock = at, clock
        self.running: list[Call] = []
        self._t = 0.0
        self._plan = 0  # bumped on every change: an earlier completion event is stale

    def advance(self) -> None:
        """Bring the running calls' work left up to now."""
        now = self.clock()
        if self.running:
            done = (now - self._t) / len(self.running)
            for c in self.running:
                c.left -= done
        self._t = now

    def run(self, call: Call, finished: Callable[[], None]) -> None:
        self.advance()
        call.start, call._finished = self.clock(), finished
        self.running.append(call)
        self._next_end()

    def _next_end(self) -> None:
        self._plan += 1
        if self.running:
            plan, c = self._plan, min(self.running, key=lambda c: c.left)
            self.at(self._t + max(0.0, c.left) * len(self.running), lambda: self._end(c, plan))

    def _end(self, c: Call, plan: int) -> None:
        if plan != self._plan:
            return
        self.advance()
        self.running.remove(c)
        c.left, c.end = 0.0, self.clock()
        self._next_end()
        c._finished()
        then, c._then = c._then, []
        for fn in then:
            fn()


class Worker:
    """A worker process: one batch RPC at a time, in the order they are sent (the worker client's
    lock), each running on its device. ``busy``: seconds its calls ran (stretched while they
    shared the device); ``late``: a Propose that missed its round's deadline and still runs (new
    Proposes fail open meanwhile)."""

    def __init__(self, device: Device):
        self.device = device
        self.queue: deque[Call] = deque()
        self.current: Call | None = None
        self.busy = 0.0
        self.late: Call | None = None

    def submit(self, call: Call) -> None:
        self.queue.append(call)
        if self.current is None:
            self._next()

    def _next(self) -> None:
        if self.current is not None:
            self.busy += self.current.end - self.current.start
        self.current = self.queue.popleft() if self.queue else None
        if self.current is not None:
            self.device.run(self.current, self._next)

    @property
    def late_busy(self) -> bool:
        return self.late is not None and not self.late.done

    def free_at(self) -> float:
        """When its calls sent so far would be done, if nothing else starts on the device (its
        share stays what it is, or what it would be with one more call running)."""
        dev = self.device
        dev.advance()
        left = (self.current.left if self.current is not None else 0.0) + sum(c.work for c in self.queue)
        sharing = len(dev.running) + (0 if self.current is not None else 1)
        return dev.clock() + left * max(1, sharing)


@dataclass
class SimTelemetry:
    """A device's telemetry as the rebalancer reads it: the busy fraction of the last period (NVML's
    utilization); no GPM SM activity."""

    load: float | None = None
    sm_active: float | None = None


@dataclass
class SimClient:
    """A worker as the router's pool and balance code see it (a WorkerClient's readable fields)."""

    name: str
    role: str
    worker: Worker
    slots: int
    up: bool = True
    restarts: int = 0  # simulated workers never restart
    telemetry: SimTelemetry = field(default_factory=SimTelemetry)
    calls: list = field(default_factory=list)  # its calls not yet past a telemetry sample
    noise: Callable[[], float] | None = None  # a factor on each call's work (Deployment.jitter)

    @property
    def info(self) -> Any:
        # workers on one simulated device (a colocated drafter and its target) share a placement
        return SimpleNamespace(num_slots=self.slots, placement=f"sim/{id(self.worker.device)}")

    def submit(self, work: float, at: float | None = None) -> Call:
        """Send a call of ``work`` seconds to its worker, now or at time ``at``."""
        call, device = Call(work * self.noise() if self.noise and work > 0 else work), self.worker.device
        if work > 0:
            self.calls.append(call)
        if at is None or at <= device.clock():
            self.worker.submit(call)
        else:
            device.at(at, lambda: self.worker.submit(call))
        return call

    def busy_in(self, t0: float, t1: float) -> float:
        """Seconds its calls ran within [t0, t1] (a worker's busy clock as its telemetry reads it:
        compute while it runs, not while it queues; a colocated drafter's calls are not the
        target's); forgets calls that ended before t0."""
        self.calls = [c for c in self.calls if c.end is None or c.end > t0]
        return sum(
            max(0.0, min(t1 if c.end is None else c.end, t1) - max(c.start, t0))
            for c in self.calls
            if c.start is not None
        )


@dataclass
class PreDraft:
    drafter: str
    call: Call  # the pre-draft Propose
    k: int  # draft tokens it holds after the guessed bonus token


@dataclass(eq=False)
class Job:
    spec_in: SimRequestSpec
    key: str
    state: RequestState
    spec: str
    auto: bool
    t_arrival: float
    t_first: float | None = None
    t_last: float | None = None
    t_end: float | None = None
    in_flight: bool = False
    done: bool = False
    draft_cached: int = 0  # tokens its drafter was sent (Prefill chunks, Proposes): router Job.draft_fed
    predraft: PreDraft | None = None
    last_all_accepted: bool = False  # the previous round accepted every draft token ...
    last_bonus_match: bool = False  # ... and the drafter's next token was the target's bonus token
    outcome: tuple[int, int, bool] = (0, 0, False)  # this round: drafted, accepted, bonus match
    error: str | None = None
    # the router Job's drafting and speculation-switch fields (router/jobs.py)
    drafter: str | None = None
    drafter_at: float | None = None
    moved_from: str | None = None
    drafters: set[str] = field(default_factory=set)
    spec_off: bool = False
    spec_changed_at: float = -math.inf
    spec_planned: bool = False

    def fed_to(self, drafter: str) -> int:
        """router Job.fed_to: tokens of it ``drafter`` holds (only its current one holds any)."""
        return self.draft_cached if drafter == self.drafter else 0


@dataclass
class Group:
    """One target group and its scheduler's state."""

    index: int
    target: SimClient
    home: str | None  # its own drafter (static pairing)
    capacity: int
    cost: Any  # the router's CostMeter
    cfg: Any  # the RouterConfig
    metrics: Any  # a router Metrics (the balance code counts its actions there)
    drafting: Any  # SimpleNamespace(pool=DrafterPool | None)
    balance: Any = None  # the router's TargetBalance over this group
    waiting: deque = field(default_factory=deque)
    running: list = field(default_factory=list)
    parked: list = field(default_factory=list)
    verify_ema: float | None = None
    rounds: int = 0
    batch_rows: int = 0
    split: dict[str, float] = field(
        default_factory=lambda: dict.fromkeys(("draft_wait", "verify", "prefill", "router"), 0.0)
    )
    drafted: int = 0
    accepted: int = 0
    fail_open: int = 0
    predraft_hits: int = 0
    predraft_misses: int = 0
    peak_running: int = 0


# A closed loop's clients send requests that fall due together this far apart (bench serve's records:
# 0.2-0.4 ms), so the router's next round starts on the first alone, as the service's did at every
# closed scenario's start in the fifteenth session's calibrations; sent at one instant, the simulated
# round took them all and split their prompts into chunks the service never sent (bench/NOTES.md).
CLIENT_STAGGER_S = 0.00025


class ClosedLoopClients:
    """bench serve's closed-loop clients: the requests in order, each sent when asked for (a
    client's last request ended) and CLIENT_STAGGER_S after the one sent before it."""

    def __init__(self, requests: list[SimRequestSpec]):
        self.requests = requests
        self._next = 0
        self._last_send = -math.inf

    def send(self, now: float) -> tuple[SimRequestSpec, float] | None:
        """The next request and when it arrives; None when all were sent."""
        if self._next >= len(self.requests):
            return None
        spec = self.requests[self._next]
        self._next += 1
        self._last_send = max(now, self._last_send + CLIENT_STAGGER_S)
        return spec, self._last_send
