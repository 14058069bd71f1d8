"""`specdec profile` on tiny models (every part measured, the JSON valid), the overheads read from a
`specdec bench serve` result, and `specdec simulate` predicting and comparing a bench run."""

from __future__ import annotations

import dataclasses
import json

import pytest

from cluster.planning.calibration import overhead_from_bench
from cluster.planning.costs import ProfileCosts
from cluster.planning.profile import Curve, DrafterStats, Grid, Overhead, Profile, RequestRounds
from cluster.planning.profiler import ProfileOptions, take_profile
from specdec.cli.main import main
from specdec.core.models import load_model
from specdec.core.runner import ModelRunner


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "p.jsonl"
    rows = [{"id": "a", "prompt": "def add(a, b):\n    return a + b\n\ndef add(", "chat": False},
            {"id": "b", "prompt": "abcabcabcabc abcabc", "chat": False}]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def tiny_profile(tiny_paths, prompts_file) -> Profile:
    opts = ProfileOptions(
        dtype="float32",
        prompts=str(prompts_file),
        max_tokens=12,
        budget_s=120,
        threads=1,
        batches=(1, 2),
        tokens=(1, 4),
        draft_tokens=(1, 2),
        draft_ks=(1, 4),
        context=16,
        prefill_lengths=(8, 32),
        repeat=2,  # a first pass and one interleaved pass
    )
    return take_profile(str(tiny_paths["llama"]), str(tiny_paths["llama-draft"]), opts)


def test_profile_measures_every_part_and_says_where_it_came_from(tiny_profile, tiny_paths, tmp_path):
    p = tiny_profile
    assert not p.skipped and p.elapsed_s > 0 and p.created
    assert p.machine["cores"] >= 1 and p.machine["torch"] and p.device.startswith("cpu")
    assert p.target["dtype"] == "float32" and p.target["config"]["layers"] >= 1 and p.draft["config"]["params"] > 0
    assert p.target_forward.batch == [1, 2] and all(v > 0 for row in p.target_forward.ms for v in row)
    for grid in (p.target_forward, p.draft_forward, p.draft_propose):  # more never costs less (monotone.py)
        assert all(a <= b for row in grid.ms for a, b in zip(row, row[1:]))
        assert all(a <= b for a, b in zip(grid.ms[0], grid.ms[1]))
    assert all(a <= b for a, b in zip(p.target_prefill.ms, p.target_prefill.ms[1:]))
    assert p.draft_propose is not None and p.draft_propose.tokens == [1, 4] and p.draft_prefill is not None
    assert set(p.drafters) == {"draft", "ngram"} and p.tp is None
    for stats in p.drafters.values():
        assert [r.id for r in stats.requests] == ["a", "b"]
        assert all(r.output_tokens == 12 and r.rounds for r in stats.requests)
        assert sum(d for r in stats.requests for _, d, _, _ in r.rounds) > 0
    assert p.drafters["draft"].draft_ms_per_token > 0
    # the draft model's greedy path, one agreement per output token (greedy_path.py); none for n-grams
    assert all(len(r.agree) == r.output_tokens for r in p.drafters["draft"].requests)
    assert any(max(r.agree) > 0 for r in p.drafters["draft"].requests) and not p.drafters["ngram"].requests[0].agree
    # the target's grid is priced by the GEMM blocks its runner runs (None where the BLAS keeps the
    # padding rule: attention.py); a drafter's forward is not the invariant one (build.py)
    runner = ModelRunner(load_model(str(tiny_paths["llama"]), dtype="float32").model, 1, 32)
    assert p.target_forward.row_block == runner.gemm_block and p.draft_forward.row_block is None
    assert Profile.load(p.save(tmp_path / "p.json")).to_dict() == p.to_dict()


def test_no_budget_still_measures_what_a_profile_needs(tiny_paths, prompts_file):
    opts = ProfileOptions(dtype="float32", prompts=str(prompts_file), max_tokens=8, budget_s=0.0, batches=(1, 2))
    p = take_profile(str(tiny_paths["llama"]), None, opts)
    assert p.target_forward.batch == [1]  # one measurement each, and two prompt lengths for the prefill:
    assert len(p.target_prefill.tokens) == 2  # a forward's fixed part (one point would price it as 0)
    assert [len(s.requests) for s in p.drafters.values()] == [1] and set(p.drafters) == {"ngram"}
    assert any("batch 2" in part for part in p.skipped)


