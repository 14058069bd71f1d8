"""How deep to draft (router/draft_depth.py): the depth level by device load on scripted traces
(each change fires, holds under hysteresis and cooldown, does not flap on noisy input), what a
level means for k, a request's k, the pre-draft's length and room, the round's k cap, and the
catch-up threshold. Plain functions: no router, no I/O."""

from __future__ import annotations

import dataclasses
import random

import pytest

from router.draft_depth import (
    DepthPlan,
    DepthState,
    DraftDepthConfig,
    capped,
    depth_plan,
    is_catch_up,
    plan_depth,
    policy_k,
    predraft_k,
    predraft_room,
    round_k_cap,
    want_k,
)
from router.speculation_off import SpecJob, VerifyCost
from router.views import DrafterView, TargetView
from specdec.core.params import SamplingParams, VerifyMode
from specdec.core.request_state import CostMeter, KPolicy, new_request

CFG = DraftDepthConfig()


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
    assert levels[: CFG.samples - 1] == ["normal"] * (CFG.samples - 1)
    assert levels[CFG.samples - 1 :] == ["deep"] * (6 - CFG.samples + 1)
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
    # cooldown: saturated right after going deep waits cooldown_s (samples 1 s apart)
    levels = _depth_trace([0.1] * 3 + [0.99] * 8)
    i_deep = levels.index("deep")
    i_shallow = levels.index("shallow")
    assert i_shallow - i_deep >= CFG.cooldown_s


def test_no_depth_flapping_on_a_noisy_trace():
    rng = random.Random(3)
    for center in (CFG.low_utilization, CFG.high_utilization):
        loads = [min(1.0, max(0.0, center + rng.uniform(-0.08, 0.08))) for _ in range(300)]
        levels = _depth_trace(loads)
        changes = sum(a != b for a, b in zip(levels, levels[1:]))
        assert changes <= 1, (center, changes)


def test_depth_plans():
    # normal leaves the request's own k range, draft cost and pre-draft setting untouched
    assert depth_plan("normal", 1, 12, CFG) == DepthPlan(1, 12, cost_scale=1.0, predraft=None)
    deep, normal, shallow = (depth_plan(lv, 1, 12, CFG) for lv in ("deep", "normal", "shallow"))
    assert (normal.k_lo, normal.k_hi, normal.predraft) == (1, 12, None)
    assert deep.k_lo == 1 + CFG.deep_extra_k and deep.cost_scale < 1 and deep.predraft is True
    assert shallow.k_hi == 6 and shallow.predraft is False
    assert depth_plan("deep", 4, 4, CFG).k_lo == 4  # never above k_max


def test_a_predraft_takes_only_a_drafters_spare_time():
    """Measured with `specdec bench rebalance` (docs/results.md, "Rebalancer: skewed drafters"): pre-drafts
    on a drafter shared by two targets, or longer than the verify they overlap, held up the rounds that
    needed it (41 tok/s against 57 with them off)."""
    own = DrafterView("a", step_s=0.03, run_step_s=0.022, jobs=2, mates=2)
    assert predraft_room(own, verify_s=0.105) == 4  # 4 steps of 22 ms fit in a 105 ms verify
    assert predraft_room(dataclasses.replace(own, run_step_s=0.061), verify_s=0.105) == 1  # the slowed one
    assert predraft_room(dataclasses.replace(own, jobs=3), verify_s=0.105) == 0  # another target drafts here
    assert predraft_room(None, verify_s=0.105) == 0  # the drafter left the pool
    assert predraft_room(dataclasses.replace(own, run_step_s=None), verify_s=0.105) is None  # not measured yet
    assert predraft_room(own, verify_s=None) is None


def _state(k_policy: KPolicy, max_tokens: int = 64, prompt: int = 10):
    params = SamplingParams(max_tokens=max_tokens)
    return new_request("r", [1] * prompt, params, VerifyMode.GREEDY, k_policy, set(), str)


def test_want_k_follows_the_request_policy_within_the_depth_plan():
    cost = CostMeter(c=0.2)
    st = _state(KPolicy(k=5))
    assert want_k("off", st, 4096, cost) == 0
    assert want_k("draft", st, 4096, cost) == 5
    assert want_k("ngram", _state(KPolicy(k=5), max_tokens=3), 4096, cost) == 2  # bounded by what is left
    adaptive = _state(KPolicy(k=5, adaptive=True, k_min=1, k_max=12))
    assert want_k("draft", adaptive, 4096, cost, DepthPlan(1, 3)) == 3  # the shallow plan's k_hi
    assert want_k("draft", adaptive, 4096, cost, DepthPlan(7, 12)) == 7  # the deep plan's k_lo
    assert want_k("draft", st, 4096, cost, DepthPlan(1, 3)) == 5  # a fixed k is the request's own
    assert policy_k(st) == 5


def test_predraft_k():
    assert predraft_k(4, generated=0, k=4, max_tokens=64, tokens=10, max_context=4096) == 4
    assert predraft_k(4, generated=55, k=4, max_tokens=64, tokens=10, max_context=4096) == 3
    assert predraft_k(4, generated=0, k=4, max_tokens=64, tokens=4090, max_context=4096) == 1
    # a pre-draft runs its length + 1 steps (it drafts the bonus token's guess too): room 4 -> 3 tokens
    assert predraft_k(4, generated=0, k=4, max_tokens=64, tokens=10, max_context=4096, room=4) == 3
    assert predraft_k(4, generated=0, k=4, max_tokens=64, tokens=10, max_context=4096, room=1) == 0
    assert predraft_k(4, generated=0, k=4, max_tokens=64, tokens=10, max_context=4096, room=0) == 0


def test_a_drafter_catches_up_on_more_tokens_than_a_round_commits():
    assert not is_catch_up(13, k_max=12)  # k_max drafts + the bonus token: one round
    assert is_catch_up(14, k_max=12)
    assert is_catch_up(1, k_max=0) is False and is_catch_up(2, k_max=0)


def test_a_round_is_capped_where_one_long_draft_would_hold_it():
    flat = VerifyCost(t1=0.0245, slope=0.0)
    jobs = [SpecJob(a=0.9, k=8, draft_step_s=0.0068)] + [SpecJob(a=0.6, k=1, draft_step_s=0.0068)] * 6
    cap = round_k_cap(jobs, flat, margin=0.02)
    assert cap is not None and cap < 8 and max(j.k for j in capped(jobs, cap)) == cap
    assert round_k_cap(jobs, flat, margin=100.0) is None  # a cap must beat no cap by the margin
    assert round_k_cap(jobs, None, margin=0.02) is None and capped(jobs, None) == jobs


def test_config_is_strict():
    with pytest.raises(ValueError, match="unknown key"):
        DraftDepthConfig.from_dict({"depth_samples": 2})  # the older name: only under router.rebalance
    with pytest.raises(ValueError, match="low_utilization"):
        DraftDepthConfig.from_dict({"low_utilization": 0.95})
    with pytest.raises(ValueError, match="samples"):
        DraftDepthConfig.from_dict({"samples": 0})
