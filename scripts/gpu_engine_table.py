"""The table scripts/gpu_engine.py prints for people (its JSON has every figure)."""

from __future__ import annotations


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"
    return str(value)


def _grid(header: list[str], rows: list[list]) -> list[str]:
    cells = [header] + [[_cell(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in cells]


def _section(report: dict, name: str, title: str) -> tuple[dict | None, list[str]]:
    part = report.get(name)
    if part is None:
        return None, []
    if "error" in part:
        return None, [f"{title}: ERROR (traceback in the JSON)"]
    if "skipped" in part or "not run" in part:
        return None, [f"{title}: not run: {part.get('skipped') or part['not run']}"]
    return part, [title]


def _forwards(report: dict) -> list[str]:
    part, lines = _section(report, "forwards", "forwards, median ms per call")
    if part is None:
        return lines
    lines[0] += f" (context {part['context']}, copy bandwidth {part['copy bandwidth GB/s']} GB/s)"
    columns = {
        "roofline": "roofline, bytes / copy bandwidth",
        "catalog": "catalog roofline",
        "runner fast": "fast",
        "fast static": "fast static",
        "runner invariant": "invariant",
        "invariant static": "invariant static",
        "HF static eager": "transformers eager, static cache",
        "HF CUDA graph": "transformers CUDA graph replay",
    }
    for model, cases in part["models"].items():
        rows = [[case] + [row.get(key) for key in columns.values()] for case, row in cases.items()]
        lines += _grid([model, *columns], rows)
    for model, captured in part.get("captured", {}).items():
        lines.append(
            f"{model}: static steps captured {captured['graphs']} CUDA graphs (0: run eagerly) in "
            f"{captured['seconds']:.1f} s, {captured['bytes'] / 2**20:.0f} MiB"
        )
    return lines


def _e2e(report: dict) -> list[str]:
    part, lines = _section(report, "e2e", "engine end to end")
    if part is None:
        return lines
    lines[0] += f" (k = {part['k']}, {part['prompt tokens']}-token prompts, {part['max tokens']} tokens each)"
    header = ["b", "a set", "k=0 tok/s", "spec tok/s", "speedup", "a", "c", "bound", "efficiency", "identical"]
    rows = []
    for b, runs in part["batches"].items():
        if "not run" in runs:
            rows.append([b, None, "not run"] + [None] * 7)
            continue
        for name, run in runs.items():
            if "not run" in run:
                rows.append([b, name, "not run"] + [None] * 7)
            elif name != "k=0":
                row = [b, run["a set"], runs["k=0"]["tokens/s"], run["tokens/s"], run["speedup"], run["a measured"]]
                rows.append(row + [run["c"], run["bound tau/(kc+1)"], run["efficiency"], run["identical to k=0"]])
    return lines + _grid(header, rows)


def _service(report: dict) -> list[str]:
    part, lines = _section(report, "service", "service against engine, b = 1")
    if part is None:
        return lines
    header = ["run", "engine ms/round", "service ms/round", "overhead ms/round"]
    header += ["draft wait", "rpc", "router", "identical"]
    rows = []
    for name, r in part.items():
        if isinstance(r, dict) and "engine ms/round" in r:
            phases = r.get("router phases ms/round", {})
            row = [name, r["engine ms/round"], r["service ms/round"], r["overhead ms/round"]]
            rows.append(row + [phases.get(p) for p in ("draft_wait", "rpc", "router")] + [r["identical to engine k=0"]])
    skipped = ["workers apart: not run (the time budget)"] if "workers apart" in part else []
    return lines + _grid(header, rows) + skipped


def table(report: dict) -> str:
    lines = _forwards(report) + [""] + _e2e(report) + [""] + _service(report) + [""]
    failures = report.get("failures") or []
    lines.append("failures: " + ("none" if not failures else "\n  " + "\n  ".join(failures)))
    return "\n".join(lines)