def test_overhead_from_a_bench_serve_result(tiny_profile):
    def scenario(batch: float, router_ms: float) -> dict:
        split = {"rounds": 100, "router_ms_per_round": router_ms, "rpc_ms_per_round": 2.0,
                 "draft_wait_ms_per_round": 50.0, "drafted_per_round": 4.0 * batch}  # fmt: skip
        return {"mode": "auto", "summary": {"requests": 10, "rounds": int(100 * batch), "split": split}}

    bench = {"results": [scenario(1, 30.0), scenario(4, 60.0)]}
    o = overhead_from_bench(bench)
    assert o.router_ms == pytest.approx(20.0) and o.router_ms_per_row == pytest.approx(10.0)
    assert o.verify_rpc_ms == 2.0 and o.draft_rpc_ms == 50.0 and "2 scenarios" in o.source
    # with a profile, the rounds' prefills and the predicted Propose come out of the router and draft phases
    p = overhead_from_bench(bench, tiny_profile)
    assert p.router_ms + p.router_ms_per_row < o.router_ms + o.router_ms_per_row and p.draft_rpc_ms < 50.0
    with pytest.raises(ValueError, match="round split"):
        overhead_from_bench({"results": [{"mode": "auto", "summary": {}}]})


def _grid_profile() -> Profile:
    """A profile with known numbers: forwards of 100-300 ms, a prefill of ~500 ms per prompt."""
    requests = [RequestRounds("a", 161, 24, "length")]
    return Profile(
        machine={},
        device="cpu",
        target={},
        target_forward=Grid([1, 4], [1, 5], [[100.0, 150.0], [200.0, 300.0]], context=168),
        target_prefill=Curve([16, 256], [50.0, 800.0]),
        drafters={"ngram": DrafterStats("ngram", requests)},
    )


def _serve_scenario(grid: Grid, batch: int, k: int, scale: float, rpc: float | None, prefill: bool) -> dict:
    """A bench serve scenario whose worker computed ``scale`` x the grid's forward per round, with
    ``rpc`` ms of RPC on top (None: the worker reported no compute, so no rpc phase)."""
    split = {"rounds": 50, "verify_ms_per_round": scale * grid.at(batch, k + 1) + (rpc or 0.0),
             "router_ms_per_round": 0.5 + 0.1 * batch, "drafted_per_round": float(k * batch),
             "draft_wait_ms_per_round": 20.0 if k else 0.0}  # fmt: skip
    if rpc is not None:
        split["rpc_ms_per_round"] = rpc
    if prefill:
        split["prefill_ms_per_round"] = 400.0
    return {"mode": "auto" if k else "off", "summary": {"requests": 8, "rounds": 50 * batch, "split": split}}


