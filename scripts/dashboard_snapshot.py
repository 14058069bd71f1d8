"""The Grafana dashboard as a still image, for where no Grafana runs (docs/results.md, Observability):
every panel of the dashboard JSON, with its own PromQL and legends, plotted from a Prometheus'
``/api/v1/query_range`` with matplotlib, one small multiple per panel, laid out and titled as the
dashboard lays them out.

    python scripts/dashboard_snapshot.py --prometheus http://127.0.0.1:9090 \\
        --dashboard k8s/specdec/files/dashboard.json --minutes 10 --out dashboard.png

``$__rate_interval`` (Grafana's window for ``rate()``) becomes ``--rate-interval``: Grafana takes
four scrape intervals at least, and a window holding a few scrapes keeps the curves readable.
Queries are read from the dashboard each time, never copied here, so the image always shows what
the dashboard shows (tests/unit/test_dashboard_snapshot.py). A query without data is drawn as
"no data" in its panel and named on stderr; the exit status is then 1 with ``--strict``.
"""

from __future__ import annotations

import argparse
import io
import json
import re
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # headless: a file, never a window
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)
from matplotlib.ticker import FuncFormatter, PercentFormatter  # noqa: E402

# query -> Prometheus' ``result``: a list of {"metric": {labels}, "values": [[t, "v"], ...]}
Fetch = Callable[[str], list[dict]]

_LEGEND_LABEL = re.compile(r"\{\{\s*(\w+)\s*\}\}")


def panels(dashboard: dict) -> list[dict]:
    """The dashboard's panels with queries, in reading order (row by row, left to right)."""
    found = [p for p in dashboard["panels"] if p.get("targets")]
    return sorted(found, key=lambda p: (p.get("gridPos", {}).get("y", 0), p.get("gridPos", {}).get("x", 0)))


def query_of(target: dict, rate_interval: str) -> str:
    return target["expr"].replace("$__rate_interval", rate_interval)


def legend(fmt: str | None, metric: dict) -> str:
    """A series' name as Grafana writes it: ``{{label}}`` replaced by the label's value."""
    if not fmt:
        return "{" + ", ".join(f'{k}="{v}"' for k, v in sorted(metric.items())) + "}"
    return _LEGEND_LABEL.sub(lambda m: metric.get(m.group(1), ""), fmt).strip() or fmt


def prometheus_fetch(url: str, start: float, end: float, step: float, timeout: float = 30.0) -> Fetch:
    """A :data:`Fetch` reading ``url``'s query_range API over [start, end]."""

    def fetch(query: str) -> list[dict]:
        params = urllib.parse.urlencode({"query": query, "start": start, "end": end, "step": step})
        with urllib.request.urlopen(f"{url.rstrip('/')}/api/v1/query_range?{params}", timeout=timeout) as resp:
            body = json.load(resp)
        if body.get("status") != "success":
            raise RuntimeError(f"{query}: {body.get('error', body)}")
        return body["data"]["result"]

    return fetch


def _seconds(v: float) -> str:
    """A duration as Grafana's ``s`` unit writes it: in µs, ms or s, whichever reads best."""
    if v == 0 or abs(v) >= 1:
        return f"{v:.3g} s"
    return f"{v * 1e3:.3g} ms" if abs(v) >= 1e-3 else f"{v * 1e6:.3g} µs"


def _axis_format(ax, unit: str | None) -> None:
    if unit == "percentunit":
        ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    elif unit == "s":
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: _seconds(v)))
    elif unit == "reqps":
        ax.set_ylabel("per second", fontsize=7)


def render(dashboard: dict, fetch: Fetch, rate_interval: str, start: float, title: str | None = None):
    """The figure (time in minutes from ``start``), and the queries that gave no series. Each line's
    ``gid`` is its query as sent, so what is drawn can be checked against the dashboard."""
    shown = panels(dashboard)
    cols = 2
    rows = (len(shown) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(12, 2.6 * rows), squeeze=False)
    empty: list[tuple[str, str]] = []
    for ax, panel in zip(axes.flat, shown):
        ax.set_title(panel["title"], fontsize=10, loc="left")
        for target in panel["targets"]:
            query = query_of(target, rate_interval)
            series = fetch(query)
            if not series:
                empty.append((panel["title"], query))
                ax.plot([], [], gid=query, label=f"{legend(target.get('legendFormat'), {})} (no data)")
                continue
            for s in series:
                points = [(float(t), float(v)) for t, v in s["values"] if v not in ("NaN", "+Inf", "-Inf")]
                xs = [(t - start) / 60 for t, _ in points]
                name = legend(target.get("legendFormat"), s["metric"])
                ax.plot(xs, [v for _, v in points], gid=query, lw=1.2, label=name)
        _axis_format(ax, panel.get("fieldConfig", {}).get("defaults", {}).get("unit"))
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        ax.set_xlabel("minutes", fontsize=7)
        ax.legend(fontsize=6, loc="best", frameon=False)
    for ax in axes.flat[len(shown) :]:
        ax.set_visible(False)
    fig.suptitle(title or dashboard.get("title", ""), fontsize=12)
    fig.tight_layout()
    return fig, empty


def save_png(fig, out: Path, dpi: int) -> None:
    """``fig`` as a PNG of 256 colours at most: a line plot needs no more, and the file stays small
    enough to keep in the repository (docs/results.md shows one)."""
    from PIL import Image  # matplotlib's own dependency

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    image = Image.open(buffer).convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT)
    image.save(out, format="PNG", optimize=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--prometheus", required=True, help="Prometheus' URL, e.g. http://127.0.0.1:9090")
    ap.add_argument("--dashboard", type=Path, default=Path("k8s/specdec/files/dashboard.json"))
    ap.add_argument("--out", type=Path, required=True, help="the image (PNG)")
    ap.add_argument("--minutes", type=float, default=10.0, help="the last N minutes (unless --start)")
    ap.add_argument("--start", type=float, help="unix seconds")
    ap.add_argument("--end", type=float, help="unix seconds (default: now)")
    ap.add_argument("--step", type=float, help="seconds between points (default: 200 points)")
    ap.add_argument("--rate-interval", default="1m", help="what $__rate_interval stands for")
    ap.add_argument("--title", help="the figure's title (default: the dashboard's)")
    ap.add_argument("--dpi", type=int, default=96)
    ap.add_argument("--strict", action="store_true", help="exit 1 when a query has no series")
    args = ap.parse_args(argv)

    end = args.end or time.time()
    start = args.start or end - 60 * args.minutes
    step = args.step or max(1.0, (end - start) / 200)
    dashboard = json.loads(args.dashboard.read_text())
    fig, empty = render(
        dashboard, prometheus_fetch(args.prometheus, start, end, step), args.rate_interval, start, args.title
    )
    save_png(fig, args.out, args.dpi)
    for panel, query in empty:
        print(f"no data: {panel}: {query}", file=sys.stderr)
    print(f"{args.out}: {len(panels(dashboard))} panels, {end - start:.0f} s at {step:.0f} s steps")
    return 1 if empty and args.strict else 0


if __name__ == "__main__":
    sys.exit(main())
