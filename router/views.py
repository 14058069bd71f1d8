"""What the policy modules see of the workers: one drafter (:class:`DrafterView`) and one target
replica (:class:`TargetView`), as small frozen dataclasses.

The appliers build them from live state (router/drafter_pool.py, router/target_balance.py) and the
decisions read them: which drafter serves a request (router/drafter_choice.py), how deep to draft
(router/draft_depth.py), when speculation switches off (router/speculation_off.py), which target
gets a request (router/target_choice.py) and how big each pool is (router/pool_size.py).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["REF_K", "DrafterView", "TargetView"]

REF_K = 4  # draft length at which drafters' step times are compared


@dataclass(frozen=True)
class DrafterView:
    """One drafter as the policy sees it.

    step_s: measured seconds per draft step of a round on it, queueing included, at a reference
      draft length (raised while a call runs late); None = never measured. age_s: its age.
    fixed_s: the part of a call's wait that does not grow with k (RPC, queueing): a Propose of k
      steps waits about fixed_s + k x (step_s - fixed_s / k_ref); 0 until calls of different k.
    run_step_s: seconds per draft step a Propose ran on the worker, queueing excluded (EWMA);
      None = not measured. queue_s: how long a Propose waited before it ran, over a long memory.
    in_flight: Propose calls queued or running on it now (from every target).
    load: device load share from telemetry (DeviceSample.load), None = unknown.
    jobs / slots: requests it drafts for, and its KV slots (None = unbounded, e.g. n-gram).
    mates: of ``jobs``, those on the same target as the request being placed.
    prefill_token_s: measured seconds per token of its prefill (EWMA); None = not measured.
    placement: where it computes (WorkerInfo.placement); a target with the same one shares its device.
    """

    name: str
    up: bool = True
    step_s: float | None = None
    age_s: float = 0.0
    fixed_s: float = 0.0
    run_step_s: float | None = None
    queue_s: float = 0.0
    in_flight: int = 0
    load: float | None = None
    jobs: int = 0
    slots: int | None = None
    mates: int = 0
    prefill_token_s: float | None = None
    placement: str = ""

    @property
    def has_room(self) -> bool:
        return self.slots is None or self.jobs < self.slots

    @property
    def others(self) -> int:
        """Of ``jobs``, those on other targets than the request being placed."""
        return self.jobs - self.mates

    @property
    def per_step_s(self) -> float | None:
        """Seconds each draft step adds (the device's speed, without RPC and queueing)."""
        return None if self.step_s is None else max(0.0, self.step_s - self.fixed_s / REF_K)

    def price(self) -> tuple[float, float]:
        """(fixed, per step) seconds the speculation switch prices a draft here at: the run time
        per step plus the long-memory queueing, once runs are measured; else the wait line. A
        Propose queued behind a draft prefill waits several times its run, and pricing that
        spike switched whole batches off."""
        if self.run_step_s is not None:
            return self.queue_s, self.run_step_s
        return self.fixed_s, self.per_step_s or 0.0


@dataclass(frozen=True)
class TargetView:
    """One target replica as the policy sees it.

    load: DeviceSample.load (NVML kernel-time share on a GPU, the worker's busy fraction on CPU);
    sm_active: GPM SM activity where offered; None = unknown / not offered.
    verify_growth: measured cost of one more verified token relative to a one-token verify
      (0 while memory-bound); None = not measured yet.
    draft_wait_share: share of its recent round time spent waiting for drafts.
    level: its depth level now (router/draft_depth.py; routing puts ``shallow`` = saturated
      replicas last).
    """

    name: str
    up: bool = True
    waiting: int = 0
    running: int = 0
    capacity: int = 1
    load: float | None = None
    sm_active: float | None = None
    verify_growth: float | None = None
    draft_wait_share: float = 0.0
    level: str = "normal"
