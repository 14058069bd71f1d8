"""The side-by-side of bench/vs_vllm.sh (specdec/bench/peer.py): tokens/s, ratios and the lossless check.

The inputs are records as the runners write them: ``bench/vllm_side.py`` per vLLM configuration,
``specdec bench generate --json`` and ``specdec bench serve --json`` (only the fields they all
carry and the comparison reads; the rest of each file is passed through untouched). No vLLM here.
"""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path

import pytest

from specdec.bench.peer import compare, format_comparison

REPO = Path(__file__).resolve().parents[2]
PROMPTS = ("HumanEval/0", "HumanEval/1")
OUT = {"HumanEval/0": [11, 12, 13, 14, 15, 16], "HumanEval/1": [21, 22, 23, 24, 25, 26]}


def vllm_run(config: str, tok_s: dict[int, float], spec: dict | None = None) -> dict:
    """A bench/vllm_side.py result: one level per client count, every request's output."""
    speculative = None
    if config == "draft":
        speculative = {"method": "draft_model", "model": "/models/draft", "num_speculative_tokens": 4}
    elif config == "ngram":
        speculative = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    levels = []
    for c, v in tok_s.items():
        records = [
            {"id": pid, "token_ids": OUT[pid], "tokens": 6, "finish_reason": "length", "batch_s": 0.5}
            for pid in PROMPTS
        ]
        levels.append(
            {
                "clients": c,
                "requests": 2,
                "tokens": 12,
                "wall_s": round(12 / v, 4),
                "throughput_tok_s": v,
                "spec": spec,
                "records": records,
            }
        )
    return {"config": config, "speculative_config": speculative, "levels": levels, "versions": {"vllm": "0.32.0"}}


def generate_result(tok_s: dict[str, float]) -> dict:
    """`specdec bench generate --json`: per-configuration summary and one record per prompt and config."""
    records = [
        {
            "config": name,
            "prompt_index": i,
            "prompt_id": pid,
            "repeat": 0,
            "token_ids": OUT[pid],
            "finish_reason": "length",
        }
        for name in tok_s
        for i, pid in enumerate(PROMPTS)
    ]
    configs = {
        name: {"tok_s": v, "a": 0.8 if name != "specdec_target" else None, "tau": 2.5} for name, v in tok_s.items()
    }
    return {"configs": list(tok_s), "summary": {"configs": configs}, "records": records}


def serve_result(tok_s: dict[str, dict[int, float]]) -> dict:
    """`specdec bench serve --json`: one closed-loop result per (client count, mode), gRPC."""
    results = []
    for mode, per_c in tok_s.items():
        for c, v in per_c.items():
            records = [
                {"id": pid, "mode": mode, "api": "grpc", "token_ids": OUT[pid], "error": None} for pid in PROMPTS
            ]
            summary = {"throughput_tok_s": v, "acceptance": 0.7 if mode == "auto" else None, "tau": 2.2}
            results.append(
                {
                    "scenario": f"closed c={c}",
                    "kind": "closed",
                    "x": c,
                    "mode": mode,
                    "api": "grpc",
                    "summary": summary,
                    "records": records,
                }
            )
    return {"server": {"address": "127.0.0.1:1"}, "options": {"apis": ["grpc"]}, "results": results}


@pytest.fixture
def inputs() -> tuple[dict, dict, dict]:
    vllm = {
        "target": vllm_run("target", {1: 10.0, 2: 16.0}),
        "draft": vllm_run("draft", {1: 12.0, 2: 20.0}, {"acceptance": 0.6, "tau": 3.0}),
        "ngram": vllm_run("ngram", {1: 14.0, 2: 18.0}, {"acceptance": 0.5, "tau": 2.0}),
    }
    generate = generate_result({"specdec_target": 9.0, "specdec_draft_adaptive": 18.0, "specdec_ngram": 13.0})
    serve = serve_result({"off": {1: 8.0, 2: 15.0}, "auto": {1: 16.0, 2: 24.0}})
    return vllm, generate, serve


def test_ratios_against_vllm_target_and_its_best_speculative(inputs):
    cmp = compare(*inputs, clients=[1, 2])
    tok_s = {r["key"]: r["tok_s"] for r in cmp["rows"]}
    assert tok_s["vllm_ngram"] == {1: 14.0, 2: 18.0}
    assert tok_s["specdec_draft_adaptive"] == {1: 18.0, 2: None}  # the engine runs one client only
    ratios = cmp["ratios"]
    assert ratios["vs_vllm_target"]["specdec_draft_adaptive"] == {1: 1.8, 2: None}
    assert ratios["vs_vllm_target"]["service_off"] == {1: 0.8, 2: 0.938}
    assert ratios["vs_vllm_target"]["service_auto"] == {1: 1.6, 2: 1.5}
    # vLLM's best speculative configuration is picked per client count
    assert ratios["vllm_best_speculative"] == {1: "vllm_ngram", 2: "vllm_draft"}
    assert ratios["default_vs_vllm_best_speculative"]["specdec_draft_adaptive"] == {1: 1.286, 2: None}
    assert ratios["default_vs_vllm_best_speculative"]["service_auto"] == {1: 1.143, 2: 1.2}
    assert cmp["acceptance"]["vllm_draft"][2] == {"acceptance": 0.6, "tau": 3.0}


