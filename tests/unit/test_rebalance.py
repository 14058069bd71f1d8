"""The rebalancing policy (router/rebalance.py) on scripted traces: each action fires, holds under
hysteresis and cooldown, and does not oscillate on noisy input. Plain functions: no router, no I/O."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest

from router.rebalance import (
    DepthState,
    DrafterView,
    RebalanceConfig,
    TargetView,
    assign_drafter,
    depth_plan,
    is_guess,
    pick_target,
    plan_depth,
    priced_drafter,
)
from router.speculation_switch import (
    SpecJob,
    VerifyCost,
    capped,
    plan_speculation,
    pooled_acceptance,
    round_goodput,
    round_k_cap,
)
from specdec.core.speedup import expected_tokens

CFG = RebalanceConfig()


def drafters(step_a=0.01, step_b=0.01, **kw) -> list[DrafterView]:
    return [DrafterView("a", step_s=step_a, **kw), DrafterView("b", step_s=step_b, **kw)]


# ---- draft assignment ----------------------------------------------------------------------------


def test_a_new_request_goes_to_the_drafter_with_most_headroom():
    # slower step
    assert assign_drafter(None, drafters(0.03, 0.01), moved_at=None, now=0, cfg=CFG).drafter == "b"
    # the same step, but rounds queued on b
    pool = [DrafterView("a", step_s=0.01), DrafterView("b", step_s=0.01, in_flight=2)]
    assert assign_drafter(None, pool, moved_at=None, now=0, cfg=CFG).drafter == "a"
    # the same step, b's device busy with other work
    pool = [DrafterView("a", step_s=0.01, load=0.99), DrafterView("b", step_s=0.01, load=0.1)]
    a = assign_drafter(None, pool, moved_at=None, now=0, cfg=CFG)
    assert (a.drafter, a.action) == ("b", "place")
    # all equal: the one with fewer requests (spreads the pool), then the name
    pool = [DrafterView("a", step_s=0.01, jobs=3), DrafterView("b", step_s=0.01, jobs=1)]
    assert assign_drafter(None, pool, moved_at=None, now=0, cfg=CFG).drafter == "b"
    # a burst placed in one round (nothing in flight yet) spreads over drafters of nearly equal cost
    where = []
    for _ in range(8):
        pool = [DrafterView(n, step_s=s, jobs=where.count(n), slots=8) for n, s in (("a", 0.010), ("b", 0.011))]
        where.append(assign_drafter(None, pool, moved_at=None, now=0, cfg=CFG).drafter)
    assert 3 <= where.count("b") <= 5, where
    # ... but not onto a clearly slower one
    where = []
    for _ in range(8):
        pool = [DrafterView(n, step_s=s, jobs=where.count(n), slots=8) for n, s in (("a", 0.01), ("b", 0.03))]
        where.append(assign_drafter(None, pool, moved_at=None, now=0, cfg=CFG).drafter)
    assert where == ["a"] * 8
    # an unmeasured drafter is treated as the pool's median: it gets new requests (and is measured)
    pool = [DrafterView("a", step_s=0.01, jobs=2), DrafterView("new", step_s=None)]
    assert assign_drafter(None, pool, moved_at=None, now=0, cfg=CFG).drafter == "new"


def _place_for_targets(steps: dict[str, float], order: list[str]) -> list[tuple[str, str]]:
    """Place requests of the targets in ``order`` one by one; (target, drafter) of each."""
    placed: list[tuple[str, str]] = []
    for target in order:
        pool = [
            DrafterView(
                n,
                step_s=s,
                jobs=sum(d == n for _, d in placed),
                mates=sum(d == n and t == target for t, d in placed),
                slots=8,
            )
            for n, s in steps.items()
        ]
        placed.append((target, assign_drafter(None, pool, moved_at=None, now=0, cfg=CFG).drafter))
    return placed


def test_a_targets_requests_draft_together_and_targets_spread_over_drafters():
    # equal drafters: each target keeps one drafter, and the two targets take different ones
    placed = _place_for_targets({"a": 0.010, "b": 0.010}, ["t0", "t0", "t1", "t1"] * 2)
    by_target = {t: {d for u, d in placed if u == t} for t in ("t0", "t1")}
    assert all(len(ds) == 1 for ds in by_target.values()) and by_target["t0"] != by_target["t1"], placed
    # one drafter clearly slower: both targets share the fast one rather than use the slow one
    placed = _place_for_targets({"a": 0.030, "b": 0.010}, ["t0", "t1"] * 4)
    assert {d for _, d in placed} == {"b"}
    # three targets on two drafters: a third target shares, and its requests still go together
    placed = _place_for_targets({"a": 0.010, "b": 0.010}, ["t0", "t1", "t2"] * 3)
    assert len({d for t, d in placed if t == "t2"}) == 1, placed


def test_old_measurements_hold_for_placement_until_forgotten_and_never_justify_a_move():
    # b was measured slow 20 s ago (no request since): new requests still avoid it ...
    pool = [DrafterView("a", step_s=0.01, in_flight=1), DrafterView("b", step_s=0.03, age_s=20)]
    assert assign_drafter(None, pool, moved_at=None, now=0, cfg=CFG).drafter == "a"
    # ... until the measurement is forgotten: then b is priced at the pool's median and gets one
    pool = [DrafterView("a", step_s=0.01, in_flight=1), DrafterView("b", step_s=0.03, age_s=CFG.forget_s + 1)]
    assert assign_drafter(None, pool, moved_at=None, now=0, cfg=CFG).drafter == "b"
    # a move needs fresh measurements on both sides
    pool = [DrafterView("a", step_s=0.05), DrafterView("b", step_s=0.01, age_s=CFG.stale_s + 1)]
    assert assign_drafter("a", pool, moved_at=None, now=100, cfg=CFG).action == "keep"
    pool = [DrafterView("a", step_s=0.05, age_s=CFG.stale_s + 1), DrafterView("b", step_s=0.01)]
    assert assign_drafter("a", pool, moved_at=None, now=100, cfg=CFG).action == "keep"


def test_placement_never_picks_a_drafter_a_move_would_leave_at_once():
    # the fast drafter has a call in flight, the slow one is idle: still the fast one (the slow one is
    # beyond the move margin: the request would be moved off it at its next round)
    pool = [DrafterView("a", step_s=0.01, in_flight=3, jobs=6, slots=8), DrafterView("b", step_s=0.03)]
    a = assign_drafter(None, pool, moved_at=None, now=0, cfg=CFG)
    assert a.drafter == "a" and assign_drafter("a", pool, moved_at=None, now=0, cfg=CFG).action == "keep"
    # within the margin, the headroom decides
    pool = [DrafterView("a", step_s=0.01, in_flight=3, jobs=6, slots=8), DrafterView("b", step_s=0.013)]
    assert assign_drafter(None, pool, moved_at=None, now=0, cfg=CFG).drafter == "b"


def test_a_drafters_wait_is_fixed_plus_per_step():
    d = DrafterView("a", step_s=0.0125, fixed_s=0.01)  # 10 ms per call + 10 ms per step
    assert d.per_step_s == pytest.approx(0.01) and d.price() == pytest.approx((0.01, 0.01))
    assert DrafterView("b").price() == (0.0, 0.0)  # unmeasured


def test_full_and_down_drafters_get_no_new_requests():
    pool = [DrafterView("a", step_s=0.001, jobs=4, slots=4), DrafterView("b", step_s=0.05, jobs=0, slots=4)]
    assert assign_drafter(None, pool, moved_at=None, now=0, cfg=CFG).drafter == "b"
    pool = [DrafterView("a", up=False, step_s=0.001), DrafterView("b", step_s=0.05)]
    assert assign_drafter(None, pool, moved_at=None, now=0, cfg=CFG).drafter == "b"
    a = assign_drafter("a", [DrafterView("a", up=False)], moved_at=None, now=0, cfg=CFG)
    assert (a.drafter, a.action) == (None, "none")  # fail open
    full = [DrafterView("a", step_s=0.01, jobs=4, slots=4)]
    assert assign_drafter(None, full, moved_at=None, now=0, cfg=CFG).action == "none"
    assert assign_drafter("a", full, moved_at=None, now=0, cfg=CFG).drafter == "a"  # its own slot counts


def test_a_request_is_sticky_then_moves_off_a_slow_drafter_after_its_cooldown():
    slow = drafters(0.03, 0.01)
    # placed at t=0 on a: within the cooldown it stays, however slow a is
    a = assign_drafter("a", slow, moved_at=0.0, now=CFG.move_cooldown_s / 2, cfg=CFG)
    assert (a.drafter, a.action) == ("a", "keep")
    a = assign_drafter("a", slow, moved_at=0.0, now=CFG.move_cooldown_s, cfg=CFG)
    assert (a.drafter, a.action) == ("b", "move")
    # below the margin it stays (its KV cache is there)
    a = assign_drafter("a", drafters(0.014, 0.01), moved_at=None, now=100, cfg=CFG)
    assert (a.drafter, a.action) == ("a", "keep")
    # moves compare how fast Proposes run there, queueing excluded: a queue follows the placement
    # (moving requests onto a drafter makes it queue), so chasing it would make requests oscillate
    queued = [DrafterView("a", step_s=0.03, run_step_s=0.01), DrafterView("b", step_s=0.01, run_step_s=0.01)]
    assert assign_drafter("a", queued, moved_at=None, now=100, cfg=CFG).action == "keep"
    slower = [DrafterView("a", step_s=0.03, run_step_s=0.03), DrafterView("b", step_s=0.01, run_step_s=0.01)]
    assert assign_drafter("a", slower, moved_at=None, now=100, cfg=CFG).action == "move"
    # and so does the device load: a drafter's is mostly its own drafting (on a shared device its
    # target's too); a device busy with other work shows in the run time (placement weighs load)
    hot = [DrafterView("a", step_s=0.01, load=0.99), DrafterView("b", step_s=0.01, load=0.2)]
    assert assign_drafter("a", hot, moved_at=None, now=100, cfg=CFG).action == "keep"
    # never onto a drafter without measurements, nor onto a full one
    assert assign_drafter("a", drafters(0.03, None), moved_at=None, now=100, cfg=CFG).action == "keep"
    full = [DrafterView("a", step_s=0.03), DrafterView("b", step_s=0.01, jobs=8, slots=8)]
    assert assign_drafter("a", full, moved_at=None, now=100, cfg=CFG).action == "keep"


def test_failover_is_immediate():
    pool = [DrafterView("a", up=False, step_s=0.01), DrafterView("b", step_s=0.05)]
    a = assign_drafter("a", pool, moved_at=0.0, now=0.1, cfg=CFG)  # within the cooldown
    assert (a.drafter, a.action) == ("b", "failover")
    # a drafter that left the pool is down too
    assert assign_drafter("gone", pool, moved_at=None, now=1, cfg=CFG).action == "failover"


def _run_requests(trace, n_jobs=8, dt=0.1, seed=0):
    """Drive n_jobs sticky requests through a trace of raw per-round step times (step_a, step_b),
    smoothed as the pool smooths them (EWMA), with a noisy device load per tick and a random count
    of rounds in flight per call. Returns the moves and the final assignment."""
    rng = random.Random(seed)
    where: list[str | None] = [None] * n_jobs
    moved: list[float | None] = [None] * n_jobs
    moves = []
    ewma: dict[str, float] = {}
    w = CFG.latency_weight
    for tick, raw in enumerate(trace):
        now = tick * dt
        for name, x in zip("ab", raw):
            ewma[name] = x if name not in ewma else (1 - w) * ewma[name] + w * x
        load = {name: rng.uniform(0.3, 0.9) for name in "ab"}
        for j in range(n_jobs):
            pool = [
                DrafterView(n, step_s=ewma[n], jobs=where.count(n), in_flight=rng.randint(0, 2), load=load[n])
                for n in "ab"
            ]
            a = assign_drafter(where[j], pool, moved_at=moved[j], now=now, cfg=CFG)
            if a.action in ("move", "failover"):
                moves.append((now, j, where[j], a.drafter))
            if a.drafter != where[j]:
                where[j], moved[j] = a.drafter, now
    return moves, where


def test_no_oscillation_on_a_noisy_trace():
    rng = random.Random(1)
    # two equal drafters: each round's step time +-25 %, device load 0.3..0.9 at random every tick
    trace = [(0.01 * rng.uniform(0.75, 1.25), 0.01 * rng.uniform(0.75, 1.25)) for _ in range(300)]
    moves, where = _run_requests(trace)
    assert moves == []
    assert None not in where and set(where) == {"a", "b"}  # placed by headroom on both


def test_a_slowdown_shifts_every_request_once_and_they_stay():
    rng = random.Random(2)
    noisy = lambda: 0.01 * rng.uniform(0.8, 1.2)  # noqa: E731
    trace = [(noisy(), noisy()) for _ in range(50)] + [(3 * noisy(), noisy()) for _ in range(250)]
    _, before = _run_requests(trace[:50])
    moves, where = _run_requests(trace)
    assert where == ["b"] * 8 and before.count("a") >= 2
    assert len(moves) == before.count("a")  # those that were on a, once each
    assert all(src == "a" and dst == "b" for _, _, src, dst in moves)  # one way: no ping-pong
    first = min(t for t, *_ in moves)
    assert 5.0 <= first <= 5.0 + 0.5  # a few rounds of smoothing after the slowdown at t = 5 s


# ---- depth by device load ------------------------------------------------------------------------


def _depth_trace(loads, share=0.0, dt=1.0, sm=None, growth=0.3, running=2):
    """Levels over a trace of device loads (no GPM unless ``sm``; verify cost growing with tokens
    by ``growth`` per token: compute-bound)."""
    st, levels = DepthState(), []
    for i, u in enumerate(loads):
        v = TargetView(
            "t",
            load=u,
            sm_active=None if sm is None else sm[i],
            verify_growth=growth,
            draft_wait_share=share,
            running=running,
        )
        st = plan_depth(v, st, i * dt, CFG)
        levels.append(st.level)
    return levels


def test_an_underused_target_goes_deep_after_enough_samples():
    levels = _depth_trace([0.1] * 6)
    assert levels[: CFG.depth_samples - 1] == ["normal"] * (CFG.depth_samples - 1)
    assert levels[CFG.depth_samples - 1 :] == ["deep"] * (6 - CFG.depth_samples + 1)
    # but not while its rounds wait for slow drafts (longer drafts would make that worse)
    assert _depth_trace([0.1] * 6, share=0.6) == ["normal"] * 6
    # no telemetry: no change; an idle target (nothing running) is not underused
    assert _depth_trace([None] * 6) == ["normal"] * 6
    assert _depth_trace([0.0] * 6, running=0) == ["normal"] * 6


def test_a_saturated_target_goes_shallow_and_a_spike_changes_nothing():
    assert _depth_trace([0.95] * 4)[-1] == "shallow"
    spikes = [0.6, 0.6, 0.99, 0.6, 0.6, 0.99, 0.6, 0.1, 0.6, 0.99, 0.6]
    assert set(_depth_trace(spikes)) == {"normal"}
    # GPM SM activity decides saturation where offered: kernels running all the time at low SM use
    # (load 1.0, sm_active 0.3) is not saturated, high SM use is
    assert _depth_trace([1.0] * 5, sm=[0.3] * 5)[-1] == "normal"
    assert _depth_trace([0.95] * 5, sm=[0.95] * 5, growth=None)[-1] == "shallow"
    # without GPM, a device busy all the time whose verify cost stays flat is memory-bound: not saturated
    assert _depth_trace([1.0] * 5, growth=0.02)[-1] == "normal"
    assert _depth_trace([1.0] * 5, growth=None)[-1] == "normal"  # not measured yet: no evidence


def test_depth_hysteresis_and_cooldown():
    # into deep, then loads just above the low threshold (inside the band): it stays deep
    low = CFG.low_utilization
    levels = _depth_trace([0.1] * 3 + [low + CFG.band / 2] * 10)
    assert levels[-1] == "deep"
    levels = _depth_trace([0.1] * 3 + [low + CFG.band * 1.5] * 10)
    assert levels[-1] == "normal"
    # cooldown: saturated right after going deep waits depth_cooldown_s (samples 1 s apart)
    levels = _depth_trace([0.1] * 3 + [0.99] * 8)
    i_deep = levels.index("deep")
    i_shallow = levels.index("shallow")
    assert i_shallow - i_deep >= CFG.depth_cooldown_s


def test_no_depth_flapping_on_a_noisy_trace():
    rng = random.Random(3)
    for center in (CFG.low_utilization, CFG.high_utilization):
        loads = [min(1.0, max(0.0, center + rng.uniform(-0.08, 0.08))) for _ in range(300)]
        levels = _depth_trace(loads)
        changes = sum(a != b for a, b in zip(levels, levels[1:]))
        assert changes <= 1, (center, changes)


def test_depth_plans():
    assert depth_plan("normal", 1, 12, CFG) == depth_plan("normal", 1, 12, CFG)
    deep, normal, shallow = (depth_plan(lv, 1, 12, CFG) for lv in ("deep", "normal", "shallow"))
    assert (normal.k_lo, normal.k_hi, normal.predraft) == (1, 12, None)
    assert deep.k_lo == 1 + CFG.deep_extra_k and deep.cost_scale < 1 and deep.predraft is True
    assert shallow.k_hi == 6 and shallow.predraft is False
    assert depth_plan("deep", 4, 4, CFG).k_lo == 4  # never above k_max


# ---- speculation on / off by goodput -------------------------------------------------------------

FLAT = VerifyCost(t1=0.05, slope=0.0)  # memory-bound: more tokens are free
STEEP = VerifyCost(t1=0.05, slope=0.02)  # compute-bound: each token costs 40 % of a step


def test_speculation_stays_on_while_the_verify_is_memory_bound():
    jobs = [SpecJob(a=0.5, k=4, draft_step_s=0.002) for _ in range(16)]
    assert plan_speculation(jobs, FLAT, 10.0, CFG) == [False] * 16
    # and without measurements nothing changes
    assert plan_speculation(jobs, None, 10.0, CFG) == [False] * 16


def test_one_long_draft_no_longer_makes_plain_decoding_look_faster():
    """A round waits for its longest draft. Seen in the planner's 70B / A10-drafter runs (verify
    24.5 ms flat, 6.8 ms per draft step): each request drafts the k its own acceptance earns, one
    long draft made the round wait for it, all-off won the goodput and the switch turned the whole
    batch off. Capped, speculating wins."""
    flat = VerifyCost(t1=0.0245, slope=0.0)
    jobs = [SpecJob(a=0.9, k=8, draft_step_s=0.0068)] + [SpecJob(a=0.6, k=1, draft_step_s=0.0068)] * 6
    assert all(plan_speculation(jobs, flat, 10.0, CFG))  # uncapped: everything off
    cap = round_k_cap(jobs, flat, CFG)
    assert cap is not None and cap < 8
    assert not any(plan_speculation(capped(jobs, cap), flat, 10.0, CFG))
    n = len(jobs)
    assert round_goodput(capped(jobs, cap), [False] * n, flat) > 1.25 * round_goodput(jobs, [True] * n, flat)
    # free drafts (n-grams) and a flat verify: a cap would only lose tokens
    assert round_k_cap([dataclasses.replace(j, draft_step_s=0.0) for j in jobs], flat, CFG) is None
    assert round_k_cap(jobs, None, CFG) is None


def test_drafts_are_priced_by_their_run_and_a_long_memory_of_queueing():
    """A Propose that queued behind a draft prefill waited several times its run; priced at that,
    one spike switched whole batches off. The price is the run per step plus the queueing over a
    long memory; before runs are measured, the wait line."""
    spiky = DrafterView("a", step_s=0.09, fixed_s=0.0, run_step_s=0.007, queue_s=0.004)
    assert spiky.price() == (0.004, 0.007)
    assert DrafterView("a", step_s=0.02, fixed_s=0.008).price() == pytest.approx((0.008, 0.018))


def test_speculation_switches_off_lowest_acceptance_first_when_compute_bound_and_back_on():
    rng = random.Random(4)
    jobs = [SpecJob(a=rng.uniform(0.1, 0.9), k=4, draft_step_s=0.005) for _ in range(16)]
    off = plan_speculation(jobs, STEEP, 10.0, CFG)
    assert any(off)
    a_off = [j.a for j, o in zip(jobs, off) if o]
    a_on = [j.a for j, o in zip(jobs, off) if not o]
    assert not a_on or max(a_off) <= min(a_on)
    g_new = round_goodput(jobs, off, STEEP)
    assert g_new > round_goodput(jobs, [False] * 16, STEEP) * (1 + CFG.spec_off_margin)
    assert g_new >= round_goodput(jobs, [True] * 16, STEEP)
    # within the cooldown the switched requests keep their state
    now = [dataclasses.replace(j, off=o, changed_at=10.0) for j, o in zip(jobs, off)]
    assert plan_speculation(now, FLAT, 10.5, CFG) == off
    # load gone (one request left, flat verify): back on after the cooldown
    alone = [SpecJob(a=0.8, k=4, off=True, changed_at=10.0, draft_step_s=0.005)]
    assert plan_speculation(alone, FLAT, 10.5, CFG) == [True]  # cooldown
    assert plan_speculation(alone, FLAT, 10.0 + CFG.spec_cooldown_s, CFG) == [False]


def test_a_stale_slow_draft_measurement_does_not_keep_speculation_off():
    """The service's trace (Qwen pair, batch 1): verify 286 ms + 11.5 ms/token; the drafter last
    measured at 317 ms for one step (a Propose queued behind a prompt's draft prefill), its steady
    cost ~55 ms. Priced with the slow figure speculation is off; once that figure is older than
    stale_s it is a guess whose price halves every further stale_s, so speculation comes back on
    (the next Propose measures the drafter again), later the further it was from paying."""
    cost = VerifyCost(t1=0.286, slope=0.0115)
    views = {"d0": DrafterView("d0", step_s=0.317, age_s=1.0)}

    def plan(views):
        d = priced_drafter("d0", views, CFG)
        step = d.step_s if d is not None else 0.0
        return plan_speculation([SpecJob(a=0.76, k=1, draft_step_s=step, guessed=is_guess(d, CFG))], cost, 10.0, CFG)

    def aged(age):
        return {"d0": dataclasses.replace(views["d0"], age_s=age)}

    assert plan(views) == [True]  # off: a 317 ms draft step does not pay at a = 0.76
    guess = priced_drafter("d0", aged(CFG.stale_s + 1), CFG)
    assert is_guess(guess, CFG) and guess.step_s == pytest.approx(0.317 * 0.5 ** (1 / CFG.stale_s))
    assert plan(aged(CFG.stale_s + 1)) == [True]  # a guess still too dear: stays off
    assert plan(aged(3 * CFG.stale_s)) == [False]  # a quarter of it pays: back on (a probe)
    assert priced_drafter("d0", {"d0": DrafterView("d0")}, CFG) is None  # never measured: free
    fresh = {"d0": DrafterView("d0", step_s=0.055, age_s=0.5)}
    assert plan(fresh) == [False]  # and the fresh, steady figure keeps it on
    assert not is_guess(priced_drafter("d0", fresh, CFG), CFG)
    # a fresh drafter beyond the move margin of the best is priced as the best (the pool moves it)
    two = {"d0": DrafterView("d0", step_s=0.3, age_s=0.5), "d1": DrafterView("d1", step_s=0.05, age_s=0.5)}
    assert priced_drafter("d0", two, CFG).name == "d1"
    assert priced_drafter("d1", two, CFG).name == "d1"
    # a stale own drafter is priced as the best fresh one
    mixed = {"d0": DrafterView("d0", step_s=0.3, age_s=99.0), "d1": DrafterView("d1", step_s=0.05, age_s=0.5)}
    assert priced_drafter("d0", mixed, CFG).name == "d1"


def test_a_guessed_price_switches_one_request_on_at_a_time():
    """Eight requests off at a saturated target, their drafter's price a guess that says drafting
    pays now: only the one with the highest acceptance switches on (the probe), and no other
    follows while it speculates by the guess; a fresh price decides for all of them."""
    cost = VerifyCost(t1=0.3, slope=0.001)
    off = [SpecJob(a=0.5 + 0.01 * i, k=4, off=True, draft_step_s=0.01, guessed=True) for i in range(8)]
    assert plan_speculation(off, cost, 100.0, CFG) == [True] * 7 + [False]
    probing = [dataclasses.replace(j, off=False) if i == 7 else j for i, j in enumerate(off)]
    assert plan_speculation(probing, cost, 100.0, CFG) == [True] * 7 + [False]
    measured = [dataclasses.replace(j, guessed=False) for j in probing]
    assert plan_speculation(measured, cost, 100.0, CFG) == [False] * 8
    # a request on whose next round drafts nothing (k 0: its last tokens) is no probe: it would
    # never measure the drafter, and the others would wait on it for good
    idle = [dataclasses.replace(j, off=False, k=0) if i == 7 else j for i, j in enumerate(off)]
    assert plan_speculation(idle, cost, 100.0, CFG) == [True] * 6 + [False, False]


def test_explicit_modes_are_never_switched():
    jobs = [SpecJob(a=0.05, k=4, auto=False) for _ in range(16)]
    assert plan_speculation(jobs, STEEP, 10.0, CFG) == [False] * 16


@pytest.mark.parametrize("seed", range(20))
def test_speculation_is_never_kept_where_plain_decoding_is_faster(seed):
    """Whatever the costs and acceptance, the round's goodput after the plan is within the margin
    of plain decoding's or better (the peers' most reported problem must not happen here)."""
    rng = random.Random(seed)
    n = rng.randint(1, 32)
    cost = VerifyCost(t1=rng.uniform(0.01, 0.2), slope=rng.uniform(0, 0.05))
    jobs = [SpecJob(a=rng.uniform(0, 1), k=rng.randint(1, 8), draft_step_s=rng.uniform(0, 0.03)) for _ in range(n)]
    off = plan_speculation(jobs, cost, 100.0, CFG)
    plain = round_goodput(jobs, [True] * n, cost)
    assert round_goodput(jobs, off, cost) * (1 + CFG.spec_off_margin) >= plain * (1 - 1e-9)


def test_pooled_acceptance_shrinks_a_short_bad_stretch_toward_the_batch():
    # seven requests with plenty of evidence for a = 0.8; one with a bad stretch of two rounds
    ev = [(40.0, 10.0)] * 7 + [(0.0, 2.0)]
    a = pooled_acceptance(ev)
    assert a[0] == pytest.approx(0.8, abs=0.01)
    assert 0.55 < a[-1] < 0.8  # pulled toward the pool, not read as 0
    assert pooled_acceptance([]) == [] and pooled_acceptance([(0.0, 0.0)]) == [0.6]  # the prior
    jobs = [SpecJob(a=x, k=4, draft_step_s=0.01) for x in a]
    assert plan_speculation(jobs, VerifyCost(t1=0.05, slope=0.0), 10.0, CFG) == [False] * 8


def test_a_slow_drafter_turns_speculation_off_and_a_fast_one_keeps_it():
    """The draft wait is on the critical path of a round: at a = 0.6 drafts that cost more per step
    than they save are switched off (plain decoding is faster), whatever the target's load."""
    slow = [SpecJob(a=0.6, k=3, draft_step_s=0.05) for _ in range(2)]
    assert plan_speculation(slow, FLAT, 10.0, CFG) == [True, True]
    fast = [SpecJob(a=0.6, k=3, draft_step_s=0.005) for _ in range(2)]
    assert plan_speculation(fast, FLAT, 10.0, CFG) == [False, False]