def test_verify_scale_and_rpc_come_from_the_workers_compute_in_the_service():
    profile = _grid_profile()
    g = profile.target_forward
    cases = [(1, 0, 1.5), (4, 0, 1.5), (1, 4, 1.5), (4, 4, 1.3)]
    bench = {"results": [_serve_scenario(g, b, k, s, rpc=3.0, prefill=True) for b, k, s in cases]}
    o = overhead_from_bench(bench, profile)
    # the median scale; the rpc phase as measured; the router phase (prefills apart) fitted by batch
    assert o.verify_scale == pytest.approx(1.5) and o.verify_rpc_ms == pytest.approx(3.0)
    assert o.router_ms == pytest.approx(0.5) and o.router_ms_per_row == pytest.approx(0.1)
    # per mean batch and kind: plain 1.5 at batches 1 and 4, speculative 1.5 and 1.3; interpolated
    assert o.verify_scale_plain_by_batch == [[1, 1.5], [4, 1.5]]
    assert o.verify_scale_by_batch == [[1, 1.5], [4, 1.3]]
    # prefill: 400 ms x 50 rounds for 8 prompts of 161 tokens, which the curve puts at 500 ms each
    assert o.prefill_scale == pytest.approx(5.0)
    profile.overhead = o
    costs = ProfileCosts(profile, "ngram")
    assert costs.verify_s(4, 5, 168) == pytest.approx(0.39)  # 1.3 x 300 ms
    assert costs.verify_s(4, 1, 168) == pytest.approx(1.5 * g.at(4, 1) / 1e3)  # plain rows, plain scale
    assert costs.verify_s(1, 1, 168) == pytest.approx(0.15)  # 1.5 x 100 ms
    assert o.verify_scale_at(2) == pytest.approx(1.5 - 0.2 / 3) and o.verify_scale_at(16) == 1.3
    assert o.verify_scale_at(16, tokens_per_row=1) == 1.5
    only_plain = Overhead(verify_scale=1.1, verify_scale_plain_by_batch=[[1, 1.2]])
    assert only_plain.verify_scale_at(4) == 1.2 and Overhead(verify_scale=1.1).verify_scale_at(4) == 1.1
    assert costs.prefill_s(1, 160) == pytest.approx(2.5)
    # where the service's drafting overlapped its verifies on one device, speculative verifies take
    # the plain rounds' scale: the simulator's shared device adds that contention itself
    shared = ProfileCosts(profile, "ngram", drafts_overlap_verifies=True)
    assert shared.verify_s(4, 5, 168) == pytest.approx(0.45)  # 1.5 x 300 ms
    # older results: no rpc phase (the RPC goes into the scale), prefills inside the router phase
    old = {"results": [_serve_scenario(g, b, k, 1.5, rpc=None, prefill=False) for b, k, _ in cases]}
    o = overhead_from_bench(old, profile)
    assert o.verify_rpc_ms == 0.0 and o.verify_scale == pytest.approx(1.5) and o.router_ms == 0.0
    assert overhead_from_bench(bench).verify_scale == 1.0  # no profile, no grid to scale


def test_the_draft_rpc_is_read_only_from_scenarios_without_fail_open():
    """A round that failed open waited out its draft deadline: that wait is not RPC time (the
    simulator models the deadline itself)."""
    g = _grid_profile().target_forward
    late = _serve_scenario(g, 4, 4, 1.0, rpc=3.0, prefill=True)
    late["summary"]["split"]["draft_wait_ms_per_round"] = 900.0
    late["summary"]["fail_open_rounds"] = 12
    assert overhead_from_bench({"results": [late]}).draft_rpc_ms == Overhead.draft_rpc_ms  # nothing to read
    clean = _serve_scenario(g, 1, 4, 1.0, rpc=3.0, prefill=True)  # draft wait 20 ms, no grid: all of it
    assert overhead_from_bench({"results": [late, clean]}).draft_rpc_ms == pytest.approx(20.0)


