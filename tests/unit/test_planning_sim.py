"""The capacity simulator (cluster/planning): profiles, workloads, and the router's policy run over
simulated workers. Costs come from small hand-written profiles, so every expected time is known."""

from __future__ import annotations

import dataclasses
import json
import math
import random

import pytest

from cluster.planning.costs import ProfileCosts
from cluster.planning.profile import Curve, DrafterStats, Grid, Overhead, Profile, ProfileError, RequestRounds
from cluster.planning.sim_clients import CLIENT_STAGGER_S
from cluster.planning.simulator import Deployment, simulate
from cluster.planning.workload import (
    AcceptanceModel,
    SimRequestSpec,
    WorkloadError,
    acceptance_pool,
    load_trace,
    parse_lengths,
    poisson_requests,
)
from router.config import RouterConfig
from specdec.core.request_state import KPolicy
from specdec.core.speedup import expected_tokens

VERIFY_MS = 100.0
DRAFT_MS_PER_TOKEN = 10.0


def make_profile(verify_ms: float = VERIFY_MS, draft_ms: float = DRAFT_MS_PER_TOKEN, a: float = 0.8) -> Profile:
    """Flat costs: a verify of any size costs verify_ms, a Propose draft_ms x k, a prefill 1 ms/token."""
    rounds = [[4, 4, 4, 8], [4, 4, 2, 3], [4, 4, 0, 2]]
    return Profile(
        machine={"host": "test"},
        device="cpu: test",
        target={"model": "t", "dtype": "float32"},
        target_forward=Grid([1, 64], [1, 16], [[verify_ms, verify_ms], [verify_ms, verify_ms]]),
        target_prefill=Curve([1, 1000], [1.0, 1000.0]),
        draft={"model": "d", "dtype": "float32"},
        draft_forward=Grid([1, 64], [1, 4], [[draft_ms, draft_ms], [draft_ms, draft_ms]]),
        draft_prefill=Curve([1, 1000], [0.1, 100.0]),
        draft_propose=Grid([1, 64], [1, 16], [[draft_ms, 16 * draft_ms], [draft_ms, 16 * draft_ms]]),
        overhead=Overhead(router_ms=0.0, verify_rpc_ms=0.0, draft_rpc_ms=0.0, source="test"),
        drafters={"draft": DrafterStats("draft", [RequestRounds("p0", 64, 32, "length", rounds)])},
        workload={"max_tokens": 32},
    )


def requests(n: int, a: float, prompt: int = 16, output: int = 32, rate: float | None = None) -> list[SimRequestSpec]:
    acc = {"draft": [AcceptanceModel.iid(a)], "ngram": [AcceptanceModel.iid(a)]}
    if rate is None:
        return [SimRequestSpec(0.0, prompt, output, {k: v[0] for k, v in acc.items()}, f"r{i}") for i in range(n)]
    return poisson_requests(n, rate, parse_lengths(str(prompt)), parse_lengths(str(output)), acc, seed=1)


def deployment(profile: Profile | None = None, mode: str = "auto", **router) -> Deployment:
    base = {"micro_batches": 1, "predraft": False, "max_batched_tokens": 0}
    cfg = RouterConfig(**(base | router))
    return Deployment(costs=ProfileCosts(profile or make_profile()), router=cfg, mode=mode)


# ---- profile and workload ----------------------------------------------------------------------


def test_profile_round_trips_and_rejects_what_is_not_one(tmp_path):
    p = make_profile()
    path = p.save(tmp_path / "p.json")
    q = Profile.load(path)
    assert q.to_dict() == p.to_dict()
    assert q.draft_propose.at(3, 4) == pytest.approx(DRAFT_MS_PER_TOKEN * (1 + 15 * 3 / 15))
    bad = p.to_dict() | {"schema": "other"}
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(ProfileError, match="not a specdec profile"):
        Profile.load(tmp_path / "bad.json")
    broken = p.to_dict()
    del broken["target_forward"]
    with pytest.raises(ProfileError, match="missing"):
        Profile.from_dict(broken)
    with pytest.raises(ProfileError, match="one time per token count"):
        Grid([1], [1, 2], [[1.0]])