def test_lossless_when_every_speculative_output_equals_k0(inputs):
    cmp = compare(*inputs, clients=[1, 2])
    lossless = cmp["lossless"]
    assert lossless["all_equal"] is True
    assert (lossless["equal"], lossless["total"]) == (8, 8)  # 2 engine configs + 2 service levels, 2 prompts each
    assert [ch["name"] for ch in lossless["checks"]] == [
        "specdec engine default (draft, adaptive k) vs engine k 0",
        "specdec engine n-gram vs engine k 0",
        "service auto vs off, 1 client",
        "service auto vs off, 2 clients",
    ]
    text = format_comparison(cmp, "title")
    assert "every specdec speculative output equals specdec's k = 0 output: yes (8/8 requests)" in text
    assert "vLLM target-only vs specdec engine k 0: 4/4" in text


def test_a_mismatched_output_is_reported(inputs):
    vllm, generate, serve = copy.deepcopy(inputs)
    auto2 = next(r for r in serve["results"] if r["mode"] == "auto" and r["x"] == 2)
    auto2["records"][1]["token_ids"] = [21, 22, 23, 99, 25, 26]
    engine_ngram = next(r for r in generate["records"] if r["config"] == "specdec_ngram" and r["prompt_index"] == 0)
    engine_ngram["token_ids"] = OUT["HumanEval/0"][:4]  # stopped early
    cmp = compare(vllm, generate, serve, clients=[1, 2])
    lossless = cmp["lossless"]
    assert lossless["all_equal"] is False
    assert (lossless["equal"], lossless["total"]) == (6, 8)
    by_name = {ch["name"]: ch for ch in lossless["checks"]}
    assert by_name["service auto vs off, 2 clients"]["mismatches"] == [
        {"id": "HumanEval/1", "why": "differs at token 3 (6 tokens vs 6 at k = 0)"}
    ]
    assert by_name["specdec engine n-gram vs engine k 0"]["mismatches"] == [
        {"id": "HumanEval/0", "why": "differs at token 4 (4 tokens vs 6 at k = 0)"}
    ]
    text = format_comparison(cmp)
    assert "k = 0 output: NO (6/8 requests)" in text
    assert "HumanEval/1: differs at token 3" in text
    # speed figures stand apart from correctness
    assert cmp["ratios"]["vs_vllm_target"]["service_auto"] == {1: 1.6, 2: 1.5}


def test_a_failed_request_or_configuration_is_reported(inputs):
    vllm, generate, serve = copy.deepcopy(inputs)
    auto1 = next(r for r in serve["results"] if r["mode"] == "auto" and r["x"] == 1)
    auto1["records"][0].update(token_ids=[], error="DEADLINE_EXCEEDED: late")
    vllm["draft"] = {"config": "draft", "error": "exit 1: draft_model is not supported"}
    cmp = compare(vllm, generate, serve, clients=[1, 2])
    assert cmp["lossless"]["all_equal"] is False
    checks = {ch["name"]: ch for ch in cmp["lossless"]["checks"]}
    assert checks["service auto vs off, 1 client"]["mismatches"][0]["why"] == "error: DEADLINE_EXCEEDED: late"
    # without vLLM's draft run, its n-gram run is the best speculative one at every count
    assert cmp["ratios"]["vllm_best_speculative"] == {1: "vllm_ngram", 2: "vllm_ngram"}
    draft_row = next(line for line in format_comparison(cmp).splitlines() if line.startswith("vLLM + draft"))
    assert draft_row.split()[-2:] == ["failed", "failed"]


def test_one_side_only(inputs):
    vllm, generate, serve = inputs
    only_specdec = compare({}, generate, serve, clients=[1, 2])
    assert only_specdec["ratios"]["vs_vllm_target"]["service_auto"] == {1: None, 2: None}
    assert only_specdec["lossless"]["all_equal"] is True
    only_vllm = compare(vllm, None, None, clients=[1, 2])
    assert only_vllm["lossless"] == {"all_equal": False, "equal": 0, "total": 0, "checks": []}
    assert "no speculative specdec output to check" in format_comparison(only_vllm)


def test_the_driver_reprints_a_saved_run(inputs, tmp_path, capsys):
    """`bench/vs_vllm.sh --report RUN.json`: the table from the JSON a run wrote (ints as JSON keeps them)."""
    vllm, generate, serve = inputs
    meta = {
        "target": "t",
        "draft": "d",
        "dtype": "bfloat16",
        "prompts": "humaneval:2",
        "prompt_ids": list(PROMPTS),
        "requests": 2,
        "max_tokens": 6,
        "clients": [1, 2],
        "commit": "abc1234",
        "vllm_version": "0.32.0",
        "machine": {"cpus": 2},
    }
    run = {"meta": meta, "vllm": vllm, "specdec": {"generate": generate, "serve": serve}}
    path = tmp_path / "run.json"
    path.write_text(json.dumps(run))
    spec = importlib.util.spec_from_file_location("vs_vllm", REPO / "bench" / "vs_vllm.py")
    driver = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(driver)
    assert driver.main(["--report", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("specdec vs vLLM 0.32.0 (CPU, 2 cores): target t, draft d, bfloat16")
    assert "service auto (default)" in out and "yes (8/8 requests)" in out