def test_the_draft_scale_comes_from_the_draft_workers_compute_per_propose():
    """The service's Propose (its compute, as the draft worker reports it) over the profile's at the
    same rows and steps; the draft RPC is then the draft wait less the scaled Propose."""
    propose = Grid([1, 8], [1, 8], [[20.0, 160.0], [40.0, 320.0]])
    profile = dataclasses.replace(_grid_profile(), draft_forward=propose, draft_propose=propose)
    g = profile.target_forward

    def scenario(rows: int, steps: int, compute_ms: float) -> dict:
        sc = _serve_scenario(g, rows, steps, 1.0, rpc=3.0, prefill=True)
        split = sc["summary"]["split"]
        split["draft_wait_ms_per_round"] = compute_ms + 5.0  # 5 ms of RPC beside the compute
        split.update(proposes=40, propose_compute_ms=compute_ms, propose_rows=rows, propose_steps=steps)
        return sc

    # the profile says 160 ms (1 row, 8 steps), 320 ms (8 rows, 8 steps) and 40 ms (8 rows, 1 step);
    # the service took 1.6x of it at one row and 0.8x at eight (a scale that depends on the batch,
    # as the float32 Qwen pair's did): by batch, and 0.8 overall (the median)
    bench = {"results": [scenario(1, 8, 256.0), scenario(8, 8, 256.0), scenario(8, 1, 32.0)]}
    o = overhead_from_bench(bench, profile)
    assert o.draft_scale == pytest.approx(0.8) and o.draft_scale_by_batch == [[1, 1.6], [8, 0.8]]
    assert o.draft_rpc_ms == pytest.approx(5.0)  # each wait less its own batch's scaled Propose
    profile.overhead = dataclasses.replace(o, draft_step_by_rows=[])  # the scaled grid (see the points below)
    costs = ProfileCosts(profile, "draft")
    assert costs.draft_s(8, 8, 168) == pytest.approx(0.8 * 0.32) and costs.draft_s(1, 8, 168) == pytest.approx(0.256)
    assert o.draft_scale_at(4.5) == pytest.approx(1.2) and Overhead(draft_scale=0.9).draft_scale_at(3) == 0.9
    # the router's own measure of the draft RPC (each timed Propose's wall less its compute) wins
    # over the draft wait, which also holds waits for pre-drafts (here 300 ms of them)
    for sc, measured in zip(bench["results"], (2.0, 4.0, 6.0)):
        sc["summary"]["split"]["draft_wait_ms_per_round"] += 300.0
        sc["summary"]["split"]["propose_rpc_ms"] = measured
    assert overhead_from_bench(bench, profile).draft_rpc_ms == pytest.approx(4.0)
    # the scenarios span 7 rows: the service's own cost per step at each scenario's rows prices the
    # Propose (32 ms a step at every row here), not the profile's grid
    assert o.draft_step_by_rows == [[1.0, 32.0], [8.0, 32.0]] and costs.draft_s(4, 3, 168) == pytest.approx(
        propose.at(4, 3) * o.draft_scale_at(4) / 1e3
    )
    profile.overhead = o
    assert ProfileCosts(profile, "draft").draft_s(4, 3, 168) == pytest.approx(3 * 0.032)

    # results from before the draft worker reported its compute: no scale
    for sc in bench["results"]:
        del sc["summary"]["split"]["proposes"]
    assert overhead_from_bench(bench, profile).draft_scale_at(4) == 1.0


def test_the_services_propose_per_step_is_interpolated_between_its_scenarios_rows():
    """Closed c=1, 2, 4, 8 of the bf16 Qwen pair (serve-bf16-cal7.json): 31.3, 44.0, 51.9, 70.6 ms a
    step at 1.0, 1.96, 2.93, 6.89 rows, which the profile's grid (timed on the draft's own
    continuations) prices otherwise. A least-squares line through them (29.8 + 6.2 ms x rows)
    priced the one-row step at 36.0 ms, 15 % over the service's; the points price it as measured."""
    propose = Grid([1, 8], [1, 8], [[20.0, 160.0], [40.0, 320.0]])
    profile = dataclasses.replace(_grid_profile(), draft_forward=propose, draft_propose=propose)

    def scenario(rows: float, steps: float, compute_ms: float) -> dict:
        sc = _serve_scenario(profile.target_forward, 1, 4, 1.0, rpc=3.0, prefill=True)
        sc["summary"]["split"].update(
            proposes=20, propose_compute_ms=compute_ms, propose_rows=rows, propose_steps=steps
        )
        return sc

    runs = [scenario(1.0, 5.905, 184.9), scenario(1.955, 4.682, 206.2), scenario(2.929, 4.357, 226.2)]
    o = overhead_from_bench({"results": runs}, profile)
    assert o.draft_step_by_rows == [[1.0, pytest.approx(31.31, abs=0.01)], [1.955, pytest.approx(44.04, abs=0.01)],
                                    [2.929, pytest.approx(51.92, abs=0.01)]]  # fmt: skip
    profile.overhead = o
    costs = ProfileCosts(profile, "draft")
    assert costs.draft_s(1, 6, 168) == pytest.approx(6 * 31.31e-3, abs=1e-4)
    halfway = (44.04 + 51.92) / 2
    assert costs.draft_s(2.442, 4, 168) == pytest.approx(4 * halfway / 1e3, rel=1e-3)
    # past the rows it saw, the step grows as the profile's grid does (bf16 Qwen pair: a line through
    # 1-2.7 rows priced a step of 8 rows at 138 ms, the service took 87)
    past = 6 * 51.92 * propose.at(8, 6) / propose.at(2.929, 6) / 1e3
    assert costs.draft_s(8, 6, 168) == pytest.approx(past, rel=1e-3)
    # two scenarios of about the same rows are one point; a dip at more rows is noise, not a cheaper step
    steps = [scenario(1.0, 5.0, 150.0), scenario(1.2, 5.0, 170.0), scenario(3.0, 5.0, 140.0), scenario(6.0, 5.0, 250.0)]
    dip = overhead_from_bench({"results": steps}, profile)
    assert dip.draft_step_by_rows == [[1.1, 32.0], [3.0, 32.0], [6.0, 50.0]]
    # rows that do not span a row (c=8 and c=16: 6.0 and 6.4): no points, the grid scaled
    close = overhead_from_bench({"results": [scenario(6.0, 4.75, 1659.0), scenario(6.38, 5.0, 1563.0)]}, profile)
    assert close.draft_step_by_rows == [] and close.draft_scale != 1.0
    # a step that costs less at the most rows than at the fewest is not a cost: no points
    falling = overhead_from_bench({"results": [scenario(1.0, 5.0, 1000.0), scenario(4.0, 5.0, 500.0)]}, profile)
    assert falling.draft_step_by_rows == []


