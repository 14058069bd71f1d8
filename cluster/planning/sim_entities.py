"""What the simulator's schedulers work on: workers as FIFO resources, the requests, and the target
groups. Their fields carry the names the router's rebalancing code reads
(``router.target_balance.TargetBalance`` reads a scheduler's ``cfg``, ``target``, ``waiting``,
``running``, ``capacity``, ``cost``, ``metrics``, ``drafting.pool``; ``router.drafter_pool.DrafterPool``
a worker client's ``name``, ``up``, ``telemetry``, ``info``; both a job's drafting fields), so
that code runs here unchanged."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from cluster.planning.workload import SimRequestSpec
from specdec.core.request_state import RequestState

__all__ = ["Worker", "SimTelemetry", "SimClient", "PreDraft", "Job", "Group"]


class Worker:
    """A worker that runs one batch RPC at a time, in the order they are sent (the worker client's
    lock). ``busy`` counts booked compute seconds; ``late_until``: a Propose that missed its
    round's deadline runs until then (new Proposes fail open meanwhile)."""

    def __init__(self) -> None:
        self.free_at = 0.0
        self.busy = 0.0
        self.late_until = -math.inf

    def reserve(self, now: float, duration: float) -> tuple[float, float]:
        start = max(now, self.free_at)
        self.free_at = start + duration
        self.busy += duration
        return start, self.free_at


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
    booked: list = field(default_factory=list)  # (start, end) of its own calls not yet past a sample

    @property
    def info(self) -> Any:
        return SimpleNamespace(num_slots=self.slots)

    def reserve(self, now: float, duration: float) -> tuple[float, float]:
        """Book a call on its worker (``Worker.reserve``), remembered for this client's telemetry."""
        start, end = self.worker.reserve(now, duration)
        if duration > 0:
            self.booked.append((start, end))
        return start, end

    def busy_in(self, t0: float, t1: float) -> float:
        """Seconds of its own calls that ran within [t0, t1] (a worker's busy clock as its telemetry
        reads it: compute while it runs, not when it is booked; a colocated drafter's calls are not
        the target's); forgets calls that ended before t0."""
        self.booked = [(s, e) for s, e in self.booked if e > t0]
        return sum(max(0.0, min(e, t1) - max(s, t0)) for s, e in self.booked)


@dataclass
class PreDraft:
    drafter: str
    end: float  # when the pre-draft Propose returns
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
