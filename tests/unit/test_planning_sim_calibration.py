"""The draft prefill's scale, fitted through the simulator (cluster/planning/sim_calibration.py): it
recovers the scale a run was made with, where the measured time over the profile's curve, which
counts the contention with the target's prefill twice, does not."""

from __future__ import annotations

import dataclasses
import json

import pytest
import yaml

from cluster.config import ServeConfig
from cluster.planning.predict import Scenario, predict_bench
from cluster.planning.profile import Curve, DrafterStats, Grid, Overhead, Profile, RequestRounds
from cluster.planning.sim_calibration import (
    PREFILLS,
    PROPOSES,
    calibrate_draft_prefill,
    draft_prefill_ms_per_token,
    timed_kinds,
)
from specdec.cli.main import main

LONG = 400  # tokens: two chunks of 128 go to the drafter's Prefill, the rest with the first Propose
SHORT = 160  # fits one round's budget (256): all of it goes with the first Propose


def _profile(draft_prefill_scale: float = 1.0, prompt: int = LONG) -> Profile:
    """Flat costs: a verify 100 ms, a draft step 10 ms, a prefill 1 ms a token on either model."""
    rounds = [[4, 4, 4, 8], [4, 4, 2, 3], [4, 4, 0, 2]]
    return Profile(
        machine={"host": "test"},
        device="cpu: test",
        target={"model": "t", "dtype": "float32"},
        target_forward=Grid([1, 64], [1, 16], [[100.0, 100.0], [100.0, 100.0]]),
        target_prefill=Curve([1, 1000], [1.0, 1000.0]),
        draft={"model": "d", "dtype": "float32"},
        draft_forward=Grid([1, 64], [1, 4], [[10.0, 10.0], [10.0, 10.0]]),
        draft_prefill=Curve([1, 1000], [1.0, 1000.0]),
        draft_propose=Grid([1, 64], [1, 16], [[10.0, 160.0], [10.0, 160.0]]),
        overhead=Overhead(
            router_ms=0.0, verify_rpc_ms=0.0, draft_rpc_ms=0.0, draft_prefill_scale=draft_prefill_scale, source="test"
        ),
        drafters={
            "draft": DrafterStats("draft", [RequestRounds(f"p{i}", prompt, 32, "length", rounds) for i in range(3)])
        },
        workload={"max_tokens": 32},
    )


CONFIG = """
target: {model: m, dtype: float32, num_slots: 4, max_len: 1024, threads: 1}
draft: {model: m, dtype: float32, num_slots: 4, max_len: 1024, threads: 1}
router: {k_policy: {k: 4}, micro_batches: 1, predraft: false, max_batched_tokens: 256, prefill_chunk: 128}
"""


def _serve() -> ServeConfig:
    return ServeConfig.from_dict(yaml.safe_load(CONFIG))


def _run(profile: Profile) -> dict:
    """A run of two closed-loop scenarios, as bench serve writes one (its options included)."""
    scenarios = [Scenario("closed", 1), Scenario("closed", 2)]
    run = predict_bench(profile, _serve(), scenarios, 4, 16, ("auto", "off"), seed=0, draws=2)
    return run | {"options": {"requests": 4, "max_tokens": 16, "modes": ["auto", "off"], "seed": 0}}


def test_the_fitted_scale_is_the_one_the_run_was_made_with_where_the_measured_over_the_curve_is_not():
    truth = _run(_profile(draft_prefill_scale=0.5))
    split = truth["results"][0]["summary"]["split"]
    assert split["draft_prefills"] and split["prefilling_proposes"]  # both ways of prefilling
    per_token = draft_prefill_ms_per_token(truth, _profile())
    assert per_token is not None
    naive = per_token / 1.0  # over the curve's 1 ms a token: the contention with the target included
    assert naive > 0.5 * 1.3  # the draft's Prefill shared the device with the target's prefill
    assert calibrate_draft_prefill(_profile(), _serve(), truth, draws=2) == pytest.approx(0.5, rel=0.05)


