"""A fair share per client: batch slots (router/batching.py, next_admission) and each round's prefill
budget (specdec/core/prefill_plan.py) go round robin across clients, first come first served within
one; a client alone gets everything. The scenarios run the router's scheduler over a stub target
worker that records the prompt chunks it is sent."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.batching import next_admission
from router.config import RouterConfig
from router.metrics import Metrics
from router.scheduler import Job, TargetScheduler
from specdec.core.params import SamplingParams, VerifyMode
from specdec.core.prefill_plan import PrefillNeed, chunk_end, plan_prefill
from specdec.rpc import worker_pb2

LONG, SHORT = 4000, 16


def _admitted(waiting: list[tuple[str, str]], running: list[str], free: int, fair: bool = True) -> list[str]:
    """The names of the queued requests (client, name) that ``free`` slots admit, in order."""
    waiting, running, out = list(waiting), list(running), []
    while waiting and len(out) < free:
        client, name = waiting.pop(next_admission([c for c, _ in waiting], running, fair))
        running.append(client)
        out.append(name)
    return out


# ---- admission --------------------------------------------------------------------------------


def test_a_later_client_takes_the_next_free_slot_ahead_of_a_queued_burst():
    waiting = [("A", f"a{i}") for i in range(4, 8)] + [("B", "b0")]
    assert _admitted(waiting, running=["A"] * 3, free=1) == ["b0"]
    assert _admitted(waiting, running=["A"] * 3, free=1, fair=False) == ["a4"]  # FIFO: B waits for the burst


def test_a_client_alone_takes_every_free_slot_in_order():
    waiting = [("A", f"a{i}") for i in range(10)]
    assert _admitted(waiting, running=[], free=8) == [f"a{i}" for i in range(8)]
    assert _admitted(waiting, running=["B"] * 7, free=1) == ["a0"]  # B holds more, but nobody else waits


def test_three_clients_share_the_slots_as_evenly_as_they_allow():
    waiting = [(c, f"{c}{i}") for c in "ABC" for i in range(8)]  # A's burst came first, then B's, then C's
    order = _admitted(waiting, running=[], free=8)
    assert order == ["A0", "B0", "C0", "A1", "B1", "C1", "A2", "B2"]
    # A holds 6 of 6 slots; as its requests end, B and C fill up to ceil(6 / 3) = 2 each first
    waiting = [("A", "A6"), ("A", "A7")] + [("B", f"B{i}") for i in range(3)] + [("C", f"C{i}") for i in range(3)]
    running = ["A"] * 6
    for _ in range(4):
        running.remove("A")
        (name,) = _admitted(waiting, running, free=1)
        waiting = [w for w in waiting if w[1] != name]
        running.append(name[0])
    assert sorted(running) == ["A", "A", "B", "B", "C", "C"]
    running.remove("A")
    assert _admitted(waiting, running, free=1) == ["A6"]  # now A has the fewest


def test_among_clients_with_as_many_running_the_one_served_least_recently_goes_first():
    waiting = ["A", "B"]  # A's second request came first, then B's; nothing runs
    assert next_admission(waiting, [], last_admitted={"A": 1}) == 1  # A's first just ended: B's turn
    assert next_admission(waiting, [], last_admitted={"A": 1, "B": 2}) == 0
    assert next_admission(waiting, []) == 0  # neither had a slot: the oldest request
    assert next_admission(waiting, [], fair_share=False, last_admitted={"A": 1}) == 0


def test_a_client_s_own_requests_keep_their_order():
    waiting = [("A", "a0"), ("B", "b0"), ("A", "a1"), ("A", "a2"), ("B", "b1"), ("C", "c0")]
    order = _admitted(waiting, running=["C"], free=6)
    assert order == ["a0", "b0", "a1", "b1", "c0", "a2"]
    for client in "ABC":
        mine = [n for n in order if n[0] == client.lower()]
        assert mine == sorted(mine)


# ---- the prefill budget -----------------------------------------------------------------------


def test_the_budget_is_split_across_clients_not_by_request():
    needs = [PrefillNeed(f"a{i}", 0, LONG, "A") for i in range(8)] + [PrefillNeed("b0", 0, LONG, "B")]
    assert plan_prefill(needs, verify_tokens=0, budget=256, chunk=128) == {"a0": 128, "b0": 128}
    # FIFO by request (one client): the burst's first two prompts take the round
    same = [PrefillNeed(n.key, n.done, n.total) for n in needs]
    assert plan_prefill(same, verify_tokens=0, budget=256, chunk=128) == {"a0": 128, "a1": 128}
    # three clients, room for three chunks: one each, however many prompts each has queued
    needs += [PrefillNeed("c0", 0, LONG, "C")]
    assert plan_prefill(needs, verify_tokens=0, budget=384, chunk=128) == {"a0": 128, "b0": 128, "c0": 128}


def test_a_new_client_gets_the_only_chunk_a_round_has_room_for():
    needs = [PrefillNeed(f"a{i}", 1024, LONG, "A") for i in range(2)] + [PrefillNeed("b0", 0, LONG, "B")]
    assert plan_prefill(needs, verify_tokens=100, budget=256, chunk=128) == {"b0": 128}
    # with verify rows filling the budget, the one chunk that is always given goes to it too
    assert plan_prefill(needs, verify_tokens=400, budget=256, chunk=128) == {"b0": 128}


def test_with_room_for_one_chunk_clients_alternate_round_by_round():
    done = {"a0": 0, "a1": 0, "b0": 0}
    owner = {"a0": "A", "a1": "A", "b0": "B"}
    served = []
    for _ in range(6):
        needs = [PrefillNeed(k, done[k], LONG, owner[k]) for k in done]
        plan = plan_prefill(needs, verify_tokens=100, budget=256, chunk=128)
        assert len(plan) == 1
        ((key, end),) = plan.items()
        done[key] = end
        served.append(owner[key])
    assert served == ["A", "B"] * 3


def test_a_client_s_short_prompt_still_goes_before_its_own_long_ones():
    needs = [PrefillNeed("a0", 0, LONG, "A"), PrefillNeed("a1", 0, LONG, "A"), PrefillNeed("a2", 0, 9, "A")]
    needs += [PrefillNeed("b0", 0, LONG, "B")]
    # A's turn: its oldest; B's; A's again: its short prompt (one chunk) before its second long one
    assert plan_prefill(needs, verify_tokens=0, budget=265, chunk=128) == {"a0": 128, "b0": 128, "a2": 9}


def _by_request(needs: list[PrefillNeed], verify_tokens: int, budget: int, chunk: int) -> dict[str, int]:
    """The plan before clients: by request only (the oldest prompt, those finishing in one chunk,
    the rest; then passes in arrival order). A client alone must still be planned so."""
    order = [n for n in needs if n.done < n.total]
    if not order:
        return {}
    if budget <= 0:
        return {n.key: n.total for n in order}
    done, total, planned, left = (
        {n.key: n.done for n in order},
        {n.key: n.total for n in order},
        {},
        budget - verify_tokens,
    )

    def give(key: str) -> bool:
        nonlocal left
        end = chunk_end(done[key], total[key], chunk)
        if done[key] >= total[key] or end - done[key] > left:
            return False
        left -= end - done[key]
        done[key] = planned[key] = end
        return True

    head, rest = order[0], order[1:]
    finishing = [n for n in rest if chunk_end(n.done, n.total, chunk) == n.total]
    progress = any([give(n.key) for n in [head] + finishing + [n for n in rest if n not in finishing]])
    while progress:
        progress = any([give(n.key) for n in order])
    if not planned:
        planned[head.key] = chunk_end(head.done, head.total, chunk)
    return planned


_PROMPTS = st.lists(
    st.tuples(st.integers(0, 3000), st.integers(0, 3000), st.sampled_from("AB")), min_size=1, max_size=8
)


@settings(max_examples=150, deadline=None)
@given(
    prompts=_PROMPTS, verify_tokens=st.integers(0, 600), budget=st.integers(0, 2048), chunk=st.sampled_from([16, 128])
)
def test_one_client_is_planned_by_request_as_before(prompts, verify_tokens, budget, chunk):
    needs = [PrefillNeed(str(i), min(d // chunk * chunk, t), t, "A") for i, (d, t, _) in enumerate(prompts)]
    assert plan_prefill(needs, verify_tokens, budget, chunk) == _by_request(needs, verify_tokens, budget, chunk)
    # two clients: within the budget (or one chunk), on chunk boundaries, each a step forward
    mixed = [PrefillNeed(n.key, n.done, n.total, c) for n, (_, _, c) in zip(needs, prompts)]
    plan = plan_prefill(mixed, verify_tokens, budget, chunk)
    assert bool(plan) == any(n.done < n.total for n in mixed)
    by_key = {n.key: n for n in mixed}
    spent = sum(end - by_key[k].done for k, end in plan.items())
    assert budget <= 0 or spent <= max(budget - verify_tokens, 0) or len(plan) == 1
    for key, end in plan.items():
        assert by_key[key].done < end <= by_key[key].total
        assert end == by_key[key].total or end % chunk == 0


# ---- the scheduler ----------------------------------------------------------------------------


class _Target:
    """A target worker's client as the scheduler uses it: its info, and the rounds' prompt chunks
    (which its Verify calls would cache) as {job key: tokens cached after the round}."""

    def __init__(self, slots: int):
        self.name = "target-0"
        self.info = worker_pb2.WorkerInfo(num_slots=slots, max_context=8192, vocab_size=256, eos_token_ids=[0])
        self.lock = asyncio.Lock()
        self.restarts = 0  # the process serving (router/workers.py): a cache belongs to one
        self.prefills: list[dict[str, int]] = []

    async def wait_up(self, timeout: float) -> None:
        return None

    async def release(self, keys: list[str]) -> None:
        return None


def _scheduler(slots: int, fair_share: bool = True) -> tuple[TargetScheduler, _Target]:
    cfg = RouterConfig(
        fair_share=fair_share, micro_batches=1, max_batched_tokens=256, prefill_chunk=128, default_mode="off"
    )
    target = _Target(slots)
    return TargetScheduler("m", target, None, None, cfg, Metrics(), lambda ids: ""), target


def _submit(sched: TargetScheduler, client: str, name: str, n_tokens: int) -> Job:
    prompt = [1 + i % 200 for i in range(n_tokens)]
    job = sched.new_job(name, prompt, SamplingParams(max_tokens=4), VerifyMode.GREEDY, "off", None, None)
    job.client = client
    sched.submit(job)
    return job


async def _round_prefill(sched: TargetScheduler, target: _Target) -> dict[str, str]:
    """What a lane does at a round's start: admit and take its batch, then plan the round's prompt
    chunks. Returns the round's chunks as {request id: client}."""
    batch = sched._take(0)
    try:
        chunked = sched._plan_chunks(batch, verify_tokens=0, process=target.restarts)
    finally:
        for job in batch:
            job.in_flight = False
    target.prefills.append({j.key: j.state.prefilled for j, _ in chunked})
    by_key = {j.key: j for j in sched.running}
    return {by_key[k].request_id: by_key[k].client for k in target.prefills[-1]}


