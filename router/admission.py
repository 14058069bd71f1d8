"""Admission: the queue in front of a target's running batch, fair across clients, with preemption.

A mixin of :class:`router.scheduler.TargetScheduler` (its queue, running set, metrics and config):
requests wait in ``waiting`` until a KV slot is free, and the next one is chosen by
`router.batching.next_admission` (fair share: the client holding the fewest slots first). A client
below its share takes a slot from one above it (router/preemption.py).
"""

from __future__ import annotations

import math

import grpc

from router import clock
from router.batching import can_admit, next_admission
from router.jobs import Job, QueueFull
from router.preemption import requeue, victim
from specdec.rpc.errors import RpcStatusError

__all__ = ["Admission"]


class Admission:
    def check_room(self) -> None:
        """Raise unless a new job would be queued now (QueueFull, or UNAVAILABLE while closing):
        called before the costly work of admitting one (tokenizing), and by :meth:`submit`."""
        if self._closing:
            raise RpcStatusError(grpc.StatusCode.UNAVAILABLE, "the server is shutting down", retry_after=1.0)
        self._admit()
        if len(self.waiting) >= self.cfg.max_queue:
            raise QueueFull(
                f"the request queue is full ({len(self.waiting)} waiting, {len(self.running)} running); retry later"
            )

    def submit(self, job: Job) -> None:
        self.check_room()
        self.waiting.append(job)
        self.metrics.queue_depth.inc()
        self.metrics.prompt_tokens.inc(len(job.state.prompt_ids))
        self.metrics.prompt_len.labels(self.name).observe(len(job.state.prompt_ids))
        self._admit()
        self._wake.set()

    def cancel(self, job: Job, reason: str = "cancelled") -> None:
        """The client went away (cancel or deadline): drop the job and free its slots."""
        if job.done:
            return
        if job in self.waiting:
            self.waiting.remove(job)
            self.metrics.queue_depth.dec()
            self._finish(job, None, outcome="deadline_exceeded" if reason == "deadline" else "cancelled")
        elif job.in_flight:
            job.cancelled = reason  # the lane finishes it when its round returns
        else:
            self._finish(job, None, outcome="deadline_exceeded" if reason == "deadline" else "cancelled")

    def _admit(self) -> None:
        now = clock.now()
        while self.waiting and (self.waiting[0].done or (self.waiting[0].deadline or math.inf) <= now):
            job = self.waiting.popleft()
            self.metrics.queue_depth.dec()
            if not job.done:
                late = "the deadline passed while the request was queued"
                self._fail(job, RpcStatusError(grpc.StatusCode.DEADLINE_EXCEEDED, late), outcome="deadline_exceeded")
        while True:
            while self.waiting and can_admit(len(self.running), self.capacity, self._closing):
                clients = [j.client for j in self.waiting]
                i = next_admission(clients, [j.client for j in self.running], self.cfg.fair_share, self.admitted)
                job = self.waiting[i]
                del self.waiting[i]
                self.metrics.queue_depth.dec()
                if job.done:
                    continue
                self._admissions += 1
                self.admitted[job.client] = self._admissions
                self.running.append(job)
                self.metrics.running.inc()
                if job.state.refill is None:  # a preempted one has had its queue time (its run is not one)
                    self.metrics.queue_time.labels(self.name).observe(now - job.t_arrival)
            gives_up = self.cfg.fair_share and victim([j.client for j in self.waiting], self.running, self.capacity)
            if not gives_up or self._closing:
                break
            self._preempt(gives_up)  # and admit again
        self.peak_running = max(self.peak_running, len(self.running))
        if len(self.admitted) > 2 * (self.capacity + self.cfg.max_queue):  # forget clients long gone
            present = {j.client for j in self.running} | {j.client for j in self.waiting}
            self.admitted = {c: n for c, n in self.admitted.items() if c in present}

    def _preempt(self, job: Job) -> None:
        """``job`` gives its KV slots up for a client below its share and waits again (router/preemption.py)."""
        self._release(job)
        requeue(job)
        self.waiting.appendleft(job)  # the oldest of its client's: first again when its turn comes
        self.metrics.queue_depth.inc()
        self.metrics.preemptions.inc()