def test_grid_interpolates_and_never_extrapolates_below_the_largest_measured():
    g = Grid([1, 4], [1, 8], [[10.0, 20.0], [40.0, 80.0]])
    assert g.at(1, 1) == 10.0 and g.at(4, 8) == 80.0
    assert g.at(2.5, 4.5) == pytest.approx(37.5)
    assert g.at(8, 8) == pytest.approx(160.0)  # linear past the grid
    assert Curve([10, 20], [5.0, 5.0]).at(1000) == 5.0 and Curve([10], [5.0]).at(0) == 0.0


def test_a_grid_of_a_blocked_forward_prices_by_blocks():
    # A runner whose weight GEMMs run in blocks of 16 rows (the invariant forward on CUDA and on an
    # AMX CPU): each block costs a pass over the weights, plus a little per row. A line between the
    # cells steps over the blocks: at 4 rows of 5 tokens (2 blocks) it gives the 1-block price.
    def forward_ms(b, n):
        return 200.0 * math.ceil(b * n / 16) + 2.0 * b * n

    batches, tokens = [1, 2, 4, 8, 16], [1, 2, 4, 8, 13]
    cells = [[forward_ms(b, n) for n in tokens] for b in batches]
    blocked, plain = Grid(batches, tokens, cells, row_block=16), Grid(batches, tokens, cells)
    queries = [(b, n) for b in (1, 2, 3, 4, 6, 8, 12, 16) for n in (1, 2, 3, 5, 7, 9, 13)]
    worst = max(abs(blocked.at(b, n) / forward_ms(b, n) - 1) for b, n in queries)
    assert worst < 0.1, worst
    assert blocked.at(16, 5) == pytest.approx(forward_ms(16, 5))  # 5 blocks: between the 4- and 8-block cells
    assert abs(plain.at(4, 5) / forward_ms(4, 5) - 1) > 0.3
    profile = dataclasses.replace(make_profile(), target_forward=blocked)
    assert Profile.from_dict(profile.to_dict()).target_forward.row_block == 16


def test_acceptance_model_recovers_an_iid_rate():
    rng = random.Random(0)
    truth = AcceptanceModel.iid(0.7)
    counts: dict[tuple, int] = {}
    for _ in range(4000):
        d, a, _ = truth.sample(6, rng)
        counts[(6, d, a)] = counts.get((6, d, a), 0) + 1
    est = AcceptanceModel.from_rounds([[k, d, a, n] for (k, d, a), n in counts.items()])
    assert all(p == 1.0 for p in est.draft_p)
    assert all(abs(p - 0.7) < 0.04 for p in est.accept_p)
    taus = [1 + est.sample(4, rng)[1] for _ in range(4000)]
    assert sum(taus) / len(taus) == pytest.approx(expected_tokens(0.7, 4), rel=0.05)


def test_lengths_and_traces(tmp_path):
    assert parse_lengths("128").mean == 128 and parse_lengths("uniform:10:20").mean == 15
    assert parse_lengths("profile", [3, 5]).mean == 4
    for bad in ("0", "uniform:5:1", "profile", "lognormal:1:2"):
        with pytest.raises(WorkloadError):
            parse_lengths(bad)
    trace = tmp_path / "t.jsonl"
    rows = [{"t": 10.5, "prompt_tokens": 100, "output_tokens": 20}, {"t": 10.0, "prompt_tokens": 5, "output_tokens": 7}]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    reqs = load_trace(trace, {"draft": [AcceptanceModel.iid(0.5)]})
    assert [(r.t, r.prompt_tokens, r.output_tokens) for r in reqs] == [(0.0, 5, 7), (0.5, 100, 20)]
    (tmp_path / "bad.csv").write_text("t,prompt_tokens\n1,2\n")
    with pytest.raises(WorkloadError, match="row 1"):
        load_trace(tmp_path / "bad.csv", {})


# ---- the simulation ----------------------------------------------------------------------------


def test_one_request_off_costs_one_verify_per_token():
    res = simulate(deployment(mode="off"), requests(1, 0.8))
    s = res.summary
    assert s["tokens"] == 32 and s["errors"] == 0 and s["k_mean"] == 0
    assert s["tpot_ms_p50"] == pytest.approx(VERIFY_MS)
    assert s["ttft_ms_p50"] == pytest.approx(VERIFY_MS)  # the prompt rides in the first verify's forward
    assert res.utilization["target"] == pytest.approx(1.0, abs=1e-6)


