"""When speculation switches off (router/speculation_off.py) on scripted rounds: AUTO requests switch
off where plain decoding is faster and back on where speculating pays, a round's drafts are capped
where one long draft would hold it, drafts are priced by what they cost, and nothing flaps on noisy
input. Plain functions: no router, no I/O."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest

from router.draft_depth import capped, round_k_cap
from router.drafter_choice import DrafterChoiceConfig, is_guess, priced_drafter
from router.speculation_off import (
    SpecJob,
    SpeculationOffConfig,
    VerifyCost,
    auto_off,
    plain_probe_due,
    plan_speculation,
    pooled_acceptance,
    round_goodput,
)
from router.views import DrafterView
from specdec.core.request_state import CostMeter, LineFit, is_plain_round
from specdec.core.speedup import expected_tokens

CFG = SpeculationOffConfig()
DC = DrafterChoiceConfig()  # what prices the drafts


def test_the_batch_size_gate_holds_only_auto_requests_and_only_above_the_limit():
    assert auto_off(True, 9, 8) and not auto_off(True, 8, 8)
    assert not auto_off(False, 9, 8)  # explicit modes are not gated
    assert not auto_off(True, 1000, 0)  # 0: never


def test_config_is_strict():
    with pytest.raises(ValueError, match="unknown key"):
        SpeculationOffConfig.from_dict({"off_margn": 0.1})
    with pytest.raises(ValueError, match="auto_off_batch"):
        SpeculationOffConfig.from_dict({"auto_off_batch": -1})
    assert SpeculationOffConfig.from_dict({"min_evidence": 4.0}).min_evidence == 4.0


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
    cap = round_k_cap(jobs, flat, CFG.off_margin)
    assert cap is not None and cap < 8
    assert not any(plan_speculation(capped(jobs, cap), flat, 10.0, CFG))
    n = len(jobs)
    assert round_goodput(capped(jobs, cap), [False] * n, flat) > 1.25 * round_goodput(jobs, [True] * n, flat)
    # free drafts (n-grams) and a flat verify: a cap would only lose tokens
    assert round_k_cap([dataclasses.replace(j, draft_step_s=0.0) for j in jobs], flat, CFG.off_margin) is None
    assert round_k_cap(jobs, None, CFG.off_margin) is None


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
    assert g_new > round_goodput(jobs, [False] * 16, STEEP) * (1 + CFG.off_margin)
    assert g_new >= round_goodput(jobs, [True] * 16, STEEP)
    # within the cooldown the switched requests keep their state
    now = [dataclasses.replace(j, off=o, changed_at=10.0) for j, o in zip(jobs, off)]
    assert plan_speculation(now, FLAT, 10.5, CFG) == off
    # load gone (one request left, flat verify): back on after the cooldown
    alone = [SpecJob(a=0.8, k=4, off=True, changed_at=10.0, draft_step_s=0.005)]
    assert plan_speculation(alone, FLAT, 10.5, CFG) == [True]  # cooldown
    assert plan_speculation(alone, FLAT, 10.0 + CFG.cooldown_s, CFG) == [False]


def test_a_stale_slow_draft_measurement_does_not_keep_speculation_off():
    """The service's trace (Qwen pair, batch 1): verify 286 ms + 11.5 ms/token; the drafter last
    measured at 317 ms for one step (a Propose queued behind a prompt's draft prefill), its steady
    cost ~55 ms. Priced with the slow figure speculation is off; once that figure is older than
    stale_s it is a guess whose price halves every further stale_s, so speculation comes back on
    (the next Propose measures the drafter again), later the further it was from paying."""
    cost = VerifyCost(t1=0.286, slope=0.0115)
    views = {"d0": DrafterView("d0", step_s=0.317, age_s=1.0)}

    def plan(views):
        d = priced_drafter("d0", views, DC)
        step = d.step_s if d is not None else 0.0
        return plan_speculation([SpecJob(a=0.76, k=1, draft_step_s=step, guessed=is_guess(d, DC))], cost, 10.0, CFG)

    def aged(age):
        return {"d0": dataclasses.replace(views["d0"], age_s=age)}

    assert plan(views) == [True]  # off: a 317 ms draft step does not pay at a = 0.76
    guess = priced_drafter("d0", aged(DC.stale_s + 1), DC)
    assert is_guess(guess, DC) and guess.step_s == pytest.approx(0.317 * 0.5 ** (1 / DC.stale_s))
    # its prefill price, measured as slow, ages with it (else what a switched-off request owes keeps it off)
    slow_prefill = {"d0": dataclasses.replace(views["d0"], age_s=3 * DC.stale_s, prefill_token_s=0.03)}
    assert priced_drafter("d0", slow_prefill, DC).prefill_token_s == pytest.approx(0.03 * 0.25)
    assert plan(aged(DC.stale_s + 1)) == [True]  # a guess still too dear: stays off
    assert plan(aged(3 * DC.stale_s)) == [False]  # a quarter of it pays: back on (a probe)
    assert priced_drafter("d0", {"d0": DrafterView("d0")}, DC) is None  # never measured: free
    fresh = {"d0": DrafterView("d0", step_s=0.055, age_s=0.5)}
    assert plan(fresh) == [False]  # and the fresh, steady figure keeps it on
    assert not is_guess(priced_drafter("d0", fresh, DC), DC)
    # a fresh drafter beyond the move margin of the best is priced as the best (the pool moves it)
    two = {"d0": DrafterView("d0", step_s=0.3, age_s=0.5), "d1": DrafterView("d1", step_s=0.05, age_s=0.5)}
    assert priced_drafter("d0", two, DC).name == "d1"
    assert priced_drafter("d1", two, DC).name == "d1"
    # a stale own drafter is priced as the best fresh one
    mixed = {"d0": DrafterView("d0", step_s=0.3, age_s=99.0), "d1": DrafterView("d1", step_s=0.05, age_s=0.5)}
    assert priced_drafter("d0", mixed, DC).name == "d1"


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
    assert round_goodput(jobs, off, cost) * (1 + CFG.off_margin) >= plain * (1 - 1e-9)


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


def test_a_draft_prefill_on_the_targets_device_is_charged_once_over_the_rounds_a_request_has_left():
    """Seen in bench/plan_accuracy.sh (docs/results.md, "The simulator against the service"): under a burst of 32-token
    requests each new request's draft prefill (~0.5 s on the two cores the target verifies on) was
    charged to no one, and AUTO ran at 0.89x plain decoding. New requests whose drafter owes the
    shared device their prompt stay off when their outputs are short (speculating pays per round,
    not enough to repay the prefill), and speculate when their outputs are long enough to repay
    it; with nothing owed they speculate. Requests that owe are switched off first."""
    verify = VerifyCost(t1=0.1, slope=0.002)
    running = [SpecJob(a=0.6, k=2, draft_step_s=0.005) for _ in range(4)]
    new = SpecJob(a=0.6, k=2, draft_step_s=0.005, owed_s=0.5, left=32)
    assert plan_speculation(running + [dataclasses.replace(new, owed_s=0.0)] * 4, verify, 10.0, CFG) == [False] * 8
    assert plan_speculation(running + [new] * 4, verify, 10.0, CFG) == [False] * 4 + [True] * 4
    assert plan_speculation([*running, new], verify, 10.0, CFG) == [False] * 4 + [True]  # owing: off first
    assert plan_speculation(running + [dataclasses.replace(new, left=2000)] * 4, verify, 10.0, CFG) == [False] * 8
    # the formula: the owed seconds over the rounds it has left (left / tau), at least one round
    tau = expected_tokens(0.6, 2)
    t = verify.time(3) + 0.01
    assert math.isclose(round_goodput([new], [False], verify), tau / (t + 0.5 * tau / 32))
    assert math.isclose(round_goodput([dataclasses.replace(new, left=1)], [False], verify), tau / (t + 0.5))
    assert round_goodput([new], [True], verify) == 1 / verify.t1  # off: nothing owed


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


# ---- plain rounds that measure plain decoding ------------------------------------------------------


def test_a_plain_round_is_due_only_for_a_batch_that_speculates_long_enough():
    n = CFG.plain_probe_rounds
    assert plain_probe_due(n, 2, CFG) and plain_probe_due(n + 5, 8, CFG)
    assert not plain_probe_due(n - 1, 8, CFG)  # one was measured lately
    assert not plain_probe_due(n, 1, CFG)  # one request alone: its plain round costs its whole draft
    assert not plain_probe_due(n, 8, dataclasses.replace(CFG, plain_probe_rounds=0))  # 0: never
    assert is_plain_round(8, 8) and is_plain_round(5, 4) and not is_plain_round(40, 8)


def _meter(points, batch=8):
    meter = CostMeter()
    for w, t in points:
        meter.update(0.0, 0, t, w, batch)
    t1, slope = meter.anchored_line()
    return VerifyCost(t1=t1, slope=slope)


def test_one_plain_round_lets_the_switch_see_that_plain_decoding_is_faster():
    """A compute-bound verify (the 2-core CPU: each token about 12 ms), 8 requests speculating at
    k 4 with acceptance 0.8. As measured in the service, rounds of 30-40 tokens vary more with what
    else runs on the cores (the drafter) than with their width, so a line through them alone is
    nearly flat and puts plain decoding's 8 tokens at a speculating round's cost. One plain round
    among them puts it where it is, and the switch turns speculation off, as the true costs say."""
    rng = random.Random(3)
    truth = VerifyCost(t1=0.032, slope=0.012)
    jobs = [SpecJob(a=0.8, k=4, draft_fixed_s=0.1) for _ in range(8)]
    assert round_goodput(jobs, [True] * 8, truth) > 1.2 * round_goodput(jobs, [False] * 8, truth)
    rounds = [(rng.randint(30, 40), truth.time(36) * rng.uniform(0.8, 1.2)) for _ in range(60)]
    blind = _meter(rounds)
    assert blind.time(8) > 2 * truth.time(8)  # the extrapolation is far off
    assert plan_speculation(jobs, blind, 10.0, CFG) == [False] * 8  # and keeps speculation on
    probed = _meter(rounds[:30] + [(8, truth.time(8))] + rounds[30:])
    assert abs(probed.time(8) / truth.time(8) - 1) < 0.1
    assert plan_speculation(jobs, probed, 10.0, CFG) == [True] * 8
    # A least-squares line through the same rounds is still pulled flat by the many wide ones.
    least_squares = LineFit(0.05)
    for w, t in rounds[:30] + [(8, truth.time(8))] + rounds[30:]:
        least_squares.add(float(w), t)
    t1, slope = least_squares.line(at=1.0)
    assert VerifyCost(t1, slope).time(8) > 1.5 * truth.time(8)