def test_a_profile_calibrated_before_the_points_reads_its_line_as_points():
    """Profiles from before kept [fixed, per row] and the rows it held to: the same prices there."""
    o = Overhead.from_dict({"draft_step_ms": [29.8, 6.2], "draft_step_rows": 6.9, "verify_scale": 1.2})
    assert o.draft_step_by_rows == [[1.0, 36.0], [6.9, pytest.approx(72.58)]] and o.verify_scale == 1.2
    assert o.propose_ms(None, 4.0, 3) == pytest.approx(3 * (29.8 + 6.2 * 4.0))
    unbounded = Overhead.from_dict({"draft_step_ms": [30.0, 5.0], "draft_step_rows": 0.0})
    assert unbounded.draft_step_by_rows == [[1.0, 35.0], [2.0, 40.0]]


def test_simulate_command_predicts_and_compares(tiny_profile, tmp_path, capsys):
    prof = tiny_profile.save(tmp_path / "p.json")
    out = tmp_path / "sim.json"
    assert main(["simulate", "--profile", str(prof), "--rate", "1", "--concurrency", "1", "--requests", "3",
                 "--max-tokens", "12", "--json", str(out)]) == 0  # fmt: skip
    text = capsys.readouterr().out
    assert "poisson 1.0/s" in text and "closed c=1" in text
    pred = json.loads(out.read_text())
    assert {(r["scenario"], r["mode"]) for r in pred["results"]} == {
        (s, m) for s in ("closed c=1", "poisson 1.0/s") for m in ("auto", "off")
    }
    # a bench serve result of the same scenarios: the comparison lines up each one
    bench = {"options": {"requests": 3, "max_tokens": 12, "modes": ["auto", "off"], "seed": 0},
             "results": [dict(r) for r in pred["results"]]}  # fmt: skip
    (tmp_path / "bench.json").write_text(json.dumps(bench))
    assert main(["simulate", "--profile", str(prof), "--compare", str(tmp_path / "bench.json")]) == 0
    text = capsys.readouterr().out
    assert "predicted vs measured" in text and "(+0%)" in text  # the same run, so no error
    assert main(["simulate", "--profile", str(tmp_path / "missing.json"), "--rate", "1"]) == 2
    assert "no such profile" in capsys.readouterr().err
    assert main(["simulate", "--profile", str(prof), "--rate", "1", "--jitter", "-0.1"]) == 2
    assert "--jitter must be in [0, 1]" in capsys.readouterr().err
    # a profile its budget cut short is named as such; a complete one is not
    assert "time budget" not in capsys.readouterr().err
    thin = dataclasses.replace(tiny_profile, skipped=[f"target prefill of {n} tokens" for n in (64, 128, 256, 512)])
    assert main(["simulate", "--profile", str(thin.save(tmp_path / "thin.json")), "--rate", "1", "--requests", "2",
                 "--max-tokens", "4"]) == 0  # fmt: skip
    err = capsys.readouterr().err
    assert "left out 4 part(s): target prefill of 64 tokens;" in err and "and 1 more" in err