def test_speculation_follows_the_acceptance_and_the_k_policy():
    always = simulate(deployment(k_policy=KPolicy(k=4)), requests(1, 1.0))
    s = always.summary
    assert s["tokens"] == 32 and s["acceptance"] == 1.0
    assert s["rounds"] == 7  # six rounds of 4 drafted + the bonus token, then k = 1 for the last two tokens
    assert s["tpot_ms_p50"] == pytest.approx((VERIFY_MS + 4 * DRAFT_MS_PER_TOKEN) / 5, rel=0.1)
    never = simulate(deployment(k_policy=KPolicy(k=4, adaptive=True, k_min=1)), requests(1, 0.0))
    assert never.summary["accepted"] == 0 and never.summary["k_mean"] < 1.5  # adaptive k falls to k_min


def test_the_simulator_calls_the_routers_policy(monkeypatch):
    """Patching the router's own function changes the simulation: it runs no copy of it."""
    import router.draft_depth

    monkeypatch.setattr(router.draft_depth, "want_k", lambda *a, **k: 0)
    res = simulate(deployment(k_policy=KPolicy(k=4)), requests(2, 1.0))
    assert res.summary["drafted"] == 0 and res.summary["tau"] == 1.0


def test_goodput_gate_turns_speculation_off_above_the_batch():
    gated = simulate(deployment(k_policy=KPolicy(k=4), auto_off_batch=2), requests(6, 1.0))
    free = simulate(deployment(k_policy=KPolicy(k=4)), requests(6, 1.0))
    assert gated.summary["drafted"] < free.summary["drafted"]
    explicit = simulate(deployment(k_policy=KPolicy(k=4), auto_off_batch=2, mode="draft"), requests(6, 1.0))
    # Only AUTO requests are gated (an AUTO batch also decodes one round plainly, to measure it:
    # router/speculation_off.py, plain_probe_due; without that, it drafts as the explicit mode).
    unprobed = deployment(k_policy=KPolicy(k=4), speculation_off={"plain_probe_rounds": 0})
    assert explicit.summary["drafted"] == simulate(unprobed, requests(6, 1.0)).summary["drafted"]
    assert free.summary["drafted"] < explicit.summary["drafted"]
    assert free.rebalance_actions.get("plain_probe", 0) >= 1


def test_late_drafts_fail_open_and_requests_still_complete():
    slow = make_profile(draft_ms=400.0)  # a draft of 4 tokens takes 16 verifies; the deadline allows 10
    res = simulate(deployment(slow, k_policy=KPolicy(k=4), draft_deadline_s=5.0), requests(2, 1.0))
    s = res.summary
    assert s["fail_open_rounds"] > 0 and s["errors"] == 0 and s["tokens"] == 64


def test_chunked_prefill_under_the_round_budget():
    whole = simulate(deployment(mode="off"), requests(1, 0.8, prompt=1001))
    chunked = simulate(deployment(mode="off", max_batched_tokens=256, prefill_chunk=128), requests(1, 0.8, prompt=1001))
    # the prompt less its last token and the first verify row in one forward: a prefill of 1001 tokens
    assert whole.summary["ttft_ms_p50"] == pytest.approx(1001.0)
    # eight chunks of 128 tokens or less, one per round, each costing its tokens, the last in the verify row
    assert chunked.summary["ttft_ms_p50"] == pytest.approx(1001.0)
    mixed = simulate(deployment(mode="off", max_batched_tokens=256, prefill_chunk=128), requests(1, 0.8) + [
        SimRequestSpec(0.0, 1001, 8, {}, "long")])  # fmt: skip
    short = [r for r in mixed.records if r["id"] == "r0"][0]
    assert short["t_first"] < 0.5  # the short request is not stuck behind the long prompt