def _observed(histogram) -> float:
    """How many values a histogram holds, over its labels."""
    return sum(x.value for m in histogram.collect() for x in m.samples if x.name.endswith("_count"))


async def _wall_then_short(fair_share: bool) -> tuple[TargetScheduler, _Target, list[Job], Job]:
    """Client A's 8 long prompts fill the queue (4 slots: 4 run, 4 wait) and prefill for a few
    rounds; then client B sends a short one."""
    sched, target = _scheduler(slots=4, fair_share=fair_share)
    wall = [_submit(sched, "A", f"a{i}", LONG) for i in range(8)]
    for _ in range(3):
        await _round_prefill(sched, target)
    short = _submit(sched, "B", "b0", SHORT)
    return sched, target, wall, short


def test_a_short_request_behind_another_client_s_wall_starts_in_the_next_round():
    """A holds every slot and B arrives: one of A's requests gives its slot up at once (the one
    with the fewest tokens cached, the last admitted at equal progress) and waits again first in
    A's queue; B's prompt is cached and decodes in the next round."""

    async def scenario():
        sched, target, wall, short = await _wall_then_short(fair_share=True)
        assert short in sched.running and sched.metrics.preemptions._value.get() == 1
        given_up = next(j for j in wall[:4] if j not in sched.running)
        assert list(sched.waiting)[0] is given_up and given_up.state.prefilled == 0
        assert given_up.state.prefill_total == len(given_up.state.tokens) - 1  # all of it again
        chunks = await _round_prefill(sched, target)  # the next round
        assert "b0" in chunks and not short.state.prefilling  # cached, and decodes in this round
        assert given_up.request_id not in chunks
        # A holds 3 of 4 slots, B 1: above B's share (2) only while B has nothing more waiting
        assert sorted(j.client for j in sched.running) == ["A", "A", "A", "B"]

    asyncio.run(scenario())


