"""The draft workers as one pool shared by every target scheduler, and where each request drafts.

Per drafter the pool measures seconds per draft step (EWMA of each Propose's wall time, queueing
behind other rounds included, divided by its draft length), counts the calls in flight, and keeps
the requests it drafts for; telemetry (router/telemetry_loop.py) adds the device load.

Proposes for one drafter from several targets (or lanes) that wait while it is busy are sent as one
batched call when it is free (:meth:`DrafterPool.propose`): a batched draft step costs about what a
single one does, so a shared drafter serves several targets without serialising their rounds. Per request
(:class:`router.jobs.Job`): ``drafter`` (where its drafts come from now), ``drafter_at`` (when it
was placed or moved) and ``drafters`` (every drafter that may hold a KV slot for it: all are
released when it ends).

:meth:`DrafterPool.assign` asks the policy (:func:`router.drafter_choice.assign_drafter`) and applies the
answer; moves and failovers are logged and counted. With ``rebalance.enabled`` false every target
keeps its own drafter (static pairing, as before the rebalancer). A drafter that is down drops out
(its requests fail over, or fail open when none is left) and is used again once it answers.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from router.clock import now
from router.config import RouterConfig
from router.drafter_choice import assign_drafter
from router.jobs import Job
from router.metrics import Metrics
from router.views import REF_K, DrafterView
from router.workers import WorkerClient, WorkerUnavailable
from specdec.core.request_state import LineFit
from specdec.rpc import worker_pb2

log = logging.getLogger(__name__)

__all__ = ["DrafterPool"]

_calls = itertools.count()
_FIT_WEIGHT = 0.2  # of each call in a drafter's wait line
_SURPRISE = 2.0  # a call this many times slower (or faster) than the line predicts is a surprise ...
_SURPRISES = 3  # ... and this many in a row mean the drafter changed: the fit starts over
_SETTLED = 6  # calls in a fit before it is trusted to call anything a surprise
_QUEUE_WEIGHT = 0.05  # of each call in the queueing estimate: spikes (a draft prefill ahead) fade out


@dataclass
class _Waiter:
    seqs: list[worker_pb2.Sequence]
    future: asyncio.Future
    started: list | None  # gets True when the call carrying these sequences is sent
    t0: float  # the pool's clock when it was queued
    prefill_tokens: int = 0  # new tokens beyond a round's that it prefills (its time is then not a draft step's)
    predraft: bool = False  # drafts the next round while the target verifies this one


@dataclass
class _Drafter:
    client: WorkerClient
    step_s: float | None = None  # at REF_K, from the line when there is one, else the EWMA per step
    fixed_s: float = 0.0
    run_step_s: float | None = None  # EWMA of a Propose's run per draft step, queueing excluded
    queue_s: float = 0.0  # long-memory EWMA of a Propose's wait before it ran
    prefill_token_s: float | None = None  # EWMA of its prefill's seconds per new token
    measured_at: float = -math.inf
    waits: LineFit = field(default_factory=lambda: LineFit(_FIT_WEIGHT))  # a call's wait by its draft steps
    surprises: int = 0  # consecutive calls far off the fitted line (+ slower, - faster)
    calls: int = 0  # calls in the current fit
    restarts: int = 0  # the client's restart count when last measured
    running: dict[int, tuple[float, int]] = field(default_factory=dict)  # call -> (start, draft steps)
    jobs: dict[str, str | None] = field(default_factory=dict)  # requests drafting here -> their target
    late: asyncio.Task | None = None  # a Propose that missed its round's deadline, still running
    queue: list[_Waiter] = field(default_factory=list)  # Proposes waiting to be sent (coalesced)
    sender: asyncio.Task | None = None


class DrafterPool:
    def __init__(self, config: RouterConfig, metrics: Metrics, clock: Callable[[], float] = now):
        self.cfg = config
        self.clock = clock  # the router clock; a unit test may drive its own
        self.policy = config.drafter_choice
        self.metrics = metrics
        self._d: dict[str, _Drafter] = {}
        self.draining: set[str] = set()  # no new work: seen as down by the placement policy

    # ---- membership (autoscaling adds and removes drafters) -----------------------------------------
    def add(self, client: WorkerClient) -> None:
        if client.name in self._d:
            raise ValueError(f"draft worker {client.name!r} is already in the pool")
        self._d[client.name] = _Drafter(client)

    def remove(self, name: str) -> None:
        """Drop a drafter: its requests fail over at their next round (their slots there are released)."""
        self._d.pop(name, None)
        self.draining.discard(name)

    def drain(self, name: str) -> None:
        """Take no new work on ``name``; its requests move to other drafters at their next round."""
        self.draining.add(name)

    @property
    def clients(self) -> list[WorkerClient]:
        return [d.client for d in self._d.values()]

    def client(self, name: str | None) -> WorkerClient | None:
        d = self._d.get(name) if name is not None else None
        return d.client if d is not None else None

    def __len__(self) -> int:
        return len(self._d)

    # ---- Propose, coalesced per drafter ---------------------------------------------------------------
    async def propose(
        self,
        name: str,
        seqs: list[worker_pb2.Sequence],
        started: list | None = None,
        prefill_tokens: int = 0,
        predraft: bool = False,
    ) -> list[worker_pb2.Draft]:
        """Drafts for ``seqs`` from drafter ``name``, sent with whatever else waits for it. Cancelling
        a call that was not sent yet withdraws it; ``started`` gets True once it is sent. A call
        carrying ``prefill_tokens`` (more new tokens than a round commits) does not update the drafter's
        step time: it prefills them.
        ``predraft``: drafts for the next round, sent while the target verifies this one."""
        d = self._d.get(name)
        if d is None:
            raise WorkerUnavailable(f"draft worker {name} left the pool")
        w = _Waiter(seqs, asyncio.get_running_loop().create_future(), started, self.clock(), prefill_tokens, predraft)
        d.queue.append(w)
        if d.sender is None or d.sender.done():
            d.sender = asyncio.get_running_loop().create_task(self._send(name, d))
        try:
            return await asyncio.shield(w.future)
        except asyncio.CancelledError:
            if w in d.queue:
                d.queue.remove(w)
            raise

    async def _send(self, name: str, d: _Drafter) -> None:
        while d.queue:
            async with d.client.lock:
                batch, ids, rest = [], set(), []
                for w in d.queue:  # one call never holds a request twice (a pre-draft and its redraft)
                    mine = {s.request_id for s in w.seqs}
                    if mine & ids:
                        rest.append(w)
                    else:
                        batch.append(w)
                        ids |= mine
                d.queue = rest
                if batch:  # empty when every waiter was withdrawn while the client was busy
                    await self._call(name, d, batch)

    async def _call(self, name: str, d: _Drafter, batch: list[_Waiter]) -> None:
        seqs = [s for w in batch for s in w.seqs]
        prefill = sum(w.prefill_tokens for w in batch)
        longest = max(s.k for s in seqs)
        steps = longest if not prefill else 0  # 0: not a draft step's time
        predraft = any(w.predraft for w in batch)
        since = min(w.t0 for w in batch)  # when its first sequence started waiting
        for w in batch:
            if w.started is not None:
                w.started.append(True)  # the call reaches the worker now (before: only queued here)
        call = self.begin(name, steps)
        t_sent = self.clock()  # inside the client lock: no other Propose or Prefill runs on it
        queued = self.clock() - since
        try:
            resp, compute = await d.client.call_timed(
                "Propose", worker_pb2.ProposeRequest(sequences=seqs), timeout=self.cfg.rpc_timeout_s
            )
            if len(resp.drafts) != len(seqs):
                raise WorkerUnavailable(f"draft worker answered {len(resp.drafts)} drafts for {len(seqs)} sequences")
        except Exception as exc:  # noqa: BLE001 - every waiter gets the failure (fail open)
            self.end(name, call, False)
            for w in batch:
                if not w.future.done():
                    w.future.set_exception(exc)
                    w.future.exception()  # retrieved: a withdrawn waiter must not warn
            return
        wall = self.clock() - t_sent
        self.end(name, call, True, since=since)
        log.debug(
            "propose on %s: %d rows, %d steps, %d new tokens%s; queued %.0f ms, ran %.0f ms (computed %s)",
            name, len(seqs), longest, prefill, " (pre-draft)" if predraft else "", 1e3 * queued, 1e3 * wall,
            "-" if compute is None else f"{1e3 * compute:.0f}",
        )  # fmt: skip
        self.metrics.draft_sequences.labels(name).inc(len(seqs))
        if prefill:
            self.observe_prefill(name, wall if compute is None else compute, prefill, longest)
        if compute is not None and not predraft:
            if steps > 0:
                self.metrics.record_propose(compute, wall, len(seqs), steps)
            else:
                self.metrics.record_prefilling_propose(compute, len(seqs), longest, prefill)
        i = 0
        for w in batch:
            if not w.future.done():
                w.future.set_result(list(resp.drafts[i : i + len(w.seqs)]))
            i += len(w.seqs)

    # ---- measurements --------------------------------------------------------------------------
    def begin(self, name: str, steps: int) -> int:
        call = next(_calls)
        d = self._d.get(name)
        if d is not None:
            d.running[call] = (self.clock(), steps)
        return call

    def end(self, name: str, call: int, ok: bool, since: float | None = None, started: float | None = None) -> None:
        """A call is over; a successful Propose updates the drafter's seconds per step (from
        ``since``, when its sequences started waiting: queueing counts) and its run time per step
        (from ``started``, when the worker took it; default: when it was sent)."""
        d = self._d.get(name)
        if d is None or call not in d.running:
            return
        t0, steps = d.running.pop(call)
        if not ok or steps <= 0:
            return
        now = self.clock()
        wait = now - (t0 if since is None else min(since, t0))
        fresh = now - d.measured_at <= self.policy.stale_s and d.step_s is not None
        if fresh and d.calls >= _SETTLED:
            predicted = d.fixed_s + max(0.0, d.step_s - d.fixed_s / REF_K) * steps
            off = 1 if wait > _SURPRISE * predicted else -1 if wait * _SURPRISE < predicted else 0
            d.surprises = d.surprises + off if off and off * d.surprises >= 0 else off
            if abs(d.surprises) >= _SURPRISES:
                log.info(
                    "draft worker %s changed speed (%.1f ms for %d steps, expected %.1f)",
                    name,
                    1000 * wait,
                    steps,
                    1000 * predicted,
                )
                fresh, d.surprises = False, 0
        if not fresh:
            d.waits, d.calls = LineFit(_FIT_WEIGHT), 0  # a new regime (first call, back after a pause, or changed)
            d.run_step_s, d.queue_s = None, 0.0
        ran = now - (t0 if started is None else started)
        w = self.policy.latency_weight
        d.run_step_s = ran / steps if d.run_step_s is None else (1 - w) * d.run_step_s + w * ran / steps
        d.queue_s += _QUEUE_WEIGHT * (max(0.0, wait - ran) - d.queue_s)
        d.waits.add(float(steps), wait)
        d.calls += 1
        line = d.waits.line(at=0.0)
        if line is not None and line[0] >= 0 and line[1] > 0:
            d.fixed_s, d.step_s = line[0], (line[0] + line[1] * REF_K) / REF_K
        else:  # no spread of k yet: the whole wait per step
            w = self.policy.latency_weight
            d.fixed_s = 0.0
            d.step_s = (1 - w) * d.step_s + w * wait / steps if fresh else wait / steps
        d.measured_at = now
        self.metrics.drafter_step.labels(name).set(d.step_s)

    def observe_prefill(self, name: str, seconds: float, tokens: int, steps: int = 0) -> None:
        """A call that prefilled ``tokens`` new tokens ran ``seconds`` on drafter ``name`` (a
        Prefill, or a Propose that also drafted ``steps`` steps, taken out at the measured run
        time per step): its price per token, which the speculation switch charges a request that
        would make its drafter catch up on a device the target shares."""
        d = self._d.get(name)
        if d is None or tokens <= 0:
            return
        seconds -= steps * (d.run_step_s or 0.0)
        if seconds <= 0:
            return
        per_token = seconds / tokens
        w = self.policy.latency_weight
        d.prefill_token_s = per_token if d.prefill_token_s is None else (1 - w) * d.prefill_token_s + w * per_token

    def measurements(self, now: float) -> dict[str, tuple]:
        """Each drafter's measured wait line and run time as (step_s, fixed_s, age_s, fit, calls,
        run_step_s, queue_s, prefill_token_s): what the pool knows of its drafters beyond any
        request (the capacity simulator carries it from one run to the next, as one router serves a
        benchmark's scenarios one after the other)."""
        return {
            n: (d.step_s, d.fixed_s, now - d.measured_at, d.waits, d.calls, d.run_step_s, d.queue_s, d.prefill_token_s)
            for n, d in self._d.items()
        }

    def restore(self, measured: dict[str, tuple], now: float) -> None:
        """Take over :meth:`measurements` of the same drafters, taken ``age_s`` before ``now``."""
        for name, (step_s, fixed_s, age_s, fit, calls, run_step_s, queue_s, prefill_s) in measured.items():
            d = self._d.get(name)
            if d is not None:
                d.step_s, d.fixed_s, d.measured_at, d.waits, d.calls = step_s, fixed_s, now - age_s, fit, calls
                d.run_step_s, d.queue_s, d.prefill_token_s = run_step_s, queue_s, prefill_s

    def set_late(self, name: str, task: asyncio.Task) -> None:
        d = self._d.get(name)
        if d is not None:
            d.late = task

    def is_late(self, name: str) -> bool:
        """A Propose that missed its deadline still runs there: a new one would queue behind it."""
        d = self._d.get(name)
        return d is not None and d.late is not None and not d.late.done()

    def view(self, d: _Drafter, now: float, target: str | None = None) -> DrafterView:
        if d.client.restarts != d.restarts:  # a new process: what was measured is of the old one
            d.restarts = d.client.restarts
            d.step_s, d.fixed_s, d.measured_at, d.calls, d.surprises = None, 0.0, -math.inf, 0, 0
            d.prefill_token_s = None
        step, age = d.step_s, now - d.measured_at
        if step is not None:  # a call running past its expected time says the drafter is slower now
            for t0, steps in d.running.values():
                if steps > 0 and (now - t0) / steps > step:
                    step, age = (now - t0) / steps, 0.0
        c = d.client
        tel = getattr(c, "telemetry", None)
        info = c.info  # the simulator's is built on each read
        slots = int(info.num_slots) if info is not None and info.num_slots > 0 else None
        return DrafterView(
            name=c.name,
            up=c.up and c.name not in self.draining,
            step_s=step,
            age_s=age if step is not None else 0.0,
            fixed_s=d.fixed_s,
            run_step_s=d.run_step_s,
            queue_s=d.queue_s,
            in_flight=len(d.running) + len(d.queue),
            load=tel.load if tel is not None else None,
            jobs=len(d.jobs),
            slots=slots,
            mates=sum(t == target for t in d.jobs.values()) if target is not None else 0,
            prefill_token_s=d.prefill_token_s,
            placement=getattr(info, "placement", ""),
        )

    def view_of(self, name: str, target: str | None = None) -> DrafterView | None:
        d = self._d.get(name)
        return self.view(d, self.clock(), target) if d is not None else None

    def views(self, now: float | None = None, target: str | None = None) -> list[DrafterView]:
        """Every drafter as the policy sees it (``target``: whose request asks, for ``mates``)."""
        now = self.clock() if now is None else now
        return [self.view(d, now, target) for d in self._d.values()]

    # ---- assignment ----------------------------------------------------------------------------
    def assign(self, job: Job, home: str | None, target: str | None = None) -> str | None:
        """The drafter for ``job``'s next drafts (None: fail open); moves it when the policy says so.
        Returns the drafter it left in ``job.moved_from`` (its slot there can be released).
        ``target``: the target it runs on (placement keeps a target's requests together)."""
        job.moved_from = None
        if not self.cfg.rebalance.enabled:  # static pairing
            d = self._d.get(home) if home is not None else None
            if d is None or not d.client.up:
                return None
            if job.drafter != home:
                self._place(job, d, target)
            return home
        now = self.clock()
        a = assign_drafter(job.drafter, self.views(now, target), moved_at=job.drafter_at, now=now, cfg=self.policy)
        if a.drafter is None or a.drafter == job.drafter:
            d = self._d.get(job.drafter) if job.drafter is not None else None
            return job.drafter if d is not None and d.client.up else None
        old = job.drafter
        self._place(job, self._d[a.drafter], target)
        if a.action in ("move", "failover"):
            job.moved_from, job.drafter_at = old, now
            action = "draft_move" if a.action == "move" else "draft_failover"
            self.metrics.rebalance_actions.labels(action).inc()
            log.info("%s: %s %s -> %s (%s)", action, job.key, old, a.drafter, a.reason)
        return a.drafter

    def _place(self, job: Job, d: _Drafter, target: str | None) -> None:
        old = self._d.get(job.drafter) if job.drafter is not None else None
        if old is not None:
            old.jobs.pop(job.key, None)
        d.jobs[job.key] = target
        job.drafter = d.client.name

    def forget(self, job: Job) -> None:
        """The job ended: it no longer counts against any drafter."""
        for d in self._d.values():
            d.jobs.pop(job.key, None)