def test_a_prompt_that_fits_one_round_is_prefilled_by_its_first_propose_and_calibrates_the_same():
    truth = _run(_profile(draft_prefill_scale=0.5, prompt=SHORT))
    split = truth["results"][0]["summary"]["split"]
    assert "draft_prefills" not in split and split["prefilling_proposes"] > 0
    assert split["prefilling_propose_tokens"] == SHORT  # one request at c=1: its whole prompt
    # at c=2 too: the clients' first requests arrive a moment apart and the first round takes the
    # first alone, as the service's router does (at one instant both prompts were split in chunks)
    assert "draft_prefills" not in truth["results"][2]["summary"]["split"]
    scale = calibrate_draft_prefill(_profile(prompt=SHORT), _serve(), truth, draws=2)
    assert scale == pytest.approx(0.5, rel=0.05)


def test_only_the_ways_of_prefilling_the_service_timed_are_fitted():
    """A service that cached every prompt whole with its first Propose timed no Prefill: the
    simulation's Prefills (stretched by the target's prefill beside them) are left out of the fit."""
    truth = _run(_profile(draft_prefill_scale=0.5))
    for r in truth["results"]:
        for key in ("draft_prefills", "draft_prefill_compute_ms", "draft_prefill_tokens"):
            r["summary"]["split"].pop(key, None)
    assert timed_kinds(truth) == (PROPOSES,) and timed_kinds(_run(_profile())) == (PREFILLS, PROPOSES)
    assert calibrate_draft_prefill(_profile(), _serve(), truth, draws=2) == pytest.approx(0.5, rel=0.05)


def test_no_timed_draft_prefill_no_scale():
    run = _run(_profile())
    for r in run["results"]:
        split = r["summary"]["split"]
        for key in [k for k in split if "prefill" in k and k != "prefill_ms_per_round"]:
            split.pop(key)
    assert draft_prefill_ms_per_token(run, _profile()) is None
    assert calibrate_draft_prefill(_profile(), _serve(), run) is None
    assert (
        calibrate_draft_prefill(dataclasses.replace(_profile(), draft_prefill=None), _serve(), _run(_profile())) is None
    )


def test_profile_recalibrates_a_profile_by_a_run_without_measuring(tmp_path, capsys):
    prof, run, config = tmp_path / "p.json", tmp_path / "run.json", tmp_path / "serve.yaml"
    _profile().save(prof)
    run.write_text(json.dumps(_run(_profile(draft_prefill_scale=0.5))))
    config.write_text(CONFIG)
    out = tmp_path / "out.json"
    args = ["profile", "--recalibrate", str(prof), "--serve-json", str(run), "--config", str(config), "-o", str(out)]
    assert main(args) == 0
    again = Profile.load(out)
    # near the run's 0.5, not at it: the rest of the calibration (the target's prefill scale among
    # them) is read off the run too, and the contention moves with it
    assert 0.4 < again.overhead.draft_prefill_scale < 0.7
    assert f"draft prefill x {again.overhead.draft_prefill_scale:.2f}" in capsys.readouterr().out
    assert again.target_forward == _profile().target_forward  # nothing measured anew
    # the recalibrated profile predicts the run's draft prefill, and the comparison says so
    assert (
        main(["simulate", "--profile", str(out), "--compare", str(run), "--config", str(config), "--draws", "2"]) == 0
    )
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("the drafter's prefill per token"))
    assert abs(int(line.rsplit("(", 1)[1].rstrip("%)"))) <= 5, line
    assert main(["profile", "--recalibrate", str(prof), "-o", str(out)]) == 2  # no run to calibrate by
    assert "--serve-json" in capsys.readouterr().err
    assert main(["profile", "-o", str(out)]) == 2  # neither a model nor a profile
    assert "--target" in capsys.readouterr().err
