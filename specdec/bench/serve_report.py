"""`specdec bench serve`'s results side by side: the ratios against plain decoding and the engine,
the HTTP gateway's overhead against gRPC, and the table the CLI prints."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from specdec.bench.stats import percentile

__all__ = ["add_ratios", "add_engine_ratios", "add_gateway_overhead", "format_table"]


def add_ratios(results: list[dict], modes: Sequence[str]) -> None:
    base = {(r["api"], r["scenario"]): r["summary"] for r in results if r["mode"] == "off"}
    for r in results:
        off = base.get((r["api"], r["scenario"]))
        s = r["summary"]
        if off and r["mode"] not in ("off", "engine") and off.get("throughput_tok_s") and s.get("throughput_tok_s"):
            s["speedup_vs_off"] = round(s["throughput_tok_s"] / off["throughput_tok_s"], 3)
            if s.get("tpot_ms_p50") and off.get("tpot_ms_p50"):
                s["tpot_p50_ratio_vs_off"] = round(s["tpot_ms_p50"] / off["tpot_ms_p50"], 3)


def add_engine_ratios(results: list[dict]) -> None:
    """Service modes at closed c=1 against the engine's run in the same scenario."""
    eng = next((r for r in results if r["mode"] == "engine"), None)
    if eng is None:
        return
    es = eng["summary"]
    by_id = {e["id"]: e["token_ids"] for e in eng["records"] if not e.get("error")}
    # an HTTP stream carries no token ids (token_ids None): no agreement for it
    for r in results:
        if r["kind"] != "closed" or r["x"] != 1 or r["mode"] == "engine":
            continue
        s = r["summary"]
        if s.get("throughput_tok_s") and es.get("throughput_tok_s"):
            s["service_vs_engine"] = round(s["throughput_tok_s"] / es["throughput_tok_s"], 3)
        pairs = [
            (x["token_ids"], by_id[x["id"]])
            for x in r["records"]
            if x["id"] in by_id and not x.get("error") and x["token_ids"] is not None
        ]
        if pairs:
            s["agreement_with_engine"] = round(sum(a == b for a, b in pairs) / len(pairs), 3)


def add_gateway_overhead(results: list[dict]) -> None:
    """On each HTTP result with a gRPC one of the same scenario and mode: what the gateway added, the
    p50 latency difference per request and per streamed chunk (over the HTTP requests' p50 chunks)."""
    grpc_runs = {(r["scenario"], r["mode"]): r for r in results if r["api"] == "grpc"}
    for r in results:
        g = grpc_runs.get((r["scenario"], r["mode"]))
        if r["api"] != "http" or g is None:
            continue
        ok = [x for x in r["records"] if not x.get("error")]
        lat_http = percentile([x["t_end"] - x["t_start"] for x in ok], 50)
        lat_grpc = percentile([x["t_end"] - x["t_start"] for x in g["records"] if not x.get("error")], 50)
        chunks = percentile([len(x["t_chunks"]) for x in ok], 50)
        if lat_http is None or lat_grpc is None:
            continue
        per_request = 1000.0 * (lat_http - lat_grpc)
        one_client = (r["kind"], r["x"]) == ("closed", 1)
        s, gs = r["summary"], g["summary"]
        s["gateway"] = {
            "ms_per_request": round(per_request, 2),
            "ms_per_request_paired": _paired_ms(g["records"], r["records"]) if one_client else None,
            "chunks_p50": chunks,
            "ms_per_chunk": round(per_request / chunks, 3) if chunks else None,
            "ttft_ms_p50": None
            if s["ttft_ms_p50"] is None or gs["ttft_ms_p50"] is None
            else round(s["ttft_ms_p50"] - gs["ttft_ms_p50"], 2),
        }


def _paired_ms(base: list[dict], other: list[dict]) -> float | None:
    """At one client the requests run in prompt order (interleaved: the two APIs' requests of a prompt
    back to back): p50 of the per-prompt latency differences, which the prompts' own spread and the
    machine's drift move far less than the difference of the two p50s."""
    pairs = [(a, b) for a, b in zip(base, other) if a["id"] == b["id"] and not a.get("error") and not b.get("error")]
    if len(pairs) != len(base) or len(base) != len(other):
        return None
    d = percentile([(b["t_end"] - b["t_start"]) - (a["t_end"] - a["t_start"]) for a, b in pairs], 50)
    return None if d is None else round(1000.0 * d, 2)


