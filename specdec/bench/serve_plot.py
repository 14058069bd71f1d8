"""A plot (PNG) of a `specdec bench serve` result: throughput and TPOT p50/p99 against the load, one
line per speculation mode (AUTO vs OFF), closed-loop clients and Poisson rates as separate series."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["load_series", "plot_serve"]

_KINDS = {"closed": ("o", "clients (closed loop)"), "poisson": ("s", "requests/s (Poisson)")}


def load_series(result: dict[str, Any]) -> dict[tuple[str, str], list[tuple[float, dict]]]:
    """{(kind, mode): [(load, summary), ...] sorted by load} from a bench serve result."""
    series: dict[tuple[str, str], list[tuple[float, dict]]] = {}
    for r in result.get("results", []):
        if r.get("mode") == "engine" or r.get("kind") not in _KINDS:
            continue
        series.setdefault((r["kind"], r["mode"]), []).append((float(r["x"]), r["summary"]))
    return {k: sorted(v, key=lambda p: p[0]) for k, v in series.items()}


def plot_serve(result: dict[str, Any], path: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import ScalarFormatter

    series = load_series(result)
    if not series:
        raise ValueError("the result has no closed-loop or Poisson scenarios to plot")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, (ax_t, ax_l) = plt.subplots(1, 2, figsize=(12, 4.6))
    colors = {}
    for (kind, mode), points in series.items():
        color = colors.setdefault(mode, f"C{len(colors)}")
        marker, unit = _KINDS[kind]
        xs = [x for x, _ in points]
        label = f"{mode.upper()}, {unit}"
        ax_t.plot(xs, [s.get("throughput_tok_s") for _, s in points], marker=marker, color=color, label=label)
        ax_l.plot(xs, [s.get("tpot_ms_p50") for _, s in points], marker=marker, color=color, label=f"{label} p50")
        ax_l.plot(
            xs, [s.get("tpot_ms_p99") for _, s in points], marker=marker, color=color, linestyle="--", label="p99"
        )
    for ax, ylabel in ((ax_t, "throughput (tokens/s)"), (ax_l, "time per output token (ms)")):
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.set_xlabel("load: concurrent clients, or arrival rate (requests/s)")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    info = result.get("server", {})
    opts = result.get("options", {})
    fig.suptitle(
        f"{info.get('target')} / {info.get('draft')} ({info.get('dtype')}, {info.get('device')}), "
        f"{opts.get('max_tokens')} tokens per request",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