def test_a_prompt_waiting_beside_speculation_gets_the_budget_of_the_tokens_committed(monkeypatch):
    """prefill_plan.round_budget through TargetBalance.prefill_budget: beside a request committing
    ~5 tokens a round, a long prompt gets ~5 chunks a round and decodes sooner than with the plain
    budget (patched back to the plain one: the simulation runs the router's rule, no copy)."""
    import router.target_balance

    acc = {"draft": AcceptanceModel.iid(1.0), "ngram": AcceptanceModel.iid(1.0)}
    reqs = [SimRequestSpec(0.0, 16, 96, acc, "spec"), SimRequestSpec(0.5, 2001, 8, acc, "long")]
    dep = dict(k_policy=KPolicy(k=4), max_batched_tokens=256, prefill_chunk=128, mode="draft")

    def ttft(res) -> float:
        long = [r for r in res.records if r["id"] == "long"][0]
        return long["t_first"] - 0.5

    scaled = ttft(simulate(deployment(**dep), reqs))
    monkeypatch.setattr(router.target_balance, "round_budget", lambda budget, tokens_per_row: budget)
    plain = ttft(simulate(deployment(**dep), reqs))
    # 2000 prompt tokens cost 2 s whatever the chunking (the verify rows ride in their forwards);
    # the plain budget adds a round's draft wait (40 ms) per 128-token chunk (16), the scaled one
    # per ~5 chunks
    assert plain > scaled + 0.4, (plain, scaled)


def test_lanes_split_a_batch_and_predrafts_hit_when_all_is_accepted():
    one = simulate(deployment(k_policy=KPolicy(k=2), micro_batches=1), requests(8, 1.0))
    two = simulate(deployment(k_policy=KPolicy(k=2), micro_batches=2, split_min_batch=4), requests(8, 1.0))
    assert one.mean_batch == pytest.approx(8.0, abs=0.5) and two.mean_batch == pytest.approx(4.0, abs=0.5)
    pre = simulate(deployment(k_policy=KPolicy(k=2), predraft=True), requests(1, 1.0))
    assert pre.predraft_hit_rate is not None and pre.predraft_hit_rate > 0.8
    assert pre.summary["tpot_ms_p50"] < one.summary["tpot_ms_p50"]


def test_a_predraft_longer_than_the_verify_it_overlaps_is_not_sent(monkeypatch):
    """router.rebalance.predraft_room in the simulation: with 60 ms draft steps, a pre-draft (k 2 and
    the bonus token's guess: 3 steps) would run past the 100 ms verify, and a miss would wait for it.
    Only the first two rounds' are sent (nothing is measured yet: the first round's forward holds
    the prompt, so the second measures the first verify); with 10 ms steps every round's is."""
    from router.drafter_pool import DrafterPool

    sent = []
    propose = DrafterPool.propose

    def counted(self, name, seqs, started=None, prefill_tokens=0, predraft=False):
        sent.append(predraft)
        return propose(self, name, seqs, started, prefill_tokens, predraft)

    monkeypatch.setattr(DrafterPool, "propose", counted)
    for draft_ms, most in ((60.0, 2), (10.0, None)):
        sent.clear()
        res = simulate(
            deployment(make_profile(draft_ms=draft_ms), k_policy=KPolicy(k=2), predraft=True), requests(1, 1.0)
        )
        assert res.summary["tokens"] == 32
        if most is None:
            assert sum(sent) >= 8 and res.predraft_hit_rate == 1.0  # ~11 rounds of 3 tokens, each pre-drafted
        else:
            assert sum(sent) == most


def test_queue_limit_rejects_and_closed_loop_sends_one_at_a_time():
    full = simulate(deployment(mode="off", max_queue=1, max_batch=1), requests(4, 0.8))
    assert full.rejected == 2 and full.summary["errors"] == 2
    closed = simulate(deployment(mode="off"), requests(3, 0.8), closed=1)
    ends = sorted(r["t_end"] for r in closed.records)
    starts = sorted(r["t_start"] for r in closed.records)
    assert starts[1:] == ends[:-1]  # each request starts as the last one ends
    assert closed.summary["wall_s"] == pytest.approx(3 * 32 * VERIFY_MS / 1e3)  # each prompt rides in a verify


