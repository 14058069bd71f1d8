"""The load-sweep plot (specdec/bench/serve_plot.py) from a `specdec bench serve --json` result."""

from __future__ import annotations

import json

import pytest

from specdec.bench.serve_plot import load_series, plot_serve


def _result() -> dict:
    results = []
    for kind, xs in (("closed", (1, 2, 4)), ("poisson", (1.0, 2.0))):
        for x in xs:
            for mode, tput in (("auto", 10.0 * x), ("off", 6.0 * x)):
                summary = {"throughput_tok_s": tput, "tpot_ms_p50": 100.0 / x, "tpot_ms_p99": 150.0 / x}
                name = f"closed c={x}" if kind == "closed" else f"poisson {x}/s"
                results.append({"scenario": name, "kind": kind, "x": x, "mode": mode, "summary": summary})
    results.append({"scenario": "closed c=1", "kind": "closed", "x": 1, "mode": "engine", "summary": {}})
    server = {"target": "t", "draft": "d", "dtype": "bfloat16", "device": "cpu"}
    return {"server": server, "options": {"max_tokens": 64}, "results": results}


def test_series_per_kind_and_mode_sorted_by_load_without_the_engine():
    series = load_series(_result())
    assert set(series) == {("closed", "auto"), ("closed", "off"), ("poisson", "auto"), ("poisson", "off")}
    assert [x for x, _ in series[("closed", "auto")]] == [1.0, 2.0, 4.0]
    assert series[("poisson", "off")][1][1]["throughput_tok_s"] == 12.0


def test_the_cli_writes_a_png_next_to_the_json(tmp_path):
    from specdec.cli.main import main

    path = tmp_path / "sweep.json"
    path.write_text(json.dumps(_result()))
    assert main(["bench", "plot", str(path)]) == 0
    png = tmp_path / "sweep.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    # a result without load scenarios is refused with a message, not a trace
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"results": []}))
    assert main(["bench", "plot", str(empty)]) != 0
    with pytest.raises(ValueError, match="no closed-loop or Poisson"):
        plot_serve({"results": []}, tmp_path / "x.png")
