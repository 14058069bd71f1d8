"""Which drafter serves a request (router/drafter_choice.py) on scripted traces: placement, moves
and failover fire, hold under hysteresis and cooldown, and do not oscillate on noisy input. Plain
functions: no router, no I/O."""

from __future__ import annotations

import random

import pytest

from router.drafter_choice import Assignment, DrafterChoiceConfig, assign_drafter
from router.views import DrafterView

CFG = DrafterChoiceConfig()


def drafters(step_a=0.01, step_b=0.01, **kw) -> list[DrafterView]:
    return [DrafterView("a", step_s=step_a, **kw), DrafterView("b", step_s=step_b, **kw)]


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


def test_old_measurements_hold_for_placement_and_moves_onto_idle_drafters_until_forgotten():
    # b was measured slow 20 s ago (no request since): new requests still avoid it ...
    pool = [DrafterView("a", step_s=0.01, in_flight=1), DrafterView("b", step_s=0.03, age_s=20)]
    assert assign_drafter(None, pool, moved_at=None, now=0, cfg=CFG).drafter == "a"
    # ... until the measurement is forgotten: then b is priced at the pool's median and gets one
    pool = [DrafterView("a", step_s=0.01, in_flight=1), DrafterView("b", step_s=0.03, age_s=CFG.forget_s + 1)]
    assert assign_drafter(None, pool, moved_at=None, now=0, cfg=CFG).drafter == "b"
    # a move needs a fresh measurement of the request's own drafter ...
    pool = [DrafterView("a", step_s=0.05, age_s=CFG.stale_s + 1), DrafterView("b", step_s=0.01)]
    assert assign_drafter("a", pool, moved_at=None, now=100, cfg=CFG).action == "keep"
    # ... and goes to an idle one by its last measurement (nothing measures an idle drafter again:
    # requests on a slowed drafter would otherwise stay there while the other has nothing to do)
    pool = [DrafterView("a", step_s=0.05), DrafterView("b", step_s=0.01, age_s=CFG.stale_s + 1)]
    assert assign_drafter("a", pool, moved_at=None, now=100, cfg=CFG) == Assignment("b", "move", "a costs 5.0x b")
    # ... until that is forgotten
    pool = [DrafterView("a", step_s=0.05), DrafterView("b", step_s=0.01, age_s=CFG.forget_s + 1)]
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


def test_config_is_strict():
    with pytest.raises(ValueError, match="unknown key"):
        DrafterChoiceConfig.from_dict({"move_margn": 2})
    with pytest.raises(ValueError, match="move_margin"):
        DrafterChoiceConfig.from_dict({"move_margin": 0.5})
    assert DrafterChoiceConfig.from_dict({"stale_s": 5.0}).stale_s == 5.0


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


def test_a_propose_withdrawn_while_the_drafter_is_busy_leaves_the_pool_working():
    """A round's Propose cancelled while its drafter's client is busy (the round failed open) is
    withdrawn from the queue; the sender then finds nothing to send. It must not fail (it once raised
    on the empty batch, once per withdrawn call in a capacity plan's simulations), and the next call
    must go through."""
    import asyncio
    from types import SimpleNamespace

    from router.config import RouterConfig
    from router.drafter_pool import DrafterPool
    from router.metrics import Metrics
    from specdec.rpc import worker_pb2

    sent = []

    async def call_timed(method, request, timeout):
        sent.append([s.request_id for s in request.sequences])
        return SimpleNamespace(drafts=[worker_pb2.Draft() for _ in request.sequences]), 0.001

    async def scenario():
        client = SimpleNamespace(name="a", up=True, restarts=0, info=None, lock=asyncio.Lock(), call_timed=call_timed)
        pool = DrafterPool(RouterConfig(), Metrics())
        pool.add(client)
        seq = worker_pb2.Sequence(request_id="r1", k=2)
        async with client.lock:  # another Propose or Prefill holds the drafter
            waiting = asyncio.create_task(pool.propose("a", [seq]))
            await asyncio.sleep(0.01)
            waiting.cancel()
            await asyncio.sleep(0.01)
        sender = pool._d["a"].sender
        await asyncio.wait_for(sender, 1.0)
        assert sender.exception() is None
        drafts = await asyncio.wait_for(pool.propose("a", [worker_pb2.Sequence(request_id="r2", k=2)]), 1.0)
        assert len(drafts) == 1

    asyncio.run(scenario())
    assert sent == [["r2"]]