def test_a_request_that_gave_its_slot_up_caches_its_tokens_again_in_chunks():
    async def scenario():
        sched, target, wall, short = await _wall_then_short(fair_share=True)
        given_up = list(sched.waiting)[0]
        generated = [7, 8, 9]
        given_up.state.tokens += generated  # as if it had decoded before giving its slot up
        given_up.state.refill = len(given_up.state.tokens) - 1
        queued = _observed(sched.metrics.queue_time)
        sched.cancel(short)  # B is done: A's request takes the slot back, first of A's queue
        sched._admit()
        assert given_up in sched.running
        assert _observed(sched.metrics.queue_time) == queued  # it had its queue time once
        seen = []
        while given_up.state.prefilling:
            chunks = await _round_prefill(sched, target)
            if given_up.request_id in chunks:
                seen.append(target.prefills[-1][given_up.key])
        assert seen[-1] == len(given_up.state.tokens) - 1  # up to its last token, generated ones included
        assert len(seen) > 1 and all(b - a <= 256 for a, b in zip([0] + seen, seen))  # chunks within the budget

    asyncio.run(scenario())


@pytest.mark.parametrize("case", ["at its share", "in flight", "fair share off", "alone"])
def test_no_slot_is_taken_where_the_share_does_not_ask_for_it(case):
    async def scenario():
        sched, target = _scheduler(slots=4, fair_share=case != "fair share off")
        if case == "at its share":
            for i in range(2):
                _submit(sched, "B", f"b{i}", SHORT)
        wall = [_submit(sched, "A", f"a{i}", LONG) for i in range(6)]
        if case == "in flight":
            for job in sched.running:
                job.in_flight = True
        if case != "alone":
            _submit(sched, "B", "b9", SHORT)
        assert sched.metrics.preemptions._value.get() == 0
        assert all(j in sched.running for j in wall[: 4 if case != "at its share" else 2])

    asyncio.run(scenario())