def test_closed_loop_requests_due_together_are_sent_a_moment_apart_and_the_first_runs_alone():
    """bench serve's clients send requests that fall due together 0.2-0.4 ms apart, and the
    service's router starts its next round on the first alone; so does the simulated one, at the
    start and when two requests end in the same round (sent at one instant, the round took both)."""
    specs = requests(4, 0.8)
    specs[0] = dataclasses.replace(specs[0], output_tokens=33)  # r1 starts a round later: they end together
    res = simulate(deployment(mode="off"), specs, closed=2)
    by_id = {r["id"]: r for r in res.records}
    assert by_id["r0"]["t_end"] == by_id["r1"]["t_end"]
    assert by_id["r1"]["t_start"] - by_id["r0"]["t_start"] == pytest.approx(CLIENT_STAGGER_S)
    assert by_id["r3"]["t_start"] - by_id["r2"]["t_start"] == pytest.approx(CLIENT_STAGGER_S)
    for first, second in (("r0", "r1"), ("r2", "r3")):
        ttft = [by_id[k]["t_first"] - by_id[k]["t_start"] for k in (first, second)]
        assert ttft[1] > ttft[0] + VERIFY_MS / 1e3 / 2  # the second waited out the first's round


def test_an_overloaded_deployment_reports_unfinished_requests():
    res = simulate(deployment(mode="off"), requests(50, 0.8, rate=50.0), time_limit=5.0)
    assert res.unfinished > 0 and res.summary["errors"] == res.unfinished


def test_poisson_arrivals_are_bench_serves(monkeypatch):
    from specdec.bench.serve import poisson_arrivals

    reqs = requests(5, 0.5, rate=2.0)
    assert [r.t for r in reqs] == poisson_arrivals(5, 2.0, 1)
    pool = acceptance_pool(make_profile().drafters["draft"])
    assert len(pool) == 1 and 0.0 < pool[0].accept_p[0] < 1.0
    with pytest.raises(WorkloadError, match="no acceptance model"):
        simulate(deployment(), [dataclasses.replace(reqs[0], acceptance={})])


def test_the_routers_rebalancer_runs_in_the_simulation():
    """The rebalancer's own code (router/draft_depth.py, router/speculation_off.py and
    router/drafter_choice.py through TargetBalance and DrafterPool) on the
    simulated clock: a verify that grows steeply with the tokens verified and drafts that are
    almost never accepted make the goodput rule switch AUTO requests' speculation off; with the
    rebalancer disabled they keep drafting."""
    steep = make_profile()
    steep.target_forward = Grid([1, 64], [1, 16], [[100.0, 1600.0], [100.0, 1600.0]])
    on = simulate(deployment(steep), requests(8, 0.05, output=64, rate=2.0))
    off_cfg = deployment(steep)
    off_cfg.router.rebalance = dataclasses.replace(off_cfg.router.rebalance, enabled=False)
    off = simulate(off_cfg, requests(8, 0.05, output=64, rate=2.0))
    assert on.rebalance_actions.get("spec_off", 0) > 0 and not off.rebalance_actions
    assert on.summary["drafted"] < off.summary["drafted"]
    assert on.summary["tpot_ms_p50"] < off.summary["tpot_ms_p50"]  # plain decoding is faster here


def test_requests_arriving_where_speculation_loses_start_off_and_skip_the_draft_prefill(monkeypatch):
    """Once the goodput rule has switched speculation off (steep verify, drafts almost never
    accepted), requests arriving later start switched off (router TargetBalance.start) and their
    long prompts are not prefilled on the drafter: the draft device does less work than when
    every new request starts on (start() disabled), and the outputs are as many tokens."""
    steep = make_profile()
    # compute-bound: 100 ms a verified token, the rows' tokens packed (64 rows of 16: 64 x 16 x 100 ms)
    steep.target_forward = Grid([1, 64], [1, 16], [[100.0, 1600.0], [6400.0, 102400.0]])
    steep.draft_prefill = Curve([1, 1000], [1.0, 1000.0])  # 1 ms a prompt token on the drafter

    def run():
        dep = deployment(steep, max_batched_tokens=256, prefill_chunk=64)
        return simulate(dep, requests(16, 0.05, prompt=400, output=32, rate=2.0))

    lazy = run()
    monkeypatch.setattr("router.target_balance.TargetBalance.start", lambda self, running, ks: None)
    eager = run()
    assert lazy.summary["tokens"] == eager.summary["tokens"] == 16 * 32
    assert lazy.rebalance_actions.get("spec_off", 0) > 0
    # the requests that start off (measured: draft busy 5 % of the wall vs 9 %)
    assert lazy.utilization["draft"] < 0.7 * eager.utilization["draft"]


