"""`specdec plan`: the catalog, the roofline costs, the deployment search, its answers to bad
questions, and the command (table, JSON, plots). Small workloads keep each search to seconds."""

from __future__ import annotations

import json

import pytest

from cluster.planning.catalog import CatalogError, load_catalog
from cluster.planning.costs import RooflineCosts, fits, memory_needed_gb
from cluster.planning.planner import SLO, Candidate, PlanError, PlanWorkload, SearchSpace, plan
from cluster.planning.workload import AcceptanceModel, parse_lengths
from specdec.cli.main import main


@pytest.fixture(scope="module")
def catalog():
    return load_catalog()


def workload(rate: float = 2.0, n: int = 40, a: float = 0.8) -> PlanWorkload:
    return PlanWorkload(rate, parse_lengths("256"), parse_lengths("64"), {"draft": [AcceptanceModel.iid(a)]}, n)


def test_catalog_has_sources_and_rejects_bad_files(catalog, tmp_path):
    assert {"H100-SXM", "A100-80GB", "L4"} <= set(catalog.devices)
    assert {"llama-3.1-70b", "llama-3.2-1b"} <= set(catalog.models)
    text = (catalog.source and open(catalog.source).read()) or ""
    assert "nvidia.com" in text and "price" in text  # every figure says where it comes from
    device = "memory_gb: 8, bandwidth_gbs: 1, bf16_tflops: 1, price_per_hour: 1"
    model = "{m: {params_b: 1, layers: 1, hidden: 8, heads: 1, kv_heads: 1, head_dim: 8, vocab: 8}}"
    (tmp_path / "c.yaml").write_text(f"devices: {{X: {{{device.replace('8', '-8', 1)}}}}}\nmodels: {model}\n")
    with pytest.raises(CatalogError, match="positive"):
        load_catalog(tmp_path / "c.yaml")
    (tmp_path / "d.yaml").write_text(f"devices: {{X: {{{device}, color: 3}}}}\nmodels: {model}\n")
    with pytest.raises(CatalogError, match="color"):
        load_catalog(tmp_path / "d.yaml")
    with pytest.raises(CatalogError, match="unknown device"):
        catalog.device("TPU")


def test_roofline_decode_is_memory_bound_and_prefill_compute_bound(catalog):
    m, h100 = catalog.model("llama-3.1-70b"), catalog.device("H100-SXM")
    c = RooflineCosts(m, h100, 4, None, None, catalog)
    eff = catalog.efficiency
    weights_s = m.weight_bytes / 4 / (h100.bandwidth_gbs * 1e9 * eff.memory_bandwidth)
    assert weights_s < c.verify_s(1, 1, 0) < weights_s * 1.3  # weights + launch and all-reduce overheads
    assert c.verify_s(8, 5, 1000) < 1.5 * c.verify_s(1, 1, 1000)  # a small verify costs about a decode step
    flops_s = 2 * m.params_b * 1e9 * 4096 / 4 / (h100.bf16_tflops * 1e12 * eff.compute)
    assert c.prefill_s(1, 4096) > flops_s  # a long prefill is compute-bound
    assert c.verify_s(1, 1, 0) < RooflineCosts(m, h100, 2, None, None, catalog).verify_s(1, 1, 0)
    assert m.tp_degrees(8) == [1, 2, 4, 8] and catalog.model("qwen2.5-coder-1.5b-instruct").tp_degrees(8) == [1, 2]
    assert not fits(m, h100, 1, 1, 4096) and not fits(m, h100, 2, 8, 4096) and fits(m, h100, 4, 8, 4096)
    assert memory_needed_gb(m, 4, 0, 0) == pytest.approx(1.1 * m.weight_bytes / 4 / 1e9)


def test_efficiencies_are_checked_and_an_override_moves_the_price(catalog, tmp_path):
    m, h100 = catalog.model("llama-3.1-70b"), catalog.device("H100-SXM")
    launch_bound = catalog.with_efficiency({"forward_overhead_ms_per_layer": 0.11})
    base = RooflineCosts(m, h100, 4, None, None, catalog).verify_s(1, 1, 0)
    slower = RooflineCosts(m, h100, 4, None, None, launch_bound).verify_s(1, 1, 0)
    assert slower - base == pytest.approx(m.layers * (0.11 - catalog.efficiency.forward_overhead_ms_per_layer) / 1e3)
    assert launch_bound.efficiency.memory_bandwidth == catalog.efficiency.memory_bandwidth  # the rest is kept
    assert catalog.efficiency.forward_overhead_ms_per_layer != 0.11  # the catalog itself is unchanged
    bad = {"launch_ms": 1.0}, {"compute": 1.5}, {"allreduce_latency_us": -1.0}, {"compute": "fast"}
    for values, match in zip(bad, ("unknown efficiency", r"\(0, 1\]", ">= 0", "a number"), strict=True):
        with pytest.raises(CatalogError, match=match):
            catalog.with_efficiency(values)
    device = "memory_gb: 8, bandwidth_gbs: 1, bf16_tflops: 1, price_per_hour: 1"
    model = "{m: {params_b: 1, layers: 1, hidden: 8, heads: 1, kv_heads: 1, head_dim: 8, vocab: 8}}"
    (tmp_path / "e.yaml").write_text(
        f"efficiency: {{memory_bandwidth: 70}}\ndevices: {{X: {{{device}}}}}\nmodels: {model}\n"
    )
    with pytest.raises(CatalogError, match="memory_bandwidth"):  # a percentage where a fraction belongs
        load_catalog(tmp_path / "e.yaml")


