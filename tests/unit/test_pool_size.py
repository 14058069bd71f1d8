"""How big each pool is (router/pool_size.py): pressure, hysteresis, cooldown, bounds, drain."""

from __future__ import annotations

import pytest

from router.pool_size import (
    PoolLimits,
    PoolObservation,
    PoolSizeConfig,
    ScaleState,
    draft_observation,
    plan_pool,
    target_observation,
)
from router.views import DrafterView, TargetView

CFG = PoolSizeConfig(
    enabled=True,
    draft=PoolLimits(0, 3),
    target=PoolLimits(1, 2),
    up_samples=2,
    cooldown_s=10.0,
    scale_down_after_s=30.0,
)


def run(obs_at, cfg=CFG, times=range(0, 200, 1)):
    """Feed one observation per second; return [(time, action)]."""
    state, acts = ScaleState(), []
    for t in times:
        state, act = plan_pool(obs_at(t), state, float(t), cfg)
        if act is not None:
            acts.append((t, act))
    return acts


# ---- evidence ------------------------------------------------------------------------------------


def test_draft_pressure_needs_draft_wait_and_saturated_drafters():
    waiting = [TargetView("t0", draft_wait_share=0.7)]
    busy = [DrafterView("d0", load=0.95, jobs=2, slots=8), DrafterView("d1", load=0.9, jobs=1, slots=8)]
    assert draft_observation(waiting, busy, CFG).pressured
    # one drafter with headroom: rebalancing (not scaling) is the answer
    some = [busy[0], DrafterView("d1", load=0.3, jobs=1, slots=8)]
    assert not draft_observation(waiting, some, CFG).pressured
    # a full drafter (every KV slot taken) is saturated even when its device is not busy
    full = [DrafterView("d0", load=0.1, jobs=8, slots=8)]
    assert draft_observation(waiting, full, CFG).pressured
    # drafters saturated but targets do not wait on them: no draft replica
    assert not draft_observation([TargetView("t0", draft_wait_share=0.2)], busy, CFG).pressured
    # scaled to zero: any running request asks for a drafter; an idle service does not
    zero = draft_observation([TargetView("t0", running=1)], [], CFG)
    assert zero.pressured and zero.why == "no drafter while 1 request(s) wait or run"
    assert not draft_observation([TargetView("t0")], [], CFG).pressured
    # ... and one drafter launching answers that need: no second one while it starts
    assert not draft_observation([TargetView("t0", running=1)], [], CFG, pending=1).pressured
    # a draining drafter does not count as serving
    obs = draft_observation(waiting, busy, CFG, draining=["d1"])
    assert obs.serving == 1 and obs.draining == 1


def test_target_pressure_is_queue_per_replica():
    q = [TargetView("t0", waiting=5, running=4, capacity=4, load=0.9)]
    assert target_observation(q, CFG).pressured  # 5 > 2 per replica
    three = q + [TargetView(f"t{i}", running=4, capacity=4, load=0.9) for i in (1, 2)]
    assert not target_observation(three, CFG).pressured  # 5 / 3 replicas drain it
    down = three[:2] + [TargetView("t2", up=False)]
    assert target_observation(down, CFG).pressured  # a replica that is down drains nothing


def test_target_queue_threshold_exact():
    two = [TargetView("t0", waiting=4, running=4, capacity=4), TargetView("t1", waiting=0, running=4, capacity=4)]
    assert not target_observation(two, CFG).pressured  # 4 / 2 = 2, not past 2
    two[1] = TargetView("t1", waiting=1, running=4, capacity=4)
    assert target_observation(two, CFG).pressured