def test_a_draft_prefill_on_the_targets_own_device_keeps_short_requests_off(monkeypatch):
    """A drafter on the target's device (colocated) prefills each prompt on the device the target
    verifies on; the router prices that once per request (TargetBalance._owed, from the pool's
    measured prefill time and the workers' placements), and short requests arriving once it is
    measured start off: the wall is shorter than without the price (measured: 15.5 s against 23.0).
    A drafter on its own device is charged nothing of the kind: the same run with or without it
    (charged there, 14 requests start off: the run checks the placements)."""
    prof = make_profile()
    prof.draft_prefill = Curve([1, 1000], [2.0, 2000.0])  # 2 ms a prompt token: 0.8 s for 400

    def run(colocated: bool):
        dep = dataclasses.replace(deployment(prof, rebalance={"spec_min_evidence": 4.0}), colocated=colocated)
        return simulate(dep, requests(16, 0.8, prompt=400, output=16, rate=1.0))

    shared, own = run(True), run(False)
    monkeypatch.setattr("router.target_balance.TargetBalance._owed", lambda *a: 0.0)
    unpriced, unpriced_own = run(True), run(False)
    assert shared.summary["tokens"] == unpriced.summary["tokens"] == 16 * 16
    assert shared.rebalance_actions.get("spec_off", 0) >= 8 and not unpriced.rebalance_actions.get("spec_off")
    assert shared.summary["wall_s"] < 0.85 * unpriced.summary["wall_s"]
    assert own.summary == unpriced_own.summary


def test_the_draft_prefill_is_one_call_per_drafter_and_round_and_the_split_reports_it_as_the_bench_does():
    """Prompts of 400 tokens in chunks of 64, two arriving together: the drafter caches all but each
    prompt's last round in one Prefill per round (as router.drafting sends them), and the split
    carries the calls, their tokens and the drafter's time per call, as bench serve scrapes them."""
    prof = make_profile()
    prof.draft_prefill = Curve([1, 1000], [1.0, 1000.0])  # 1 ms a prompt token on the drafter
    dep = deployment(prof, mode="draft", max_batched_tokens=128, prefill_chunk=64)
    res = simulate(dep, requests(2, 0.8, prompt=400))
    split = res.summary["split"]
    cached = split["draft_prefills"] * split["draft_prefill_tokens"]
    assert 2 * (400 - 128) <= cached < 2 * 400
    # both prompts' chunks of a round in one call (the router counts the tokens it sends: a prompt's
    # first chunk also carries the token the next chunk starts from)
    assert split["draft_prefill_tokens"] == pytest.approx(128, abs=0.5)
    assert split["draft_prefill_compute_ms"] >= 128.0  # 1 ms a token, stretched where it shared nothing
    assert "draft_prefills" not in simulate(deployment(prof, mode="off"), requests(2, 0.8, prompt=400)).summary["split"]


def test_the_router_memory_carries_over_from_one_run_to_the_next():
    """A service serves a benchmark's runs one after the other: what its router learned in one
    (the verify line, the pooled acceptance, the drafter's wait) decides the next run's first
    rounds. After a run where speculation lost, a burst of new requests starts off at once and
    drafts nothing; a fresh router has to draft first to learn that."""
    steep = make_profile()
    steep.target_forward = Grid([1, 64], [1, 16], [[100.0, 1600.0], [6400.0, 102400.0]])  # 100 ms a token
    first = simulate(deployment(steep), requests(8, 0.05, output=64, rate=2.0))
    assert first.memory is not None and first.memory.drafters["draft-0"][0] is not None
    warm = simulate(deployment(steep), requests(8, 0.05, output=32), memory=first.memory)
    cold = simulate(deployment(steep), requests(8, 0.05, output=32))
    assert warm.summary["drafted"] == 0 < cold.summary["drafted"]
    assert warm.rebalance_actions.get("spec_off", 0) == 8


