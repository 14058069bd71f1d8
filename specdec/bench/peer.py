"""specdec beside a peer engine (vLLM) in one run: the tokens/s, the ratios and the lossless check.

Reads what the runners of ``bench/vs_vllm.sh`` write, unchanged: ``specdec bench generate``'s result
(the engine at one client), ``specdec bench serve``'s result (the service, closed loops of 1..N
clients, modes ``off`` and ``auto``) and one ``bench/vllm_side.py`` result per vLLM configuration
(``target``, ``draft``, ``ngram``). Plain Python: no torch, no vLLM.

Ratios, per client count: every specdec configuration over vLLM target-only, and specdec's default
(the engine's draft model with adaptive k at one client, the service's ``auto`` at every count) over
vLLM's best speculative configuration at that count. The lossless check: every speculative output
of specdec equals specdec's own k = 0 output for the same prompt (docs/design.md, invariant 2): the
engine's draft and n-gram runs against its target-only run, the service's ``auto`` requests against
its ``off`` requests at the same client count. How often vLLM's outputs equal specdec's is reported
too, as context: two stacks' bf16 kernels may break near-ties differently.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["ENGINE_CONFIGS", "VLLM_CONFIGS", "compare", "format_comparison"]

VLLM_CONFIGS = ("target", "draft", "ngram")
# `specdec bench generate`'s configurations the comparison runs, and how the table names them
ENGINE_CONFIGS = {
    "specdec_target": "specdec engine target-only (k 0)",
    "specdec_draft_adaptive": "specdec engine default (draft, adaptive k)",
    "specdec_ngram": "specdec engine n-gram",
}
ENGINE_DEFAULT, ENGINE_K0 = "specdec_draft_adaptive", "specdec_target"
SERVICE_MODES = {"off": "specdec service off (k 0)", "auto": "specdec service auto (default)"}


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def _vllm_label(name: str, run: dict) -> str:
    spec = run.get("speculative_config") or {}
    if name == "draft":
        return f"vLLM + draft model (k {spec.get('num_speculative_tokens', '?')})"
    if name == "ngram":
        return (
            f"vLLM + n-gram (k {spec.get('num_speculative_tokens', '?')}, "
            f"lookup {spec.get('prompt_lookup_min', '?')}-{spec.get('prompt_lookup_max', '?')})"
        )
    return "vLLM target-only"


# ------------------------------------------------------------------------------------------- rows
def _vllm_rows(vllm: dict[str, dict], clients: Sequence[int]) -> list[dict]:
    rows = []
    for name in VLLM_CONFIGS:
        run = vllm.get(name)
        if run is None:
            continue
        levels = {lv["clients"]: lv for lv in run.get("levels", [])}
        rows.append(
            {
                "key": f"vllm_{name}",
                "label": _vllm_label(name, run),
                "stack": "vllm",
                "error": run.get("error"),
                "tok_s": {c: levels[c]["throughput_tok_s"] if c in levels else None for c in clients},
            }
        )
    return rows


def _engine_rows(generate: dict | None, clients: Sequence[int]) -> list[dict]:
    if generate is None:
        return []
    cfgs = generate.get("summary", {}).get("configs", {})
    return [
        {
            "key": name,
            "label": f"{label} (k {generate['meta']['k']})"
            if name == "specdec_ngram" and "meta" in generate
            else label,
            "stack": "specdec",
            "error": generate.get("error"),
            "tok_s": {c: (cfgs.get(name, {}).get("tok_s") if c == 1 else None) for c in clients},
        }
        for name, label in ENGINE_CONFIGS.items()
        if name in cfgs or generate.get("error")
    ]


def _service_results(serve: dict | None, mode: str) -> dict[int, dict]:
    """The service's closed-loop gRPC results of one mode, by client count."""
    if serve is None:
        return {}
    return {
        int(r["x"]): r
        for r in serve.get("results", [])
        if r["kind"] == "closed" and r["mode"] == mode and r.get("api", "grpc") == "grpc"
    }


def _service_rows(serve: dict | None, clients: Sequence[int]) -> list[dict]:
    if serve is None:
        return []
    rows = []
    for mode, label in SERVICE_MODES.items():
        by_c = _service_results(serve, mode)
        rows.append(
            {
                "key": f"service_{mode}",
                "label": label,
                "stack": "specdec",
                "error": serve.get("error"),
                "tok_s": {c: by_c[c]["summary"]["throughput_tok_s"] if c in by_c else None for c in clients},
            }
        )
    return rows