def _gateway_cost_lines(results: list[dict]) -> list[str]:
    """The gateway's own work, timed inside it (its /metrics, specdec/bench/serve_http.py): the
    numbers to hold against the 5 ms per request and 1 ms per chunk targets."""
    runs = [r for r in results if r["summary"].get("gateway_cost")]
    if not runs:
        return []
    out = ["gateway's own work, measured inside it (ms, p50 / p99):"]
    groups: dict[int, list[dict]] = {}  # an interleaved run's modes share one measurement
    for r in runs:
        groups.setdefault(id(r["summary"]["gateway_cost"]), []).append(r)

    def f(x):
        return "-" if x is None else f"{x:.3f}"

    for group in groups.values():
        c = group[0]["summary"]["gateway_cost"]
        out.append(
            f"  {group[0]['scenario']} {'+'.join(r['mode'] for r in group)}: per request "
            f"{f(c['ms_per_request_p50'])} / {f(c['ms_per_request_p99'])} ({c['requests']} requests), "
            f"per chunk {f(c['ms_per_chunk_p50'])} / {f(c['ms_per_chunk_p99'])} ({c['chunks']} chunks)"
        )
    return out


def format_table(result: dict[str, Any]) -> str:
    info = result["server"]
    lines = [
        f"service {info['address']}: target {info['target']}, draft {info['draft']} ({info['dtype']}, {info['device']})"
    ]
    cols = [
        "scenario",
        "mode",
        "api",
        "req",
        "err",
        "tok/s",
        "vs off",
        "vs engine",
        "TTFT p50",
        "TTFT p99",
        "TPOT p50",
        "TPOT p99",
        "accept",
        "tau",
        "k",
        "c",
        "bound",
        "fail-open",
    ]
    rows = [cols]

    def f(x, nd=2):
        return "-" if x is None else (f"{x:.{nd}f}" if isinstance(x, float) else str(x))

    for r in result["results"]:
        s = r["summary"]
        split = s.get("split") or {}
        rows.append(
            [
                r["scenario"],
                r["mode"],
                f(r.get("api")),
                f(s["requests"]),
                f(s["errors"]),
                f(s["throughput_tok_s"]),
                f(s.get("speedup_vs_off")),
                f(s.get("service_vs_engine")),
                f(s["ttft_ms_p50"], 1),
                f(s["ttft_ms_p99"], 1),
                f(s["tpot_ms_p50"], 1),
                f(s["tpot_ms_p99"], 1),
                f(s["acceptance"]),
                f(s["tau"]),
                f(s.get("k_mean")),
                f(split.get("c")),
                f(s.get("bound_sequential")),
                f(s["fail_open_rounds"]),
            ]
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(cols))]
    for row in rows:
        lines.append("  ".join(c.rjust(w) if i > 2 else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))))
    lines.append(
        "(ms; tok/s = generated tokens / wall; tau, k = tokens and draft tokens per request-round; c = draft "
        "wait per draft step / verify time; bound = tau / (k c + 1), sequential)"
    )
    gateway = [r for r in result["results"] if r["summary"].get("gateway")]
    if gateway:
        lines.append("gateway overhead, HTTP - gRPC (p50 latency difference; per chunk: over the p50 streamed chunks):")
    for r in gateway:
        g = r["summary"]["gateway"]
        lines.append(
            f"  {r['scenario']} {r['mode']}: {g['ms_per_request']:+.1f} ms per request, "
            f"{f(g['ms_per_chunk'], 3)} ms per chunk ({f(g['chunks_p50'], 0)} chunks), "
            f"TTFT p50 {f(g['ttft_ms_p50'], 1)} ms"
            + (
                f"; paired by prompt {g['ms_per_request_paired']:+.1f} ms"
                if g["ms_per_request_paired"] is not None
                else ""
            )
        )
    lines += _gateway_cost_lines(result["results"])
    for r in result["results"]:
        api = f" {r['api']}" if r.get("api") and len(result["options"].get("apis") or ()) > 1 else ""
        split = r["summary"].get("split")
        if split:
            parts = [
                f"{k.replace('_ms_per_round', '')} {v:.1f}" for k, v in split.items() if k.endswith("_ms_per_round")
            ]
            extra = f", pre-draft hit rate {split['predraft_hit_rate']:.2f}" if "predraft_hit_rate" in split else ""
            lines.append(f"  {r['scenario']} {r['mode']}{api}: per round (ms): {', '.join(parts)}{extra}")
        if r["summary"].get("agreement_with_engine") is not None:
            lines.append(
                f"  {r['scenario']} {r['mode']}: greedy output equal to the engine's for "
                f"{r['summary']['agreement_with_engine']:.0%} of requests"
            )
        if r["summary"].get("first_error"):
            lines.append(f"  {r['scenario']} {r['mode']}{api}: first error: {r['summary']['first_error']}")
    return "\n".join(lines)
