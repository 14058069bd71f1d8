"""`specdec bench generate` on tiny models: every configuration, the JSON, the table, the plot, losslessness."""

from __future__ import annotations

import json

import pytest

from specdec.bench import generate as bg
from specdec.bench import records, report
from specdec.bench import summary as bench_summary
from specdec.bench.config_names import FAMILIES
from specdec.bench.stats import percentile
from specdec.cli.bench import FAMILIES as CLI_FAMILIES
from specdec.core.draft_options import DraftOptions
from specdec.core.prompts import PromptSetError, load_humaneval, load_prompts
from tests.conftest import skip_for_environment

PROMPTS = [
    {"prompt": "def add(a, b):\n    return", "chat": False},
    {"prompt": "The quick brown fox jumps over the lazy dog. The quick brown", "chat": False},
]
SUMMARY_FIELDS = (
    "tok_s",
    "ms_per_token_p50",
    "ms_per_token_p90",
    "speedup_vs_hf_target",
    "speedup_vs_hf_assisted",
    "speedup_vs_specdec_target",
    "tau",
    "k_mean",
    "a",
    "acceptance_per_position",
    "c",
    "bound",
    "efficiency",
    "efficiency_vs_hf_target",
    "agreement_exact",
    "agreement_prefix",
    "agreement_exact_vs_specdec_target",
    "agreement_prefix_vs_specdec_target",
    "bound_baseline",
)
SPEC_DRAFTING = ("specdec_draft_k2", "specdec_draft_k3", "specdec_draft_adaptive", "specdec_ngram", "specdec_default")


