"""`specdec bench runner`: runner vs transformers timings and the tokens-per-forward sweep, on a tiny model."""

from __future__ import annotations

from specdec.bench.runner import bench_runner, format_sweep, format_table, forward_sweep


def test_bench_runner_times_every_case(tiny_paths):
    result = bench_runner(str(tiny_paths["llama"]), dtype="float32", context_len=16, repeat=2)
    assert [c["name"] for c in result["cases"]] == ["decode b=1", "decode b=8", "verify 5 tokens b=1"]
    assert all(c["runner_ms"] > 0 and c["transformers_ms"] > 0 and c["plain_ms"] > 0 for c in result["cases"])
    assert result["packed"] is True  # float32 packs wherever oneDNN is built in, as in torch's CPU wheels
    assert "verify 5 tokens b=1" in format_table(result) and "plain weights ms" in format_table(result)


def test_forward_sweep_reports_each_size_relative_to_the_first(tiny_paths):
    for as_draft in (False, True):
        result = forward_sweep(
            str(tiny_paths["llama"]), (1, 3, 9), dtype="float32", context_len=12, repeat=2, as_draft=as_draft
        )
        assert list(result["forward_ms"]) == ["1", "3", "9"] and result["as_draft"] is as_draft
        assert result["relative_to_one_token"]["1"] == 1.0
        assert all(v > 0 for v in result["forward_ms"].values())
        assert format_sweep(result).count("x") >= 3


def test_bench_runner_tp_puts_tp_n_beside_tp_1_with_the_all_reduce_share(tiny_paths):
    from specdec.bench.tp import bench_tp, format_tp_table

    result = bench_tp(
        str(tiny_paths["llama"]), 2, dtype="float32", context_len=16, repeat=2, threads=2, lm_heads=("replicated",)
    )
    assert (result["threads_total"], result["threads_per_rank"]) == (2, 1)
    assert [m["lm_head"] for m in result["modes"]] == ["replicated"]
    for mode in result["modes"]:
        assert [c["name"] for c in mode["cases"]] == ["decode b=1", "decode b=8", "verify 5 tokens b=1"]
        for c in mode["cases"]:
            assert c["tp1_ms"] > 0 and c["tpn_ms"] > 0 and 0 < c["comm_share"] < 1
    assert result["faster_lm_head"] == "replicated"
    assert "TP2 ms" in format_tp_table(result)


def test_prefill_times_one_forward_beside_chunks_invariant_and_fast(tiny_paths):
    from specdec.bench.runner import format_prefill, prefill_times

    result = prefill_times(str(tiny_paths["llama"]), (16, 7), dtype="float32", context_len=40)
    rows = [(r["invariant"], r["chunk"]) for r in result["rows"]]
    assert rows == [(True, 40), (True, 16), (True, 7), (False, 40), (False, 16), (False, 7)]
    assert all(r["seconds"] > 0 for r in result["rows"])
    # The invariant forward's promise: the chunks give the one forward's logits bit for bit.
    assert all(r["same_logits"] for r in result["rows"] if r["invariant"])
    table = format_prefill(result)
    assert table.count("bitwise") >= 3 and "1.00x" in table
    # A chunking that changed the logits is shown as such, not hidden in the table.
    result["rows"][1]["same_logits"] = False
    assert "differ" in format_prefill(result)