def test_a_short_budget_gives_a_coarse_profile_of_every_part(tiny_paths, prompts_file):
    opts = ProfileOptions(
        dtype="float32",
        prompts=str(prompts_file),
        max_tokens=12,
        budget_s=2.0,
        threads=1,
        batches=(1, 2, 4, 8, 16),
        tokens=(1, 2, 4, 8, 16),
        draft_ks=(1, 2, 4, 8),
        context=16,
        prefill_lengths=(8, 16, 32, 64),
        repeat=40,
    )
    p = take_profile(str(tiny_paths["llama"]), str(tiny_paths["llama-draft"]), opts)
    assert p.skipped  # the budget left parts of the grids out ...
    assert p.target_forward.batch and p.target_prefill.tokens  # ... never a part the simulator needs
    assert all(stats.requests for stats in p.drafters.values()) and set(p.drafters) == {"draft", "ngram"}


def test_a_prediction_over_several_draws_is_the_mean_of_the_single_draws(tiny_profile):
    from cluster.config import PoolConfig, ServeConfig
    from cluster.planning.predict import Scenario, compare, format_comparison, predict_bench
    from router.config import RouterConfig

    worker = {"model": "tiny", "dtype": "float32", "num_slots": 4, "max_len": 256, "threads": 1}
    serve = ServeConfig(PoolConfig.from_dict(worker, "target"), None, RouterConfig(default_mode="ngram"))

    def run(seed: int, draws: int) -> dict:
        # closed loop: only the acceptance depends on the seed, not the arrivals
        return predict_bench(tiny_profile, serve, [Scenario("closed", 2)], 6, 12, ("auto",), seed, draws=draws)

    single = [run(seed, 1)["results"][0]["summary"] for seed in range(3)]
    pred = run(0, 3)
    mean = pred["results"][0]["summary"]
    for key in ("k_mean", "tau", "tpot_ms_p50", "throughput_tok_s"):
        assert mean[key] == pytest.approx(sum(s[key] for s in single) / 3, abs=1e-3), key
    assert len({s["k_mean"] for s in single}) > 1  # the draws differ: the mean is not one of them
    assert mean["split"]["rounds"] == pytest.approx(sum(s["split"]["rounds"] for s in single) / 3)
    # beside the mean, the draws' 10-90 % band; a run outside it is marked in the comparison
    lo, hi = pred["results"][0]["spread"]["k_mean"]
    ks = sorted(s["k_mean"] for s in single)
    assert ks[0] <= lo < hi <= ks[-1]
    inside, outside = dict(single[0], k_mean=(lo + hi) / 2), dict(single[0], k_mean=hi * 1.5)
    rows = [compare(pred, {"results": [{"scenario": "closed c=2", "mode": "auto", "summary": m}]})[0]
            for m in (inside, outside)]  # fmt: skip
    assert [r["k_mean"]["within_draws"] for r in rows] == [True, False]
    band = f"[{lo:.4g}-{hi:.4g}"
    assert f"{band} !]" in format_comparison(rows[1:]) and f"{band}]" in format_comparison(rows[:1])


def test_the_comparison_gives_a_measured_median_the_band_of_its_own_requests():
    """The AUTO run at 0.1/s of the protocol's seventh bf16 run: 8 requests of TPOT 46-268 ms, p50
    81.4 ms (the mean of 80 and 83). Had the run held other requests of the same kind, its p50
    would have been anywhere from 65 to 130 ms; a prediction of 102 ms (+26 %) lies within that."""
    from cluster.planning.predict import compare, format_comparison
    from specdec.bench.serve import summarize
    from specdec.bench.stats import bootstrap_band

    tpots = [46, 48, 65, 80, 83, 130, 145, 268]
    records = [{"t_start": 0.0, "t_first": 2.5, "t_last": 2.5 + 31 * t / 1e3, "tokens": 32} for t in tpots]
    measured = {"scenario": "poisson 0.1/s", "mode": "auto", "summary": summarize(records, 60.0), "records": records}
    assert measured["summary"]["tpot_ms_p50"] == pytest.approx(81.5)

    def predicted(tpot: float) -> dict:
        return {"results": [{"scenario": "poisson 0.1/s", "mode": "auto", "summary": {"tpot_ms_p50": tpot}}]}

    near, far = (
        compare(predicted(102.0), {"results": [measured]})[0],
        compare(predicted(300.0), {"results": [measured]})[0],
    )
    assert near["tpot_ms_p50"]["run_p10_p90"] == pytest.approx([65.0, 130.0], abs=0.5)
    assert near["tpot_ms_p50"]["within_run"] and not far["tpot_ms_p50"]["within_run"]
    assert "run [65-130]" in format_comparison([near]) and "run [65-130 !]" in format_comparison([far])
    assert "resamples of the run's requests" in format_comparison([near])
    # a result without its records (or of one request) has no band of its own
    bare = {"results": [dict(measured, records=[])]}
    assert "run_p10_p90" not in compare(predicted(102.0), bare)[0]["tpot_ms_p50"]
    assert bootstrap_band([1.0], lambda xs: xs[0]) is None
    assert bootstrap_band(tpots, lambda xs: sum(xs) / len(xs), seed=1) == bootstrap_band(
        tpots, lambda xs: sum(xs) / len(xs), seed=1
    )