def test_underused_and_victim():
    idle = [TargetView("t0", running=0, capacity=4, load=0.05), TargetView("t1", running=1, capacity=4, load=0.1)]
    obs = target_observation(idle, CFG)
    assert obs.underused and obs.victim == "t0"
    busy = [TargetView("t0", running=3, capacity=4, load=0.05)]
    assert not target_observation(busy, CFG).underused  # slots in use: not underused whatever the load says
    queued = [TargetView("t0", waiting=1, running=0, capacity=4, load=0.0)]
    assert not target_observation(queued, CFG).underused
    # a drafter with no telemetry but calls in flight is not idle
    d = [DrafterView("d0", load=None, in_flight=1, jobs=0, slots=8)]
    assert not draft_observation([TargetView("t0")], d, CFG).underused
    d = [DrafterView("d0", load=None, in_flight=0, jobs=0, slots=8), DrafterView("d1", load=0.1, jobs=1, slots=8)]
    obs = draft_observation([TargetView("t0")], d, CFG)
    assert obs.underused and obs.victim == "d0"


# ---- decisions -----------------------------------------------------------------------------------


def obs(**kw) -> PoolObservation:
    return PoolObservation(**{"pool": "target", "serving": 1, "victim": "t0", **kw})


def test_scale_up_needs_consecutive_samples():
    # pressure every other sample never reaches up_samples = 2 in a row: no action (hysteresis)
    assert run(lambda t: obs(pressured=t % 2 == 0), times=range(50)) == []
    acts = run(lambda t: obs(pressured=t >= 5), times=range(8))
    assert [(t, a.action) for t, a in acts] == [(6, "scale_up_target")]


def test_cooldown_and_max_replicas():
    # pressure never ends; replicas arrive right away: one action per cooldown, up to max_replicas
    state, acts, serving = ScaleState(), [], 0
    cfg = PoolSizeConfig(draft=PoolLimits(0, 3), up_samples=1, cooldown_s=10.0)
    for t in range(60):
        state, act = plan_pool(PoolObservation("draft", serving, pressured=True), state, float(t), cfg)
        if act is not None:
            acts.append(t)
            serving += 1
    assert acts == [0, 10, 20] and serving == 3


def test_pending_replicas_count_toward_the_size():
    cfg = PoolSizeConfig(target=PoolLimits(1, 2), up_samples=1, cooldown_s=0.0)
    state, act = plan_pool(obs(pressured=True, pending=1), ScaleState(), 0.0, cfg)
    assert act is None  # 1 serving + 1 launching = max already


def test_below_min_restores_at_once():
    state, act = plan_pool(obs(serving=0, victim=None), ScaleState(acted_at=0.0), 1.0, CFG)
    assert act is not None and act.action == "scale_up_target" and "min_replicas" in act.reason
    state, act = plan_pool(obs(serving=0, pending=1, victim=None), state, 2.0, CFG)
    assert act is None  # the replacement is on its way


def test_drain_after_underused_window_to_min():
    serving = [2]

    def at(t):
        return obs(serving=serving[0], underused=True, victim=f"t{serving[0] - 1}")

    state, acts = ScaleState(), []
    for t in range(200):
        state, act = plan_pool(at(t), state, float(t), CFG)
        if act is not None:
            acts.append((t, act))
            serving[0] -= 1
    assert [(t, a.action, a.victim) for t, a in acts] == [(30, "drain_target", "t1")]  # never below min 1


def test_drain_window_restarts_when_busy_again():
    acts = run(lambda t: obs(serving=2, underused=(t % 20) != 19), times=range(100))
    assert acts == []  # busy one sample in every 20: never underused for 30 s in a row


def test_no_drain_while_one_drains_or_launches():
    for kw in ({"draining": 1}, {"pending": 1}):
        assert run(lambda t, kw=kw: obs(serving=2, underused=True, **kw), times=range(100)) == []


def test_config_checks():
    with pytest.raises(ValueError, match="min_replicas"):
        PoolLimits(3, 2)
    with pytest.raises(ValueError, match="unknown key"):
        PoolSizeConfig.from_dict({"scale_up_queu": 1})
    with pytest.raises(ValueError, match="up_samples"):
        PoolSizeConfig(up_samples=0)
    cfg = PoolSizeConfig.from_dict({"draft": {"min_replicas": 0, "max_replicas": 5}, "scale_up_queue": 3})
    assert cfg.draft == PoolLimits(0, 5) and cfg.scale_up_queue == 3
