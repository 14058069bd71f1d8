"""`specdec bench generate` for people: a table and a plot of the summary."""

from __future__ import annotations

from pathlib import Path

from specdec.bench.config_names import (
    HF_ASSISTED_K,
    HF_TARGET,
    SPEC_DRAFT_K,
    SPEC_TARGET,
)

TABLE_COLUMNS = (
    ("config", None),
    ("tok/s", "tok_s"),
    ("ms/tok p50", "ms_per_token_p50"),
    ("p90", "ms_per_token_p90"),
    ("x hf_target", "speedup_vs_hf_target"),
    ("x hf_target med", "speedup_vs_hf_target_median"),
    ("x hf_assisted", "speedup_vs_hf_assisted"),
    ("x best hf_asst", "speedup_vs_best_hf_assisted"),
    ("x specdec_target", "speedup_vs_specdec_target"),
    ("tau", "tau"),
    ("k", "k_mean"),
    ("a", "a"),
    ("c", "c"),
    ("bound", "bound"),
    ("eff", "efficiency"),
    ("v", "verify_ratio"),
    ("eff v", "efficiency_measured_verify"),
    ("eff vs hf_target", "efficiency_vs_hf_target"),
    ("agree exact hf_target", "agreement_exact"),
    ("agree prefix hf_target", "agreement_prefix"),
    ("agree exact specdec_target", "agreement_exact_vs_specdec_target"),
    ("agree prefix specdec_target", "agreement_prefix_vs_specdec_target"),
)


def _cell(v) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 10 else f"{v:.1f}"
    return str(v)


def format_table(result: dict) -> str:
    """Markdown table, configurations as rows, with a header line saying what was run."""
    meta, summary = result["meta"], result["summary"]
    lines = [
        f"target {meta['target']}, draft {meta['draft']}, {meta['dtype']}, prompts {meta['prompts']} "
        f"({meta['requests_done']} requests x {len(result['configs'])} configs), max_tokens {meta['max_tokens']}, "
        f"{meta['machine']['torch_threads']} threads, {meta['wall_s']:.0f} s",
        "",
        "| " + " | ".join(h for h, _ in TABLE_COLUMNS) + " |",
        "|" + "|".join("---" if key is None else "---:" for _, key in TABLE_COLUMNS) + "|",
    ]
    for name, s in summary["configs"].items():
        cells = [name] + [_cell(s.get(key)) for _, key in TABLE_COLUMNS[1:]]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "bound = speedup(a, c, k) (Leviathan) relative to the same stack's target-only run "
        "(specdec_target for specdec_*, hf_target for hf_*); eff = measured speedup over that baseline / bound; "
        f"best hf_asst = {summary.get('best_hf_assisted')}; med = median over requests of the per-request "
        "ratio (robust to a burst of load on one request); ms/tok = request time / output tokens; "
        "c = drafter time per draft token / target decode step, both measured in the run; v = verify time "
        "per round / target decode step; eff v = measured speedup / (tau(a, k) / (k c + v)), the bound with "
        "the verify as measured. agree = share of requests (exact) and mean share of tokens before the first "
        "difference (prefix) equal to hf_target's output and, for specdec_*, to specdec_target's (k = 0): "
        "the lossless promise is the latter.",
    ]
    if meta.get("temperature", 0.0) > 0:
        lines.append(
            f"sampled at temperature {meta['temperature']} (rejection verification): outputs are draws, so agree "
            "is not expected to be 1 (tests/unit/test_tree_sampling.py and test_verify.py check the distribution)."
        )
    steps = summary.get("runner_steps")
    if steps:
        lines.append(
            f"runner decode step at {steps['context_tokens']} tokens of context: target "
            f"{steps['target_step_ms']} ms, draft {steps['draft_step_ms']} ms, model-only c = {steps['c']}."
        )
    return "\n".join(lines)


def plot(result: dict, path: str | Path) -> Path:
    """PNG: speedup vs hf_target per configuration (bars, bound ticks); speedup per k with the bound curve."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    sweep = result.get("sweep") or {}
    fig, axes = plt.subplots(1, 2 if sweep else 1, figsize=(13 if sweep else 8, 4.8), squeeze=False)
    _plot_configs(axes[0][0], result)
    if sweep:
        _plot_sweep(axes[0][1], sweep)
    meta = result["meta"]
    fig.suptitle(
        f"{meta['target']} / {meta['draft']} ({meta['dtype']}, {meta['prompts']}, "
        f"{meta['max_tokens']} tokens, {meta['machine']['torch_threads']} threads)",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plot_configs(ax, result: dict) -> None:
    cfgs = result["summary"]["configs"]
    names = list(cfgs)
    ref = HF_TARGET if HF_TARGET in cfgs else SPEC_TARGET  # the reference the bars are relative to
    vals = [cfgs[n][f"speedup_vs_{ref}"] or 0.0 for n in names]
    colors = ["tab:gray" if n.startswith("hf_") else "tab:blue" for n in names]
    ax.bar(range(len(names)), vals, color=colors)
    for i, n in enumerate(names):  # the bound, placed on the reference's scale through the stack's baseline
        base = cfgs.get(cfgs[n]["bound_baseline"], {})
        b, scale = cfgs[n]["bound"], base.get(f"speedup_vs_{ref}")
        if b is not None and scale and cfgs[n]["k_mean"]:
            ax.plot([i - 0.4, i + 0.4], [b * scale] * 2, color="black", lw=1.5)
        ax.text(i, vals[i], f"{vals[i]:.2f}", ha="center", va="bottom", fontsize=7)
        med = cfgs[n].get(f"speedup_vs_{ref}_median")
        if med is not None:
            ax.plot([i], [med], marker="o", color="orange", ms=4)
    ax.axhline(1.0, color="red", lw=0.8, ls="--")
    ax.set_xticks(range(len(names)), names, rotation=35, ha="right", fontsize=7)
    ax.set_ylabel(f"speedup vs {ref} (tok/s ratio)")
    ax.set_title(
        "per configuration: bars all tokens / all time, orange median per request, black Leviathan bound", fontsize=8
    )


def _plot_sweep(ax, sweep: dict) -> None:
    styles = {
        SPEC_DRAFT_K: ("tab:blue", "specdec (vs specdec_target)"),
        HF_ASSISTED_K: ("tab:gray", "transformers assisted (vs hf_target)"),
    }
    for fam, data in sweep.items():
        color, label = styles[fam]
        ax.plot(data["k"], data["speedup"], "o-", color=color, label=f"{label}, measured")
        if data["bound"] is not None:
            ax.plot(
                data["bound_k"], data["bound"], "--", color=color, label=f"bound a={data['a']:.2f} c={data['c']:.2f}"
            )
    ax.axhline(1.0, color="red", lw=0.8, ls="--")
    ax.set_xlabel("k (draft tokens per round)")
    ax.set_ylabel("speedup over the same stack's target-only")
    ax.set_title("per k", fontsize=9)
    ax.legend(fontsize=7)
