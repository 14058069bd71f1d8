"""The rebalancer's decisions for one target scheduler, applied: its depth level (from its device
telemetry, every period) and the speculation switch of its AUTO requests (every round).

The decisions themselves are the plain functions of :mod:`router.draft_depth` (how deep to draft)
and :mod:`router.speculation_off` (when speculation switches off), pricing drafts by
:mod:`router.drafter_choice`; this class feeds them the scheduler's state and applies, logs and
counts what they return. With ``rebalance.enabled`` false it changes nothing (depth ``normal``,
speculation by acceptance only).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from router import clock, draft_depth
from router.draft_depth import (
    DepthPlan,
    DepthState,
    capped,
    depth_plan,
    is_catch_up,
    plan_depth,
    round_k_cap,
)
from router.drafter_choice import is_guess, priced_drafter
from router.jobs import Job
from router.ngram_fallback import POOL_MEMORY, plan_fallback, remember, score_guess
from router.speculation_off import (
    SpecJob,
    VerifyCost,
    auto_off,
    plain_probe_due,
    plan_speculation,
    pooled_acceptance,
    round_goodput,
)
from router.views import DrafterView, TargetView
from specdec.core.prefill_plan import round_budget
from specdec.core.request_state import is_plain_round

if TYPE_CHECKING:  # the scheduler constructs its balance: a runtime import would be a cycle
    from router.scheduler import TargetScheduler

log = logging.getLogger(__name__)

__all__ = ["TargetBalance", "LEVEL_VALUES"]

LEVEL_VALUES = {"shallow": -1, "normal": 0, "deep": 1}


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


class TargetBalance:
    def __init__(self, sched: TargetScheduler):
        self.s = sched
        self.cfg = sched.cfg.rebalance
        self.depth = DepthState()
        self.wait_share = 0.0  # EWMA of the share of round time spent waiting for drafts
        self.pool = (0.0, 0.0)  # (accepted, rejections) of this target's rounds, decayed: ~300 request-rounds
        self.ngram_pool = (0.0, 0.0)  # the same for its AUTO requests' n-gram guesses (ngram_fallback.py)
        self.k_cap: int | None = None  # the last round's cap on draft lengths (round_k_cap)
        # Rounds since one the verify line could read as plain decoding (plain_probe_due): none yet.
        self.rounds_since_plain = sched.cfg.speculation_off.plain_probe_rounds

    def observe_outcome(self, drafted: int, accepted: int) -> None:
        """One request's round: ``accepted`` of ``drafted`` draft tokens (the pooled acceptance)."""
        if drafted > 0:
            acc, rej = self.pool
            self.pool = (0.997 * acc + accepted, 0.997 * rej + (1.0 if accepted < drafted else 0.0))

    def log_round(
        self,
        batch: list[Job],
        ks: list[int],
        drafted: list[int],
        draft_wait: float,
        verify_s: float,
        compute_s: float | None = None,
    ) -> None:
        """One round at DEBUG: each request as p<prompt tokens>@<tokens generated>:k<asked>/d<drafted>,
        the cost meter's c and r, the draft wait and the verify (with the worker's own compute time
        when it reports one). The simulator logs its rounds here too, so a service's trace and a
        simulation's compare line by line."""
        if log.isEnabledFor(logging.DEBUG):
            rows = " ".join(
                f"p{len(j.state.prompt_ids)}@{len(j.state.generated)}:k{k}/d{d}" for j, k, d in zip(batch, ks, drafted)
            )
            c = self.s.cost
            computed = "" if compute_s is None else f" (computed {1e3 * compute_s:.0f})"
            log.debug(
                "round on %s: %s; c %.3f r %.3f; draft wait %.0f ms, verify %.0f ms%s",
                self.s.target.name, rows, c.c, c.r, 1e3 * draft_wait, 1e3 * verify_s, computed,
            )  # fmt: skip

    def prefill_budget(self, batch: list[Job]) -> int:
        """The token budget of a round of ``batch`` for verify rows and prompt chunks
        (prefill_plan.round_budget), by the tokens per round its decoding requests committed so
        far: the batch's own, so plain requests get the plain budget whatever ran before them."""
        rates = [(st.rounds + st.accepted) / st.rounds for j in batch if (st := j.state.stats).rounds]
        return round_budget(self.s.cfg.max_batched_tokens, sum(rates) / len(rates) if rates else 1.0)

    # ---- depth ---------------------------------------------------------------------------------
    @property
    def depth_plan(self) -> DepthPlan:
        kp = self.s.cfg.k_policy
        level = self.depth.level if self.cfg.enabled else "normal"
        return depth_plan(level, kp.k_min, kp.k_max, self.s.cfg.draft_depth)

    def want_k(self, job: Job, running: int, max_context: int, spec: str | None = None) -> int:
        """A request's draft length for its next round: none while the batch-size gate holds an
        AUTO request off (:func:`router.speculation_off.auto_off`), else the router's k policy
        (:func:`router.draft_depth.want_k`) bounded by this target's depth plan. The scheduler and
        the simulator both ask here. ``spec``: for drafts from another source than the request's
        mode (the router's n-gram, chosen for an AUTO request)."""
        if auto_off(job.auto, running, self.s.cfg.speculation_off.auto_off_batch):
            return 0
        return draft_depth.want_k(spec or job.spec, job.state, max_context, self.s.cost, self.depth_plan)

    @property
    def predraft(self) -> bool:
        plan = self.depth_plan
        return self.s.cfg.predraft if plan.predraft is None else plan.predraft

    def observe_round(self, draft_wait: float, round_s: float) -> None:
        if round_s > 0:
            self.wait_share += 0.2 * (draft_wait / round_s - self.wait_share)

    def view(self) -> TargetView:
        """The target as the policy sees it."""
        s = self.s
        tel = getattr(s.target, "telemetry", None)
        return TargetView(
            name=s.target.name,
            up=s.target.up,
            waiting=len(s.waiting),
            running=len(s.running),
            capacity=s.capacity,
            load=tel.load if tel is not None else None,
            sm_active=tel.sm_active if tel is not None else None,
            verify_growth=s.cost.r if s.cost.line() is not None else None,
            draft_wait_share=self.wait_share,
            level=self.depth.level,
        )

    def update_depth(self, now: float) -> None:
        """One telemetry sample's depth decision (router/telemetry_loop.py calls it every period)."""
        if not self.cfg.enabled:
            return
        v = self.view()
        new = plan_depth(v, self.depth, now, self.s.cfg.draft_depth)
        if new.level != self.depth.level:
            m = self.s.metrics
            m.rebalance_actions.labels(f"depth_{new.level}").inc()
            m.depth_level.labels(v.name).set(LEVEL_VALUES[new.level])
            log.info(
                "depth_%s: target %s %s -> %s (load %s, SM %s, verify growth %s, draft wait %.0f%% of rounds)",
                new.level,
                v.name,
                self.depth.level,
                new.level,
                _pct(v.load),
                _pct(v.sm_active),
                _pct(v.verify_growth),
                100 * v.draft_wait_share,
            )
        self.depth = new

    # ---- speculation on / off ------------------------------------------------------------------
    def _evidence(self, job: Job) -> tuple[float, float]:
        """(accepted, rejections) of the request: its adaptive k's counts, or its lifetime totals
        read as if every round with fewer accepted than drafted ended in one rejection."""
        if job.state.adaptive is not None:
            return job.state.adaptive.evidence
        st = job.state.stats
        return float(st.accepted), float(max(0, min(st.rounds, st.drafted - st.accepted)))

    def cost(self) -> VerifyCost | None:
        """The measured verify line through recent rounds (through plain and drafting rounds' means
        once both were seen: CostMeter.anchored_line); None until rounds of different sizes."""
        fit = self.s.cost.anchored_line()
        if fit is None or fit[0] <= 0:
            return None
        return VerifyCost(t1=fit[0], slope=max(fit[1], 0.0))

    def _spec_jobs(self, batch: list[Job], ks: list[int], now: float, free: set[int] | None = None) -> list[SpecJob]:
        """The policy's view of a round's requests (``free``: the indices it may switch; None = all)."""
        acceptance = pooled_acceptance([self._evidence(j) for j in batch], self.pool)
        pool = self.s.drafting.pool
        views = {v.name: v for v in pool.views(now) if v.up} if pool is not None else {}
        here = getattr(self.s.target.info, "placement", "")
        jobs = []
        drafters = {j.drafter for j in batch if j.spec == "draft"}  # one price per drafter and round
        priced = {name: priced_drafter(name, views, self.s.cfg.drafter_choice) for name in drafters}
        for i, (j, k, a) in enumerate(zip(batch, ks, acceptance)):
            d = priced[j.drafter] if j.spec == "draft" else None
            fixed, step = d.price() if d is not None else (0.0, 0.0)
            jobs.append(
                SpecJob(
                    a=a,
                    k=k,
                    auto=j.auto and j.spec != "off" and (free is None or i in free),
                    off=j.spec_off,
                    changed_at=j.spec_changed_at,
                    draft_step_s=step,
                    draft_fixed_s=fixed,
                    guessed=j.spec == "draft" and is_guess(d, self.s.cfg.drafter_choice),
                    owed_s=self._owed(j, d, here),
                    left=j.state.params.max_tokens - len(j.state.generated),
                )
            )
        return jobs

    def _owed(self, job: Job, d: DrafterView | None, here: str) -> float:
        """Seconds of this target's device that ``job``'s drafter ``d`` needs to catch up on the
        tokens it lacks, when it computes on the same device (``here``: the target's placement) and
        its prefill is measured; 0 otherwise (a drafter with its own device prefills off the
        target's path, and the pool's queueing prices what it delays there)."""
        if d is None or d.prefill_token_s is None or not here or d.placement != here:
            return 0.0
        lacking = len(job.state.tokens) - job.fed_to(d.name)
        return lacking * d.prefill_token_s if is_catch_up(lacking, self.s.cfg.k_policy.k_max) else 0.0

    def _decided(self) -> bool:
        return self.cfg.enabled and sum(self.pool) >= self.s.cfg.speculation_off.min_evidence

    def start(self, running: list[Job], ks: list[int]) -> None:
        """Whether new AUTO requests start speculating, planned with the running batch as it is
        (``ks``: each one's draft length). One that starts switched off sends its drafter nothing
        (no draft prefill): at a load where plain decoding is faster, drafting for it would only
        take the devices' time (on a shared host, the target's); nor does one that starts drafting
        by n-gram (router/ngram_fallback.py). If its draft model is switched on later, its first
        Propose catches the drafter up."""
        new = {i for i, j in enumerate(running) if not j.spec_planned}
        for i in new:
            running[i].spec_planned = True
        cost = self.cost()
        if not new or not self._decided() or cost is None:
            return
        now = clock.now()
        jobs = self._spec_jobs(running, ks, now, free=new)
        jobs = capped(jobs, round_k_cap(jobs, cost, self.s.cfg.speculation_off.off_margin))
        flags = plan_speculation(jobs, cost, now, self.s.cfg.speculation_off)
        self._log_view("start", jobs, flags, cost)
        self._fallback(running, jobs, flags, cost, now, ks)  # those starting on n-gram: no draft prefill either
        starting_off = [running[i] for i in sorted(new) if flags[i]]
        for j in starting_off:
            j.spec_off, j.spec_changed_at = True, now
            self.s.metrics.rebalance_actions.labels("spec_off").inc()
        if starting_off:
            log.info(
                "speculation by goodput on %s: %d new request(s) start off (batch of %d; verify %.1f ms "
                "+ %.2f ms/token)",
                self.s.target.name,
                len(starting_off),
                len(running),
                1000 * cost.t1,
                1000 * cost.slope,
            )

    def _log_view(self, what: str, jobs: list[SpecJob], flags: list[bool], cost: VerifyCost | None) -> None:
        """The switch's view of a round (or of the batch new requests join) at DEBUG: what it
        believes a verify, each draft and each catch-up cost, and the goodput it compares."""
        if cost is None or not log.isEnabledFor(logging.DEBUG):
            return
        log.debug(
            "speculation view (%s) on %s: verify %.1f ms + %.2f ms/token; goodput %.2f tok/s as planned, %.2f all "
            "off; acceptance %s; drafts %s ms; owed %s ms over %s tokens left",
            what, self.s.target.name, 1000 * cost.t1, 1000 * cost.slope, round_goodput(jobs, flags, cost),
            round_goodput(jobs, [j.auto or j.off for j in jobs], cost), [round(j.a, 2) for j in jobs],
            [round(1000 * (j.draft_fixed_s + j.draft_step_s * j.k)) for j in jobs],
            [round(1000 * j.owed_s) for j in jobs], [j.left for j in jobs],
        )  # fmt: skip

    def _note_cap(self, cap: int | None, jobs: list[SpecJob], cost: VerifyCost | None) -> None:
        """Count every capped round; log (debug: it follows each round's mix) when rounds start or
        stop being capped."""
        if cap is not None:
            self.s.metrics.rebalance_actions.labels("k_cap").inc()
        if (cap is None) != (self.k_cap is None) and cost is not None:
            log.debug(
                "draft length on %s: %s (batch of %d wanting k %s; verify %.1f ms, drafts %.1f ms + %.1f ms/step)",
                self.s.target.name,
                f"capped at {cap}: a round waits for its longest draft" if cap is not None else "uncapped",
                len(jobs),
                [j.k for j in jobs],
                1000 * cost.t1,
                1000 * max(j.draft_fixed_s for j in jobs),
                1000 * max(j.draft_step_s for j in jobs),
            )
        self.k_cap = cap

    def speculation(self, batch: list[Job], ks: list[int], measured: bool) -> list[int]:
        """The round's draft lengths with AUTO requests switched off where plain decoding is faster.
        ``measured``: whether the round's verify will be timed for the cost line (not when it holds
        a request's first round or prompt chunks): only such a round is a plain-decoding probe."""
        if not batch or not self._decided():
            return ks  # off, or not enough measured acceptance to decide anything yet
        now = clock.now()
        cost = self.cost()
        jobs = self._spec_jobs(batch, ks, now)
        cap = round_k_cap(jobs, cost, self.s.cfg.speculation_off.off_margin)
        self._note_cap(cap, jobs, cost)
        jobs = capped(jobs, cap)
        ks = [j.k for j in jobs]
        flags = plan_speculation(jobs, cost, now, self.s.cfg.speculation_off)  # unchanged without a measured cost
        self._log_view("round", jobs, flags, cost)
        changed = [(j, off) for j, off in zip(batch, flags) if off != j.spec_off]
        for j, off in changed:
            j.spec_off, j.spec_changed_at = off, now
            self.s.metrics.rebalance_actions.labels("spec_off" if off else "spec_on").inc()
        if changed:
            n_off = sum(off for _, off in changed)
            log.info(
                "speculation by goodput on %s: %d request(s) off, %d back on (batch of %d; verify %.1f ms "
                "+ %.2f ms/token, drafts %s ms%s, acceptance %.2f..%.2f, k %s)",
                self.s.target.name,
                n_off,
                len(changed) - n_off,
                len(batch),
                1000 * cost.t1,
                1000 * cost.slope,
                [round(1000 * (j.draft_fixed_s + j.draft_step_s * j.k), 1) for j in jobs],
                " (guessed)" if any(j.guessed for j in jobs) else "",
                min(j.a for j in jobs),
                max(j.a for j in jobs),
                ks,
            )
        ks = self._fallback(batch, jobs, flags, cost, now, [0 if off else k for k, off in zip(ks, flags)])
        return self._plain_probe(batch, jobs, ks, measured)

    # ---- n-gram drafts for AUTO requests ---------------------------------------------------------
    def _fallback(
        self, batch: list[Job], jobs: list[SpecJob], flags: list[bool], cost: VerifyCost | None, now: float,
        ks: list[int],
    ) -> list[int]:  # fmt: skip
        """``ks`` with the AUTO requests that draft by the router's n-gram this round, in place of
        their draft model or of decoding plainly, where that pays (router/ngram_fallback.py,
        plan_fallback), each at its own k."""
        if not self.s.cfg.speculation_off.ngram_fallback:
            return ks
        ngram_k = [
            self.want_k(j, len(self.s.running), self.s.max_context, "ngram") if j.spec == "draft" else 0 for j in batch
        ]
        on = plan_fallback(
            jobs, flags, [j.ngram_evidence for j in batch],
            ngram_k, [j.ngram_on for j in batch], [j.ngram_changed_at for j in batch], cost, now,
            self.s.cfg.speculation_off, self.ngram_pool,
        )  # fmt: skip
        for j, o in zip(batch, on):
            if o != j.ngram_on:
                j.ngram_on, j.ngram_changed_at = o, now
                self.s.metrics.rebalance_actions.labels("ngram_on" if o else "ngram_off").inc()
        return [nk if o else k for k, nk, o in zip(ks, ngram_k, on)]

    def observe_guess(self, job: Job, verified: list[int]) -> None:
        """Score this round's n-gram guess for ``job`` against the tokens the target verified."""
        if job.ngram_guess is not None:
            scored = score_guess(job.ngram_guess, verified)
            job.ngram_evidence = remember(job.ngram_evidence, *scored)
            self.ngram_pool = remember(self.ngram_pool, *scored, memory=POOL_MEMORY)
            job.ngram_guess = None

    def _plain_probe(self, batch: list[Job], jobs: list[SpecJob], ks: list[int], measured: bool) -> list[int]:
        """The round's draft lengths, AUTO ones 0 where a plain round is due (plain_probe_due). Only
        in a ``measured`` round: a round holding a request's first holds the drafter's prefill (and
        that request's first Propose is what gives its drafter the prompt), one holding prompt
        chunks the target's."""
        cfg = self.s.cfg.speculation_off
        speculating = sum(j.auto and k > 0 for j, k in zip(jobs, ks))
        if measured and plain_probe_due(self.rounds_since_plain, speculating, cfg):
            ks = [0 if j.auto else k for j, k in zip(jobs, ks)]
            self.s.metrics.rebalance_actions.labels("plain_probe").inc()
            log.debug("plain round on %s: the verify line is measured at plain decoding's width", self.s.target.name)
        plain = is_plain_round(sum(k + 1 for k in ks), len(ks))
        self.rounds_since_plain = 0 if plain else self.rounds_since_plain + 1
        return ks