# ------------------------------------------------------------------------------------------- ratios
def _ratios(rows: list[dict], clients: Sequence[int]) -> dict:
    by_key = {r["key"]: r for r in rows}
    vt = by_key.get("vllm_target")
    vs_target = {
        r["key"]: {c: _ratio(r["tok_s"][c], vt["tok_s"][c] if vt else None) for c in clients}
        for r in rows
        if r["stack"] == "specdec"
    }
    best: dict[int, str | None] = {}
    for c in clients:
        spec = [(by_key[k]["tok_s"][c], k) for k in ("vllm_draft", "vllm_ngram") if k in by_key]
        spec = [(v, k) for v, k in spec if v is not None]
        best[c] = max(spec)[1] if spec else None
    default_vs_best = {}
    for key in (ENGINE_DEFAULT, "service_auto"):
        if key in by_key:
            default_vs_best[key] = {
                c: _ratio(by_key[key]["tok_s"][c], by_key[best[c]]["tok_s"][c] if best[c] else None) for c in clients
            }
    return {
        "vs_vllm_target": vs_target,
        "vllm_best_speculative": best,
        "default_vs_vllm_best_speculative": default_vs_best,
    }


# ------------------------------------------------------------------------------------------- outputs
def _check(name: str, outputs: Iterable[tuple[str, Any, str | None]], reference: dict[str, Any]) -> dict:
    """Each (prompt id, token ids, error) against the reference output of its prompt."""
    total, equal, mismatches = 0, 0, []
    for pid, ids, error in outputs:
        total += 1
        if error:
            mismatches.append({"id": pid, "why": f"error: {error}"})
        elif pid not in reference:
            mismatches.append({"id": pid, "why": "no k = 0 output for this prompt"})
        elif list(ids) != list(reference[pid]):
            mismatches.append({"id": pid, "why": _first_difference(reference[pid], ids)})
        else:
            equal += 1
    return {"name": name, "equal": equal, "total": total, "mismatches": mismatches}


def _first_difference(ref: Sequence[int], out: Sequence[int]) -> str:
    i = next((j for j, (a, b) in enumerate(zip(ref, out)) if a != b), min(len(ref), len(out)))
    return f"differs at token {i} ({len(out)} tokens vs {len(ref)} at k = 0)"


def _engine_outputs(generate: dict, config: str) -> list[tuple[str, Any, None]]:
    return [(r["prompt_id"], r["token_ids"], None) for r in generate.get("records", []) if r["config"] == config]


def _service_outputs(result: dict) -> list[tuple[str, Any, str | None]]:
    return [(r["id"], r["token_ids"], r.get("error")) for r in result.get("records", [])]


def _first_by_id(outputs: Iterable[tuple[str, Any, str | None]]) -> dict[str, Any]:
    ref: dict[str, Any] = {}
    for pid, ids, error in outputs:
        if not error and pid not in ref:
            ref[pid] = ids
    return ref


def _lossless(generate: dict | None, serve: dict | None, clients: Sequence[int]) -> dict:
    checks = []
    if generate is not None and generate.get("records"):
        k0 = _first_by_id(_engine_outputs(generate, ENGINE_K0))
        for name in (ENGINE_DEFAULT, "specdec_ngram"):
            outs = _engine_outputs(generate, name)
            if outs:
                checks.append(_check(f"{ENGINE_CONFIGS[name]} vs engine k 0", outs, k0))
    off, auto = _service_results(serve, "off"), _service_results(serve, "auto")
    for c in clients:
        if c in auto:
            ref = _first_by_id(_service_outputs(off[c])) if c in off else {}
            name = f"service auto vs off, {c} client{'s' if c > 1 else ''}"
            checks.append(_check(name, _service_outputs(auto[c]), ref))
    return {
        "all_equal": bool(checks) and all(ch["equal"] == ch["total"] and ch["total"] > 0 for ch in checks),
        "equal": sum(ch["equal"] for ch in checks),
        "total": sum(ch["total"] for ch in checks),
        "checks": checks,
    }


def _vllm_outputs(run: dict) -> list[tuple[str, Any, None]]:
    return [(r["id"], r["token_ids"], None) for lv in run.get("levels", []) for r in lv["records"]]


def _agreement(vllm: dict[str, dict], generate: dict | None) -> list[dict]:
    """Context, not a requirement: vLLM's speculative outputs against its own target-only ones, and
    vLLM's target-only outputs against specdec's engine at k = 0."""
    out = []
    target = vllm.get("target")
    if target and not target.get("error"):
        ref = _first_by_id(_vllm_outputs(target))
        for name in ("draft", "ngram"):
            run = vllm.get(name)
            if run and not run.get("error"):
                out.append(_check(f"{_vllm_label(name, run)} vs vLLM target-only", _vllm_outputs(run), ref))
        if generate is not None and generate.get("records"):
            k0 = _first_by_id(_engine_outputs(generate, ENGINE_K0))
            out.append(_check("vLLM target-only vs specdec engine k 0", _vllm_outputs(target), k0))
    return out


