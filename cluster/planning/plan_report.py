"""What `specdec plan` prints and draws: the answer, a table of the best deployments, why the
others were rejected; latency against arrival rate per deployment, and cost against the TPOT
objective (the cheapest deployment that meets each p99 TPOT bound, among those simulated)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from cluster.planning.planner import Evaluation, PlanResult

__all__ = ["format_plan", "plot_latency_vs_rate", "plot_cost_frontier", "frontier"]


def _f(x: Any, fmt: str = ".0f") -> str:
    return "-" if x is None else format(x, fmt)


def _row(rank: str, e: Evaluation) -> list[str]:
    m = e.metrics
    util = m.get("utilization") or {}
    busy = "/".join(f"{100 * v:.0f}" for v in util.values()) or "-"
    return [
        rank,
        e.candidate.label(),
        f"{e.cost_per_hour:.2f}",
        _f(e.cost_per_mtok, ".3f"),
        _f(m.get("throughput_tok_s")),
        _f(m.get("ttft_ms_p50")),
        _f(m.get("ttft_ms_p99")),
        _f(m.get("tpot_ms_p50"), ".1f"),
        _f(m.get("tpot_ms_p99"), ".1f"),
        busy,
        _f(m.get("mean_batch"), ".1f"),
        _f(m.get("k_mean"), ".1f"),
    ]


def _table(rows: list[list[str]]) -> list[str]:
    head = [
        "#",
        "deployment",
        "$/h",
        "$/Mtok",
        "tok/s",
        "TTFT p50",
        "p99",
        "TPOT p50",
        "p99",
        "busy % (target/draft)",
        "batch",
        "k",
    ]
    rows = [head] + rows
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return ["  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]


_KINDS = ("p99 TTFT", "p99 TPOT", "falls behind", "throughput", "does not fit", "not simulated", "more groups")


def _kind(reason: str) -> str:
    return next((k for k in _KINDS if reason.startswith(k)), "other")


def format_plan(result: PlanResult, rejected_shown: int = 8) -> str:
    q = result.question
    slo = q["slo"]
    objectives = [
        f"p99 TTFT <= {slo['ttft_p99_ms']:g} ms" if slo.get("ttft_p99_ms") else None,
        f"p99 TPOT <= {slo['tpot_p99_ms']:g} ms" if slo.get("tpot_p99_ms") else None,
        f"throughput >= {slo['min_throughput_tok_s']:g} tok/s" if slo.get("min_throughput_tok_s") else None,
    ]
    lines = [
        f"target {q['target']}, draft {q['draft'] or 'none'}; {q['rate']:g} requests/s, prompts ~"
        f"{q['prompt_tokens_mean']:.0f} tokens, outputs ~{q['output_tokens_mean']:.0f}; objectives: "
        + (", ".join(o for o in objectives if o) or "keep up with the arrivals"),
        f"catalog {_shown_path(q['catalog'])}{_efficiency(q.get('efficiency'))}; "
        f"{q.get('simulations', 0)} simulations of {q['requests']} requests",
        "",
        ("answer: " if result.best else "no answer: ") + result.answer,
    ]
    shown = ([result.best] if result.best else []) + result.runners_up
    if shown:
        lines.append("")
        rows = [_row("best" if i == 0 and result.best else str(i + 1), e) for i, e in enumerate(shown)]
        lines += _table(rows)
        lines.append(
            "(ms; $/Mtok: price per million output tokens at the offered rate; busy: fraction of the time the pool "
            "computed; batch: requests per round; k: draft tokens per request-round)"
        )
    if result.rejected:
        lines += ["", f"rejected ({len(result.rejected)}):"]
        kinds = Counter(_kind(r) for e in result.rejected for r in e.reasons)
        lines.append("  " + ", ".join(f"{k}: {n}" for k, n in kinds.most_common()))
        simulated = [e for e in result.rejected if e.metrics]
        simulated.sort(key=lambda e: e.cost_per_hour)
        for e in simulated[:rejected_shown]:
            lines.append(f"  ${e.cost_per_hour:7.2f}/h  {e.candidate.label()}: {'; '.join(e.reasons)}")
        others = [e for e in result.rejected if not e.metrics]
        for e in others[: max(0, rejected_shown - len(simulated[:rejected_shown]))]:
            lines.append(f"  {e.candidate.label()}: {'; '.join(e.reasons)}")
    return "\n".join(lines)


def _meets_all_but_tpot(e: Evaluation, slo: dict[str, Any]) -> bool:
    m = e.metrics
    if not m.get("tpot_ms_p99") or m.get("unfinished") or m.get("rejected"):
        return False
    if slo.get("ttft_p99_ms") and (m.get("ttft_ms_p99") or 0) > slo["ttft_p99_ms"]:
        return False
    return not (slo.get("min_throughput_tok_s") and (m.get("throughput_tok_s") or 0) < slo["min_throughput_tok_s"])


def frontier(evaluated: list[Evaluation], slo: dict[str, Any]) -> list[tuple[float, float, str]]:
    """(p99 TPOT, $/h, deployment): the cheapest simulated deployment that keeps up, meets the other
    objectives and each TPOT bound, as the bound loosens."""
    points = sorted(
        (e.metrics["tpot_ms_p99"], e.cost_per_hour, e.candidate.label())
        for e in evaluated
        if _meets_all_but_tpot(e, slo)
    )
    out: list[tuple[float, float, str]] = []
    for tpot, cost, label in points:
        if not out or cost < out[-1][1]:
            out.append((tpot, cost, label))
    return out


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_latency_vs_rate(curves: dict[str, list[dict[str, Any]]], path: str | Path, slo: dict[str, Any]) -> Path:
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for label, points in curves.items():
        rates = [p["rate"] for p in points]
        axes[0].plot(rates, [p["tpot_ms_p99"] for p in points], marker="o", label=label)
        axes[1].plot(rates, [p["ttft_ms_p99"] for p in points], marker="o", label=label)
    for ax, key, name in ((axes[0], "tpot_p99_ms", "p99 TPOT (ms)"), (axes[1], "ttft_p99_ms", "p99 TTFT (ms)")):
        if slo.get(key):
            ax.axhline(slo[key], color="grey", linestyle="--", label="objective")
        ax.set_xlabel("arrival rate (requests/s)")
        ax.set_ylabel(name)
        ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle("Predicted latency against arrival rate (specdec plan)")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_cost_frontier(evaluated: list[Evaluation], path: str | Path, slo: dict[str, Any]) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    pts = [(e.metrics["tpot_ms_p99"], e.cost_per_hour) for e in evaluated if e.metrics.get("tpot_ms_p99")]
    if pts:
        ax.scatter(*zip(*pts), s=10, color="lightgrey", label="simulated deployments (any)")
    front = frontier(evaluated, slo)
    if front:
        xs, ys = [p[0] for p in front], [p[1] for p in front]
        ax.step(xs, ys, where="post", marker="o", label="cheapest meeting the bound and the other objectives")
    if slo.get("tpot_p99_ms"):
        ax.axvline(slo["tpot_p99_ms"], color="grey", linestyle="--", label="objective")
    ax.set_xlabel("p99 TPOT bound (ms)")
    ax.set_ylabel("cost ($/h)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("Cost against the TPOT objective (specdec plan)")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _efficiency(e: dict | None) -> str:
    """The roofline's assumptions, which move the answer (docs/results.md, "On a GPU": the measured overheads)."""
    if not e:
        return ""
    return (
        f" (efficiency: memory bandwidth {e['memory_bandwidth']:g}, compute {e['compute']:g}, "
        f"{e['forward_overhead_ms_per_layer']:g} ms per layer and forward, all-reduce {e['allreduce_latency_us']:g} us)"
    )


def _shown_path(path: str) -> str:
    """A path under the working directory as a relative one (the default catalog's, shortened)."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd()))
    except ValueError:
        return path