def test_first_come_first_served_leaves_the_short_request_behind_the_wall():
    """The policy before fair share, kept as ``router.fair_share: false``: the same scenario makes
    B wait until every request A queued before it has a slot."""

    async def scenario():
        sched, target, wall, short = await _wall_then_short(fair_share=False)
        assert short in sched.waiting and sched.metrics.preemptions._value.get() == 0
        for i in range(4):
            sched.cancel(wall[i])
            chunks = await _round_prefill(sched, target)
            assert short in sched.waiting and "b0" not in chunks
            assert wall[4 + i] in sched.running
        sched.cancel(wall[4])
        await _round_prefill(sched, target)
        assert short in sched.running

    asyncio.run(scenario())


def test_a_client_alone_gets_every_slot_and_the_whole_budget():
    async def scenario():
        sched, target = _scheduler(slots=4)
        jobs = [_submit(sched, "A", f"a{i}", LONG) for i in range(6)]
        assert sched.running == jobs[:4] and list(sched.waiting) == jobs[4:]
        chunks = await _round_prefill(sched, target)
        assert chunks == {"a0": "A", "a1": "A"}  # 2 x 128 tokens: the whole budget of 256
        assert sum(target.prefills[-1].values()) == 256

    asyncio.run(scenario())


def test_three_clients_share_the_scheduler_s_slots():
    """A alone takes all 6 slots; B and C arrive with 3 each: A gives slots up until each client
    holds its share of 2, and A's requests wait again in A's order."""

    async def scenario():
        sched, target = _scheduler(slots=6)
        first = [_submit(sched, "A", f"a{i}", SHORT) for i in range(6)]
        for client in "BC":
            for i in range(3):
                _submit(sched, client, f"{client.lower()}{i}", SHORT)
        held = sorted(j.client for j in sched.running)
        assert held == ["A", "A", "B", "B", "C", "C"]
        assert sorted(j.request_id for j in sched.running if j.client != "A") == ["b0", "b1", "c0", "c1"]
        waiting_a = [j.request_id for j in sched.waiting if j.client == "A"]
        assert waiting_a == sorted(waiting_a, key=lambda r: int(r[1:]))  # A's own order kept
        assert sched.metrics.preemptions._value.get() == 5 and not set(waiting_a) & {"a0", "a1"}
        assert first[0] in sched.running

    asyncio.run(scenario())