# ------------------------------------------------------------------------------------------- entry points
def compare(vllm: dict[str, dict], generate: dict | None, serve: dict | None, clients: Sequence[int]) -> dict:
    """Rows (tokens/s by client count), ratios, the lossless check and the agreement context.

    ``vllm``: configuration name -> a ``bench/vllm_side.py`` result (or ``{"error": ...}``);
    ``generate`` and ``serve``: the results of ``specdec bench generate`` and ``specdec bench serve``
    as their ``--json`` writes them (or ``{"error": ...}``), None where that side did not run.
    """
    clients = list(clients)
    rows = _vllm_rows(vllm, clients) + _engine_rows(generate, clients) + _service_rows(serve, clients)
    return {
        "clients": clients,
        "rows": rows,
        "ratios": _ratios(rows, clients),
        "lossless": _lossless(generate, serve, clients),
        "agreement": _agreement(vllm, generate),
        "acceptance": _acceptance(vllm, generate, serve, clients),
    }


def _acceptance(vllm: dict[str, dict], generate: dict | None, serve: dict | None, clients: Sequence[int]) -> dict:
    """Per-token acceptance and tokens per round, each stack as it counts them."""
    out: dict[str, dict] = {}
    for name in ("draft", "ngram"):
        for lv in (vllm.get(name) or {}).get("levels", []):
            if lv.get("spec"):
                out.setdefault(f"vllm_{name}", {})[lv["clients"]] = {
                    "acceptance": lv["spec"]["acceptance"],
                    "tau": lv["spec"]["tau"],
                }
    cfgs = (generate or {}).get("summary", {}).get("configs", {})
    for name in (ENGINE_DEFAULT, "specdec_ngram"):
        if name in cfgs:
            out[name] = {1: {"acceptance": cfgs[name].get("a"), "tau": cfgs[name].get("tau")}}
    for c, r in _service_results(serve, "auto").items():
        if c in clients:
            s = r["summary"]
            out.setdefault("service_auto", {})[c] = {"acceptance": s.get("acceptance"), "tau": s.get("tau")}
    return out


def _f(x: float | None, nd: int = 2) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def _table(header: list[str], body: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]
    return [
        "  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
        for row in [header, *body]
    ]


def format_comparison(cmp: dict, title: str = "") -> str:
    """The side-by-side table people read; the same figures as the JSON's ``comparison``."""
    clients = cmp["clients"]
    cols = [f"{c} client{'s' if c > 1 else ''}" for c in clients]
    labels = {r["key"]: r["label"] for r in cmp["rows"]}
    lines = [title] if title else []
    body = []
    for r in cmp["rows"]:
        cells = ["failed" if r.get("error") else _f(r["tok_s"][c]) for c in clients]
        body.append([r["label"], *cells])
    lines += _table(["tokens/s", *cols], body)
    ratios = cmp["ratios"]
    body = [[f"  {labels[k]}", *[_f(v[c]) for c in clients]] for k, v in ratios["vs_vllm_target"].items()]
    if body:
        lines += ["", *_table(["specdec / vLLM target-only", *cols], body)]
    best = ratios["vllm_best_speculative"]
    vs_best = ratios["default_vs_vllm_best_speculative"]
    body = [[f"  {labels[k]}", *[_f(v[c]) for c in clients]] for k, v in vs_best.items()]
    if body:
        names = [best[c].removeprefix("vllm_").replace("ngram", "n-gram") if best[c] else "-" for c in clients]
        body.append(["  (vLLM's best there)", *names])
        lines += ["", *_table(["specdec default / vLLM best speculative", *cols], body)]
    lines += ["", *_lossless_lines(cmp["lossless"])]
    if cmp["agreement"]:
        lines.append("equal outputs across stacks (context: bf16 kernels may break near-ties differently):")
        lines += [f"  {ch['name']}: {ch['equal']}/{ch['total']}" for ch in cmp["agreement"]]
    acc = [
        f"  {labels.get(k, k)}: "
        + ", ".join(f"{c} cl. a {_f(v['acceptance'])} tau {_f(v['tau'])}" for c, v in sorted(per_c.items()))
        for k, per_c in cmp["acceptance"].items()
    ]
    if acc:
        lines += ["acceptance per draft token (a) and tokens per round (tau), as each stack counts them:", *acc]
    return "\n".join(lines)


def _lossless_lines(lossless: dict) -> list[str]:
    if not lossless["checks"]:
        return ["lossless: no speculative specdec output to check"]
    verdict = "yes" if lossless["all_equal"] else "NO"
    lines = [
        f"every specdec speculative output equals specdec's k = 0 output: {verdict} "
        f"({lossless['equal']}/{lossless['total']} requests)"
    ]
    for ch in lossless["checks"]:
        lines.append(f"  {ch['name']}: {ch['equal']}/{ch['total']}")
        lines += [f"    {m['id']}: {m['why']}" for m in ch["mismatches"]]
    return lines