def test_goodput_formula():
    jobs = [SpecJob(a=0.6, k=3, draft_step_s=0.005), SpecJob(a=0.6, k=3)]  # a drafter, and local drafts
    t = STEEP.t1 + STEEP.slope * (8 - 1) + 0.005 * 3
    assert math.isclose(round_goodput(jobs, [False, False], STEEP), 2 * expected_tokens(0.6, 3) / t)
    assert math.isclose(round_goodput(jobs, [True, True], STEEP), 2 / (STEEP.t1 + STEEP.slope))


def test_no_spec_flapping_on_a_noisy_cost_trace():
    rng = random.Random(5)
    jobs = [SpecJob(a=0.6, k=4) for _ in range(8)]
    switches = 0
    for tick in range(300):
        # a verify cost right at the break-even point of a = 0.6, k = 4, batch 8 (slope ~ 0.00286 s
        # per token), +-10 % noise
        cost = VerifyCost(t1=0.05, slope=0.00286 * rng.uniform(0.9, 1.1))
        off = plan_speculation(jobs, cost, tick * 0.1, CFG)
        switches += sum(o != j.off for o, j in zip(off, jobs))
        jobs = [dataclasses.replace(j, off=o, changed_at=tick * 0.1) if o != j.off else j for j, o in zip(jobs, off)]
    assert switches <= len(jobs)  # each request switched at most once