def test_a_recorded_first_round_is_drawn_apart_from_the_later_rounds():
    """Each request's first round (here: rejected at once, as an n-gram drafting from the prompt's
    tail is) gets its own model; the other rounds are modelled without it."""
    rows = [[4, 4, 0, 1], [4, 4, 4, 6]]
    stats = DrafterStats("ngram", [RequestRounds(f"p{i}", 64, 32, "length", rows, first=[4, 4, 0]) for i in range(3)])
    (model, *_) = acceptance_pool(stats)
    assert model.first is not None and model.first.accept_p[0] < 0.3 < 0.9 < model.accept_p[0]
    old = acceptance_pool(DrafterStats("ngram", [RequestRounds("p", 64, 32, "length", rows)]))[0]
    assert old.first is None and 0.8 < old.accept_p[0] < 0.9  # not recorded: every round alike


def test_the_rebalancer_does_not_lose_to_static_pairing_with_a_drafter_on_each_target_gpu():
    """Three 70B groups (TP2), each with a 1B drafter on its own GPUs, 60 requests of ~1000-token
    prompts, the router of configs/cluster.yaml (two lanes, pre-drafting). The rebalancer must
    serve them about as well as static pairing. It lost 27 % of TPOT p50 here (36.7 vs 26.7 ms)
    when moves chased the drafters' queues and device load (276 moves), and the speculation switch
    fitted its verify line to the wall time, which with two lanes holds the other lane's call."""
    from cluster.config import DEFAULT_CONFIG, load_config
    from cluster.planning.catalog import load_catalog
    from cluster.planning.costs import RooflineCosts

    cat = load_catalog()
    h200 = cat.device("H200-SXM")
    costs = RooflineCosts(cat.model("llama-3.1-70b"), h200, 2, cat.model("llama-3.2-1b"), h200, cat)
    router = load_config(DEFAULT_CONFIG.with_name("cluster.yaml")).router
    assert router.micro_batches == 2 and router.predraft and router.rebalance.enabled
    accept = {"draft": [AcceptanceModel.iid(0.75)]}
    reqs = poisson_requests(60, 4.0, parse_lengths("normal:1000:300"), parse_lengths("256"), accept, 0)
    runs = {}
    for enabled in (True, False):
        cfg = dataclasses.replace(router, rebalance=dataclasses.replace(router.rebalance, enabled=enabled))
        dep = Deployment(
            costs,
            cfg,
            groups=3,
            drafts=3,
            target_slots=32,
            draft_slots=32,
            max_context=2560,
            colocated=True,
        )
        runs[enabled] = simulate(dep, reqs, seed=0)
    on, static = runs[True], runs[False]
    assert on.unfinished == static.unfinished == 0
    assert on.rebalance_actions.get("draft_move", 0) <= len(reqs) / 4
    assert on.summary["tpot_ms_p50"] <= 1.1 * static.summary["tpot_ms_p50"]
    assert on.summary["throughput_tok_s"] >= 0.95 * static.summary["throughput_tok_s"]
    # k itself may differ: the switch caps it in rounds whose longest draft would hold the verify
    # (k 4.3 against 5.8 here, at the same TPOT and throughput)
    assert on.summary["k_mean"] >= 0.5 * static.summary["k_mean"]


def test_a_greedy_path_replays_the_same_rounds_in_every_draw():
    from cluster.planning.greedy_path import GreedyPath

    # from every 4th position the drafter agrees for 3 tokens: a round of k >= 3 accepts those 3
    agree = [3 - p % 4 for p in range(32)]
    specs = lambda: [SimRequestSpec(0.0, 16, 32, {"draft": GreedyPath(agree, AcceptanceModel.iid(0.5))}, "r0")]  # noqa: E731
    dep = deployment(k_policy=KPolicy(k=4))
    runs = [simulate(dep, specs(), seed=s).summary for s in range(3)]
    assert all(r == runs[0] for r in runs)
    # 8 rounds of 3 accepted + 1; the last asks 3 (the 32nd token is the target's own)
    assert runs[0]["tau"] == pytest.approx(4.0) and runs[0]["k_mean"] == pytest.approx(31 / 8)
    drawn = [simulate(dep, requests(1, 0.75), seed=s).summary["tau"] for s in range(3)]
    assert len(set(drawn)) > 1  # the acceptance model's rounds are drawn anew each time
    # the service's own spread of call times (Deployment.jitter) moves the times, not a fixed k's path
    jittered = [simulate(dataclasses.replace(dep, jitter=0.05), specs(), seed=s).summary for s in range(3)]
    assert len({r["tpot_ms_p50"] for r in jittered}) == 3 and {r["tau"] for r in jittered} == {4.0}