@pytest.fixture(scope="module")
def result(tiny_paths, tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    # specdec_default drafts token trees here (its draft options); the other draft configs chains.
    trees = DraftOptions(tree_width=2, tree_expand=1)
    options = bg.BenchOptions(max_tokens=8, dtype="float32", k=3, k_sweep=(2,), warmup=False, draft_options=trees)
    return bg.run_benchmark(str(tiny_paths["llama"]), str(tiny_paths["llama-draft"]), str(path), options)


def test_every_config_has_the_fields(result):
    names = result["configs"]
    assert names == [
        "hf_target",
        "hf_assisted",
        "hf_assisted_k2",
        "hf_assisted_k3",
        "specdec_target",
        "specdec_draft_k2",
        "specdec_draft_k3",
        "specdec_draft_adaptive",
        "specdec_ngram",
        "specdec_default",
    ]
    summary = result["summary"]["configs"]
    assert list(summary) == names
    for name in names:
        for f in SUMMARY_FIELDS:
            assert f in summary[name], (name, f)
        assert summary[name]["requests"] == 2
        assert summary[name]["tokens"] > 0 and summary[name]["tok_s"] > 0
    assert len(result["records"]) == 2 * len(names)
    assert json.loads(json.dumps(result)) == result  # plain JSON all the way down


def test_drafting_configs_measure_acceptance_cost_and_bound(result):
    summary = result["summary"]["configs"]
    for name in ("specdec_draft_k2", "specdec_draft_k3", "specdec_draft_adaptive", "hf_assisted_k3"):
        s = summary[name]
        assert 0.0 <= s["a"] <= 1.0, name
        assert s["c"] > 0 and s["bound"] > 0 and s["efficiency"] > 0, name
        assert s["acceptance_per_position"] and all(0 <= x <= 1 for x in s["acceptance_per_position"]), name
        assert s["tau"] >= 1.0, name
    assert summary["specdec_draft_k3"]["acceptance_per_position"].__len__() <= 3
    assert summary["hf_assisted_k3"]["k_mean"] <= 3
    assert summary["specdec_target"]["bound"] == 1.0 and summary["specdec_target"]["tau"] == 1.0
    assert summary["hf_target"]["tau"] == 1.0
    steps = result["summary"]["runner_steps"]  # model-only decode steps, next to the in-run c
    assert steps["target_step_ms"] > 0 and steps["draft_step_ms"] > 0 and steps["c"] > 0
    # the per-round accounting agrees with the engine's own RequestStats
    for rec in result["records"]:
        if rec["stats"] is not None:
            assert sum(rec["rounds"]["drafted"]) == rec["stats"]["drafted"]
            assert len(rec["rounds"]["drafted"]) == rec["stats"]["rounds"]
        assert sum(rec["rounds"]["committed"]) == rec["output_tokens"]


def test_specdec_is_lossless_against_transformers_in_float32(result):
    summary = result["summary"]["configs"]
    refs = {r["prompt_index"]: r["token_ids"] for r in result["records"] if r["config"] == "hf_target"}
    assert all(len(ids) == 8 for ids in refs.values())  # tiny models run to max_tokens: a real comparison
    for name in ("specdec_target",) + SPEC_DRAFTING:
        assert summary[name]["agreement_exact"] == 1.0, name
        assert summary[name]["agreement_prefix"] == 1.0, name
        assert summary[name]["agreement_exact_vs_specdec_target"] == 1.0, name
    assert summary["hf_assisted"]["agreement_exact_vs_specdec_target"] is None  # only specdec_* against k = 0
    # transformers' assisted generation is lossless too (greedy)
    assert summary["hf_assisted"]["agreement_exact"] == 1.0


def test_records_summarise_again(result):
    runs = [records.run_from_record(r) for r in result["records"]]
    again = bench_summary.summarize(runs, result["configs"])
    for name in result["configs"]:
        for key in ("tokens", "rounds", "a", "agreement_exact"):
            assert again["configs"][name][key] == result["summary"]["configs"][name][key], (name, key)
        # times are rounded to 10 us in the records
        assert again["configs"][name]["tok_s"] == pytest.approx(result["summary"]["configs"][name]["tok_s"], rel=1e-3)


def test_agreement_catches_a_wrong_output():
    def run(config, ids):
        return records.Run(config, 0, "p", 0, 3, 1.0, ids, "", "length", [records.Round(1.0, 4, 0, 0.0)])

    # specdec_target differs from transformers at token 3 (a bf16 near-tie); the speculative run
    # follows specdec_target up to token 2 and then goes wrong
    runs = [run("hf_target", [1, 2, 3, 4]), run("specdec_target", [1, 2, 3, 5]), run("specdec_ngram", [1, 2, 9, 5])]
    summary = bench_summary.summarize(runs, ["hf_target", "specdec_target", "specdec_ngram"])["configs"]
    assert summary["specdec_ngram"]["agreement_exact"] == 0.0
    assert summary["specdec_ngram"]["agreement_prefix"] == 0.5
    assert summary["specdec_ngram"]["agreement_exact_vs_specdec_target"] == 0.0
    assert summary["specdec_target"]["agreement_exact"] == 0.0
    assert summary["specdec_target"]["agreement_prefix"] == 0.75
    assert summary["specdec_target"]["agreement_exact_vs_specdec_target"] == 1.0


def test_table_and_plot(result, tmp_path):
    table = report.format_table(result)
    lines = table.splitlines()
    header = next(line for line in lines if line.startswith("| config"))
    rows = [line for line in lines if line.startswith("| ") and line is not header]
    assert len(rows) == len(result["configs"])
    assert "x hf_target" in header and "bound" in header and "agree exact" in header
    png = report.plot(result, tmp_path / "out" / "generate.png")
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    assert result["sweep"]["specdec_draft_k"]["k"] == [2, 3]
    assert len(result["sweep"]["specdec_draft_k"]["bound"]) == 4


def test_cli_writes_json_and_png(tiny_paths, tmp_path, capsys):
    from specdec.cli import main

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps(PROMPTS[0]) + "\n")
    out = tmp_path / "bench" / "generate.json"
    rc = main(
        [
            "bench",
            "generate",
            "--target",
            str(tiny_paths["llama"]),
            "--draft",
            str(tiny_paths["llama-draft"]),
            "--prompts",
            str(prompts),
            "--max-tokens",
            "4",
            "--dtype",
            "float32",
            "--no-warmup",
            "--configs",
            "hf_target,specdec_target,specdec_draft_k",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    assert json.loads(out.read_text())["configs"] == ["hf_target", "specdec_target", "specdec_draft_k4"]
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
    assert "| specdec_draft_k4 |" in capsys.readouterr().out


def test_cli_families_match():
    assert CLI_FAMILIES == FAMILIES


def test_humaneval_prompts():
    assert len(load_humaneval()) == 164
    three = load_prompts("humaneval:3")
    assert [p.id for p in three] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    assert all(p.chat and "def " in p.text and p.response_prefix == "" for p in three)
    assert len(load_prompts("humaneval")) == 164
    body = load_prompts("humaneval-body:2")
    assert len(body) == 2 and all(p.chat and p.response_prefix.startswith("```python\n") for p in body)
    assert all("def " in p.response_prefix for p in body)


def test_response_prefix_starts_the_assistant_turn(smollm_tokenizer_or_skip):
    from specdec.core.prompts import encode, encode_prompt

    tok = smollm_tokenizer_or_skip
    prompt = load_prompts("humaneval-body:1")[0]
    ids = encode(tok, prompt)
    plain = encode_prompt(tok, prompt.text, True)
    assert ids[: len(plain)] == plain and len(ids) > len(plain)
    assert tok.decode(ids[len(plain) :]).startswith("```python")


@pytest.fixture(scope="module")
def smollm_tokenizer_or_skip():
    from transformers import AutoTokenizer

    from specdec.core import packs

    if not packs.is_ready("smollm2-135m-instruct"):
        skip_for_environment("the smollm2-135m-instruct pack is not prepared (make test prepares it)")
    return AutoTokenizer.from_pretrained(packs.pack_dir("smollm2-135m-instruct"))


def test_prompt_files(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a", "response_prefix": "c"}\n\n{"prompt": "b", "chat": false, "id": "x"}\n')
    prompts = load_prompts(str(path))
    assert [(p.id, p.text, p.chat, p.response_prefix) for p in prompts] == [
        ("p/0", "a", None, "c"),
        ("x", "b", False, ""),
    ]
    assert len(load_prompts(f"{path}:1")) == 1
    path.write_text('{"text": "a"}\n')
    with pytest.raises(PromptSetError, match="prompt"):
        load_prompts(str(path))
    with pytest.raises(PromptSetError, match="no such"):
        load_prompts(str(tmp_path / "missing.jsonl"))
    with pytest.raises(PromptSetError):
        load_prompts("humaneval:0")


def test_unknown_config_is_refused():
    with pytest.raises(bg.BenchError, match="unknown"):
        bg.run_benchmark("unused", None, [], bg.BenchOptions(configs=("nope",)))


def test_percentile():
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([0.0, 10.0], 90) == pytest.approx(9.0)


def test_sampling_runs_specdec_configurations_only(tiny_paths, tmp_path):
    with pytest.raises(bg.BenchError, match="hf_target"):
        bg.run_benchmark("unused", None, [], bg.BenchOptions(temperature=0.8, configs=("hf_target", "specdec_target")))
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    trees = DraftOptions(tree_width=2, tree_expand=1)
    options = bg.BenchOptions(
        max_tokens=8,
        dtype="float32",
        configs=("specdec_target", "specdec_default"),
        warmup=False,
        draft_options=trees,
        temperature=1.0,
        step_repeat=0,
    )
    out = bg.run_benchmark(str(tiny_paths["llama"]), str(tiny_paths["llama-draft"]), str(path), options)
    assert out["meta"]["temperature"] == 1.0
    default = out["summary"]["configs"]["specdec_default"]
    assert default["tok_s"] > 0 and default["tau"] >= 1.0
    assert "sampled at temperature 1.0" in report.format_table(out)