# ---- routing -------------------------------------------------------------------------------------


def test_requests_go_to_the_least_loaded_replica_per_slot():
    ts = [TargetView("a", running=4, capacity=8), TargetView("b", running=3, waiting=2, capacity=8)]
    assert pick_target(ts, CFG).index == 0
    ts = [TargetView("a", running=4, capacity=4), TargetView("b", running=6, capacity=16)]
    assert pick_target(ts, CFG).index == 1  # per slot, not per request
    ts = [TargetView("a", up=False), TargetView("b", running=8, waiting=30, capacity=8)]
    assert pick_target(ts, CFG).index == 1
    # a saturated replica goes last (the load alone would have picked it: route_around)
    ts = [TargetView("a", running=1, capacity=8, level="shallow"), TargetView("b", running=3, capacity=8)]
    r = pick_target(ts, CFG)
    assert (r.index, r.around) == (1, True)
    assert pick_target(ts[:1], CFG).index == 0  # the only one still serves


def test_config_is_strict():
    with pytest.raises(ValueError, match="unknown keys"):
        RebalanceConfig.from_dict({"move_margn": 2})
    with pytest.raises(ValueError, match="move_margin"):
        RebalanceConfig.from_dict({"move_margin": 0.5})
    with pytest.raises(ValueError, match="low_utilization"):
        RebalanceConfig.from_dict({"low_utilization": 0.95})
    assert RebalanceConfig.from_dict({"enabled": False}).enabled is False


def test_the_pool_measures_a_proposes_run_apart_from_its_queueing():
    """What a round waits for a draft (queueing included: placement and the speculation switch)
    and how fast the drafter runs it (queueing excluded: moves) are two measurements."""
    from types import SimpleNamespace

    from router.config import RouterConfig
    from router.drafter_pool import DrafterPool
    from router.metrics import Metrics

    now = [0.0]
    pool = DrafterPool(RouterConfig(), Metrics(), clock=lambda: now[0])
    pool.add(SimpleNamespace(name="a", up=True, restarts=0, info=None))
    for t in (1.0, 2.0, 3.0):
        now[0] = t
        call = pool.begin("a", 4)  # sent now, after waiting 40 ms behind another target's call
        now[0] = t + 0.04
        pool.end("a", call, True, since=t - 0.04)
    (v,) = pool.views(now[0])
    assert v.step_s == pytest.approx(0.02) and v.run_step_s == pytest.approx(0.01)
    assert 0 < v.queue_s < 0.2 * 0.04  # each 40 ms wait moves the long memory a little
