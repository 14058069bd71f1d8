"""Where a `specdec bench serve` scenario's round time went, from the router's ``/metrics``
scraped before and after it: draft wait, verify, RPC and router time per round, draft tokens per
round, pre-draft hits, the draft worker's compute per Propose (and the rest of its wall: RPC) with
that Propose's rows and steps, its compute per Prefill and per Propose that also prefills with
their tokens, and c (draft time per token / verify time) with the sequential bound."""

from __future__ import annotations

import urllib.request
from typing import Any

__all__ = ["scrape", "parse_metrics", "phase_split", "sum_splits", "add_cost"]


def scrape(url: str | None) -> dict[str, float] | None:
    if not url:
        return None
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            text = resp.read().decode()
    except Exception:  # noqa: BLE001 - the split is optional
        return None
    return parse_metrics(text)


def parse_metrics(text: str) -> dict[str, float]:
    """The series the split reads, from a Prometheus text exposition (the router's ``/metrics``;
    the capacity simulator passes its router's registry)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.startswith("specdec_round_phase_seconds_") and s.name.endswith(("_sum", "_count")):
                out[f"{s.name.rsplit('_', 1)[1]}:{s.labels.get('phase')}"] = s.value
            elif s.name in (
                "specdec_rounds_total",
                "specdec_drafted_tokens_total",
                "specdec_accepted_tokens_total",
                "specdec_predraft_total",
                "specdec_fail_open_rounds_total",
                "specdec_propose_compute_seconds_sum",
                "specdec_propose_compute_seconds_count",
                "specdec_propose_rpc_seconds_sum",
                "specdec_propose_rows_total",
                "specdec_propose_steps_total",
                "specdec_draft_prefill_compute_seconds_sum",
                "specdec_draft_prefill_compute_seconds_count",
                "specdec_draft_prefill_tokens_total",
                "specdec_prefilling_propose_compute_seconds_sum",
                "specdec_prefilling_propose_compute_seconds_count",
                "specdec_prefilling_propose_tokens_total",
                "specdec_prefilling_propose_rows_total",
                "specdec_prefilling_propose_steps_total",
            ):
                key = s.name + ("".join(f":{v}" for v in s.labels.values()))
                out[key] = out.get(key, 0.0) + s.value
    return out


def phase_split(before: dict | None, after: dict | None) -> dict[str, Any] | None:
    """The split of the scheduler's rounds between two scrapes. Its ``rounds`` are batch rounds
    (one Verify for every request in the batch), and every ``*_per_round`` and
    ``drafted_per_round`` figure is per batch round; ``verify_ms_per_round`` per round that only
    verified (one whose Verify cached prompt chunks counts as prefill). A summary's own ``rounds`` count
    request-rounds, so their ratio is the mean batch (cluster/planning/calibration.py reads it so)."""
    if before is None or after is None:
        return None

    def d(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    rounds = d("count:round")
    if rounds <= 0:
        return None
    split = {"rounds": int(rounds)}
    for phase in ("draft_wait", "verify", "rpc", "prefill", "router", "round"):
        if f"sum:{phase}" in after:
            # A round whose Verify also cached prompt chunks is timed as prefill, not verify (router/
            # scheduler.py): the verify phase is the mean of the rounds that only verified.
            per = max(d("count:verify"), 1.0) if phase == "verify" and "count:verify" in after else rounds
            split[f"{phase}_ms_per_round"] = round(1000.0 * d(f"sum:{phase}") / per, 3)
    split["drafted_per_round"] = round(d("specdec_drafted_tokens_total") / rounds, 3)
    proposes = d("specdec_propose_compute_seconds_count")
    if proposes > 0:  # the draft worker's compute per timed Propose, and that Propose's size
        split["proposes"] = int(proposes)
        split["propose_compute_ms"] = round(1000.0 * d("specdec_propose_compute_seconds_sum") / proposes, 3)
        if "specdec_propose_rpc_seconds_sum" in after:
            split["propose_rpc_ms"] = round(1000.0 * d("specdec_propose_rpc_seconds_sum") / proposes, 3)
        split["propose_rows"] = round(d("specdec_propose_rows_total") / proposes, 3)
        split["propose_steps"] = round(d("specdec_propose_steps_total") / proposes, 3)
    prefills = d("specdec_draft_prefill_compute_seconds_count")
    if prefills > 0:  # the draft worker's compute per Prefill of prompt chunks, and its tokens
        split["draft_prefills"] = int(prefills)
        split["draft_prefill_compute_ms"] = round(1000.0 * d("specdec_draft_prefill_compute_seconds_sum") / prefills, 3)
        split["draft_prefill_tokens"] = round(d("specdec_draft_prefill_tokens_total") / prefills, 3)
    calls = d("specdec_prefilling_propose_compute_seconds_count")
    if calls > 0:  # the same per Propose that also prefills, its tokens, rows and steps
        split["prefilling_proposes"] = int(calls)
        compute = d("specdec_prefilling_propose_compute_seconds_sum")
        split["prefilling_propose_compute_ms"] = round(1000.0 * compute / calls, 3)
        for what in ("tokens", "rows", "steps"):
            split[f"prefilling_propose_{what}"] = round(d(f"specdec_prefilling_propose_{what}_total") / calls, 3)
    hits, misses = d("specdec_predraft_total:hit"), d("specdec_predraft_total:miss")
    if hits + misses > 0:
        split["predraft_hit_rate"] = round(hits / (hits + misses), 3)
    return split


def add_cost(summary: dict[str, Any]) -> None:
    """c = draft wait per draft step / verify time per round (docs/design.md's c, Speed, as the pipeline sees
    it; drafting of a batch runs in steps, one per draft position) and the sequential bound
    tau / (k c + 1), with k the mean draft length per request-round."""
    split = summary.get("split")
    k = summary.get("k_mean")
    if not split or not k or not split.get("verify_ms_per_round"):
        return
    split["c"] = round((split["draft_wait_ms_per_round"] / k) / split["verify_ms_per_round"], 3)
    if summary.get("tau"):
        summary["bound_sequential"] = round(summary["tau"] / (k * split["c"] + 1.0), 3)


def sum_splits(pairs: list[tuple[dict | None, dict | None]]) -> dict | None:
    total_before: dict[str, float] = {}
    total_after: dict[str, float] = {}
    for before, after in pairs:
        if before is None or after is None:
            return None
        for k in set(before) | set(after):
            total_before[k] = total_before.get(k, 0.0) + before.get(k, 0.0)
            total_after[k] = total_after.get(k, 0.0) + after.get(k, 0.0)
    return phase_split(total_before, total_after)