def test_plan_finds_the_cheapest_deployment_that_meets_the_objectives(catalog):
    space = SearchSpace(
        target_devices=["L4", "A100-80GB"], draft_devices=["colocated"], max_batches=(32,), runners_up=2
    )
    res = plan(catalog, "llama-3.1-8b", "llama-3.2-1b", workload(), SLO(ttft_p99_ms=3000, tpot_p99_ms=200), space)
    assert res.best is not None and res.best.ok and res.answer.startswith(res.best.candidate.label())
    ok = [e for e in res.evaluated if e.ok]
    assert res.best.cost_per_hour == min(e.cost_per_hour for e in ok)
    assert [e.cost_per_hour for e in res.runners_up] == sorted(e.cost_per_hour for e in res.runners_up)
    assert all(e.reasons for e in res.rejected)
    m = res.best.metrics
    assert m["tpot_ms_p99"] <= 200 and m["ttft_ms_p99"] <= 3000 and res.best.cost_per_mtok > 0
    d = res.to_dict()
    assert d["best"]["gpus"] and json.dumps(d)


def test_simulations_in_parallel_processes_give_the_same_plan(catalog):
    """--jobs runs candidates' simulations ahead of the search in forked processes: every
    evaluation (pruned ones included) and the answer are those of the one-process search."""
    space = SearchSpace(target_devices=["L4", "A100-80GB"], draft_devices=["colocated"], max_batches=(32,))
    slo = SLO(ttft_p99_ms=3000, tpot_p99_ms=200)
    one = plan(catalog, "llama-3.1-8b", "llama-3.2-1b", workload(n=20), slo, space, jobs=1)
    two = plan(catalog, "llama-3.1-8b", "llama-3.2-1b", workload(n=20), slo, space, jobs=2)
    assert two.to_dict() == one.to_dict() and one.question["simulations"] >= 2


def test_draft_replicas_follow_the_groups():
    c = Candidate("A100-80GB", 2, 1, "L4", 1, "adaptive", 32, draft_ratio=0.5)
    assert [c.with_groups(g).drafts for g in (1, 2, 3, 4)] == [1, 1, 2, 2]
    assert c.with_groups(3).gpus() == {"A100-80GB": 6, "L4": 2}
    assert Candidate("L4", 1, 1, None, 0, "off", 32).with_groups(5).drafts == 0


def test_plan_answers_questions_it_cannot_meet(catalog):
    space = SearchSpace(target_devices=["L4"], draft_devices=["colocated"], max_batches=(32,), max_groups=3)
    res = plan(catalog, "llama-3.1-8b", "llama-3.2-1b", workload(n=20), SLO(tpot_p99_ms=0.5), space)
    assert res.best is None and "no deployment in the search meets p99 TPOT <= 0.5 ms" in res.answer
    assert "TPOT" in res.answer  # and why the closest one failed
    big = plan(catalog, "llama-3.1-405b", None, workload(n=5), SLO(), SearchSpace(target_devices=["L4"]))
    assert big.best is None and "needs about" in big.answer
    with pytest.raises(PlanError, match="acceptance"):
        no_acceptance = PlanWorkload(1.0, parse_lengths("8"), parse_lengths("8"), {})
        plan(catalog, "llama-3.1-8b", "llama-3.2-1b", no_acceptance, SLO())
    with pytest.raises(CatalogError, match="unknown model"):
        plan(catalog, "gpt-9", None, workload(), SLO())


def test_plan_command_table_json_plots_and_bad_input(tmp_path, capsys):
    out, png = tmp_path / "plan.json", tmp_path / "p"
    args = ["plan", "--target", "llama-3.1-8b", "--draft", "llama-3.2-1b", "--rate", "2", "--prompt-tokens", "256",
            "--output-tokens", "64", "--acceptance", "0.8", "--tpot-p99-ms", "200", "--devices", "L4,A100-80GB",
            "--draft-devices", "colocated", "--max-batch", "32", "--requests", "30", "--runners-up", "1",
            "--efficiency", "forward_overhead_ms_per_layer=0.11", "--json", str(out), "--plot", str(png)]  # fmt: skip
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "answer:" in text and "best" in text and "$/Mtok" in text
    assert "(efficiency: memory bandwidth 0.7, compute 0.5, 0.11 ms per layer and forward" in text
    answer = json.loads(out.read_text())
    assert answer["best"]["ok"] and answer["question"]["efficiency"]["forward_overhead_ms_per_layer"] == 0.11
    assert (tmp_path / "p-latency.png").stat().st_size > 0 and (tmp_path / "p-frontier.png").stat().st_size > 0
    assert main(args[:-4] + ["--tpot-p99-ms", "0.5"]) == 1
    assert "no answer" in capsys.readouterr().out
    assert main(["plan", "--target", "llama-3.1-8b", "--rate", "1", "--devices", "TPU"]) == 2
    assert "unknown device" in capsys.readouterr().err
    for bad, says in (
        ("nope=1", "unknown efficiency"),
        ("compute", "expected KEY=NUMBER"),
        ("compute=x", "KEY=NUMBER"),
    ):
        assert main(["plan", "--target", "llama-3.1-8b", "--rate", "1", "--efficiency", bad]) == 2
        assert says in capsys.readouterr().err
    assert main(["plan", "--target", "llama-3.1-8b"]) == 2