def test_a_prediction_after_a_run_starts_from_the_router_that_run_left(tiny_profile):
    from cluster.config import PoolConfig, ServeConfig
    from cluster.planning.predict import Scenario, predict_bench
    from router.config import RouterConfig

    worker = {"model": "tiny", "dtype": "float32", "num_slots": 4, "max_len": 256, "threads": 1}
    pools = PoolConfig.from_dict(worker, "target"), PoolConfig.from_dict(worker | {"model": "tiny-draft"}, "draft")
    serve = ServeConfig(*pools, RouterConfig(default_mode="draft"))  # model drafts: priced by what the router measured
    first, then = [Scenario("closed", 2)], [Scenario("poisson", 2.0)]
    both = predict_bench(tiny_profile, serve, first + then, 6, 12, ("auto",), seed=3)["results"]
    # the earlier run as `specdec bench serve --json` writes it: its scenarios and options
    before = {"options": {"requests": 6, "max_tokens": 12, "modes": ["auto"], "seed": 3}, "results": both[:1]}
    after = predict_bench(tiny_profile, serve, then, 6, 12, ("auto",), seed=3, after=before)["results"]
    fresh = predict_bench(tiny_profile, serve, then, 6, 12, ("auto",), seed=3)["results"]
    assert after[0]["summary"] == both[1]["summary"]
    assert fresh[0]["summary"] != after[0]["summary"]  # a fresh router has learned nothing yet


def test_speculative_verifies_take_the_plain_scale_only_where_the_router_overlaps_drafting(tiny_profile):
    """On one device the service's speculative Verifies ran beside its drafter only where the router
    pipelines drafting (pre-drafts, micro-batches); with rounds alternating they ran alone, and the
    calibration's speculative scale is their own cost."""
    from cluster.config import PoolConfig, ServeConfig
    from cluster.planning.predict import _deployment
    from router.config import RouterConfig

    worker = {"model": "tiny", "dtype": "float32", "num_slots": 4, "max_len": 256, "threads": 1}
    pools = PoolConfig.from_dict(worker, "target"), PoolConfig.from_dict(worker | {"model": "tiny-draft"}, "draft")
    profile = dataclasses.replace(
        tiny_profile, overhead=Overhead(verify_scale_by_batch=[[1, 1.3]], verify_scale_plain_by_batch=[[1, 1.1]])
    )

    def verify_ms(colocated: bool, **router) -> float:
        serve = ServeConfig(*pools, RouterConfig(default_mode="draft", **router))
        return 1e3 * _deployment(profile, serve, "auto", colocated).costs.verify_s(1, 5, 100)

    forward = profile.target_forward.at(1, 5)
    assert verify_ms(True, micro_batches=1) == pytest.approx(1.3 * forward)  # alternating: its own scale
    assert verify_ms(True, micro_batches=1, predraft=True) == pytest.approx(1.1 * forward)
    assert verify_ms(True, micro_batches=2) == pytest.approx(1.1 * forward)
    assert verify_ms(False, micro_batches=2) == pytest.approx(1.3 * forward)  # devices of their own
    assert RouterConfig(micro_batches=1).pipelined is False and RouterConfig(micro_batches=2).pipelined
