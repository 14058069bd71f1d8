"""Summaries of benchmark runs: per-configuration speed, acceptance, cost ratio, the bound and agreement."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

from specdec.bench.config_names import (
    HF_ASSISTED,
    HF_ASSISTED_K,
    HF_TARGET,
    SPEC_DRAFT_K,
    SPEC_TARGET,
    family,
    fixed_k,
)
from specdec.bench.records import Run
from specdec.bench.stats import percentile
from specdec.core.speedup import estimate_acceptance, expected_tokens, speedup


def _r(x: float | None, nd: int = 4) -> float | None:
    return None if x is None or (isinstance(x, float) and not math.isfinite(x)) else round(x, nd)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _prefix_match(ref: list[int], out: list[int]) -> float:
    n = max(len(ref), len(out))
    if n == 0:
        return 1.0
    i = 0
    while i < min(len(ref), len(out)) and ref[i] == out[i]:
        i += 1
    return i / n


def _per_position(runs: Sequence[Run]) -> list[float]:
    drafted: list[int] = []
    accepted: list[int] = []
    for run in runs:
        for n, k in run.accepted_per_round():
            for counts, m in ((drafted, k), (accepted, n)):
                counts.extend([0] * (m - len(counts)))
                for j in range(m):
                    counts[j] += 1
    accepted.extend([0] * (len(drafted) - len(accepted)))
    return [round(a / d, 4) for a, d in zip(accepted, drafted) if d]


def _step_ms(runs: Sequence[Run]) -> float | None:
    """Median duration of the decode rounds (first round, with the prefill, left out) of a k = 0 configuration."""
    times = [r.seconds for run in runs for r in run.rounds[1:]]
    return statistics.median(times) * 1e3 if times else None


def _aggregate(runs: Sequence[Run]) -> dict:
    tokens = sum(r.tokens for r in runs)
    seconds = sum(r.seconds for r in runs)
    rounds = [rd for r in runs for rd in r.rounds]
    later = [rd for r in runs for rd in r.rounds[1:]]
    pairs = [p for r in runs for p in r.accepted_per_round()]
    drafted_later = sum(rd.drafted for rd in later)
    ms_tok = [r.seconds * 1e3 / r.tokens for r in runs if r.tokens]
    has_drafts = any(rd.drafted for rd in rounds)
    return {
        "requests": len(runs),
        "tokens": tokens,
        "seconds": seconds,
        "tok_s": tokens / seconds if seconds else None,
        "ms_per_token_p50": percentile(ms_tok, 50),
        "ms_per_token_p90": percentile(ms_tok, 90),
        "rounds": len(rounds),
        "tau": tokens / len(rounds) if rounds else None,
        "k_mean": sum(rd.drafted for rd in rounds) / len(rounds) if rounds else 0.0,
        "a": estimate_acceptance([n for n, _ in pairs], [k for _, k in pairs]) if has_drafts else None,
        "acceptance_per_position": _per_position(runs) if has_drafts else [],
        "draft_ms_per_token": sum(rd.draft_s for rd in later) * 1e3 / drafted_later if drafted_later else None,
        "round_ms": statistics.mean(rd.seconds for rd in later) * 1e3 if later else None,
        "draft_ms_per_round": statistics.mean(rd.draft_s for rd in later) * 1e3 if later else None,
    }


def _agreement(runs: Sequence[Run], refs: dict[tuple[int, int], list[int]]) -> tuple[float | None, float | None]:
    pairs = [(refs[(r.prompt_index, r.repeat)], r.token_ids) for r in runs if (r.prompt_index, r.repeat) in refs]
    if not pairs:
        return None, None
    exact = sum(ref == out for ref, out in pairs) / len(pairs)
    prefix = statistics.mean(_prefix_match(ref, out) for ref, out in pairs)
    return exact, prefix


def _median_ratio(runs: Sequence[Run], base_runs: Sequence[Run]) -> float | None:
    """Median over requests of (tok/s of the request / tok/s of the baseline on the same prompt and pass).

    Less sensitive than the ratio of totals to a burst of load from other processes hitting one request.
    """
    base = {(r.prompt_index, r.repeat): r.tokens / r.seconds for r in base_runs if r.tokens and r.seconds}
    ratios = [
        (r.tokens / r.seconds) / base[(r.prompt_index, r.repeat)]
        for r in runs
        if r.tokens and r.seconds and (r.prompt_index, r.repeat) in base
    ]
    return statistics.median(ratios) if ratios else None


def summarize(runs: Sequence[Run], names: Sequence[str]) -> dict:
    by_name = {n: [r for r in runs if r.config == n] for n in names}
    agg = {n: _aggregate(rs) for n, rs in by_name.items() if rs}
    refs = {(r.prompt_index, r.repeat): r.token_ids for r in by_name.get(HF_TARGET, [])}
    # The lossless promise is to the service's own non-speculative output (specdec_target, k = 0);
    # transformers' greedy output is another attention kernel and may differ at bf16 near-ties.
    spec_refs = {(r.prompt_index, r.repeat): r.token_ids for r in by_name.get(SPEC_TARGET, [])}
    steps = {HF_TARGET: _step_ms(by_name.get(HF_TARGET, [])), SPEC_TARGET: _step_ms(by_name.get(SPEC_TARGET, []))}
    tok_s = {n: a["tok_s"] for n, a in agg.items()}
    hf_assisted = [n for n in agg if family(n) in (HF_ASSISTED, HF_ASSISTED_K)]
    best_hf = max(hf_assisted, key=lambda n: tok_s[n] or 0.0) if hf_assisted else None
    out = {}
    for name, a in agg.items():
        base = HF_TARGET if name.startswith("hf_") else SPEC_TARGET
        s = dict(a)
        s["family"], s["fixed_k"], s["bound_baseline"] = family(name), fixed_k(name), base
        s["speedup_vs_hf_target"] = _ratio(tok_s[name], tok_s.get(HF_TARGET))
        s["speedup_vs_hf_assisted"] = _ratio(tok_s[name], tok_s.get(HF_ASSISTED))
        s["speedup_vs_best_hf_assisted"] = _ratio(tok_s[name], tok_s.get(best_hf)) if best_hf else None
        s["speedup_vs_specdec_target"] = _ratio(tok_s[name], tok_s.get(SPEC_TARGET))
        s["speedup_vs_hf_target_median"] = _median_ratio(by_name[name], by_name.get(HF_TARGET, []))
        s["speedup_vs_hf_assisted_median"] = _median_ratio(by_name[name], by_name.get(HF_ASSISTED, []))
        s["speedup_vs_specdec_target_median"] = _median_ratio(by_name[name], by_name.get(SPEC_TARGET, []))
        s["target_step_ms"] = steps[base]
        s.update(_bound(s, steps[base], _ratio(tok_s[name], tok_s.get(base))))
        s["efficiency_vs_hf_target"] = _ratio(s["speedup_vs_hf_target"], s["bound"])
        s["agreement_exact"], s["agreement_prefix"] = _agreement(by_name[name], refs)
        spec = _agreement(by_name[name], spec_refs) if not name.startswith("hf_") else (None, None)
        s["agreement_exact_vs_specdec_target"], s["agreement_prefix_vs_specdec_target"] = spec
        out[name] = {k: (_r(v) if isinstance(v, float) else v) for k, v in s.items()}
    out_meta = {"best_hf_assisted": best_hf}
    return {"configs": out, **out_meta}


def _bound(s: dict, step_ms: float | None, measured: float | None) -> dict:
    """c, the verify-round cost, the Leviathan bound speedup(a, c, k_mean) and efficiency = measured / bound."""
    k = s["k_mean"]
    if not k:  # plain decoding: the bound is 1 by definition
        return {"c": None, "verify_ratio": None, "bound": 1.0, "efficiency": measured}
    c = _ratio(s["draft_ms_per_token"], step_ms)
    verify = _ratio(None if s["round_ms"] is None else s["round_ms"] - s["draft_ms_per_round"], step_ms)
    if s["a"] is None or c is None:
        return {"c": c, "verify_ratio": verify, "bound": None, "efficiency": None}
    bound = speedup(s["a"], c, k)
    # The same bound with the verify round as measured (it grows with k once compute-bound): what
    # is left between it and the measured speedup is prefill and per-round overhead.
    bound_v = expected_tokens(s["a"], k) / (k * c + verify) if verify else None
    return {
        "c": c,
        "verify_ratio": verify,
        "bound": bound,
        "efficiency": _ratio(measured, bound),
        "bound_measured_verify": bound_v,
        "efficiency_measured_verify": _ratio(measured, bound_v),
    }


def sweep_summary(summary: dict, names: Sequence[str]) -> dict | None:
    """Speedup per fixed k (specdec vs specdec_target, transformers vs hf_target) and the bound curve."""
    cfgs = summary["configs"]
    out = {}
    for fam, key in ((SPEC_DRAFT_K, "speedup_vs_specdec_target"), (HF_ASSISTED_K, "speedup_vs_hf_target")):
        rows = sorted((cfgs[n]["fixed_k"], n) for n in names if n in cfgs and family(n) == fam)
        if len(rows) < 2:
            continue
        a_vals = [cfgs[n]["a"] for _, n in rows if cfgs[n]["a"] is not None]
        c_vals = [cfgs[n]["c"] for _, n in rows if cfgs[n]["c"] is not None]
        a = statistics.mean(a_vals) if a_vals else None
        c = statistics.mean(c_vals) if c_vals else None
        k_max = max(k for k, _ in rows)
        out[fam] = {
            "k": [k for k, _ in rows],
            "speedup": [cfgs[n][key] for _, n in rows],
            "vs": key,
            "a": _r(a),
            "c": _r(c),
            "bound_k": list(range(0, k_max + 1)),
            "bound": [_r(speedup(a, c, k)) for k in range(0, k_max + 1)] if a is not None and c is not None else None,
            "best_k": max(rows, key=lambda kn: cfgs[kn[1]][key] or 0.0)[0],
        }
    return out or None
