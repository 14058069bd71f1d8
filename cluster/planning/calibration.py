"""A profile calibrated by a `specdec bench serve` result of the service it models: the router's
and the RPCs' time per round, and how much the service's Verify, prefill and Propose cost over the
profile's in-process forwards (``Overhead``). The profile measures the forwards alone; the service
adds a Ray actor, gRPC and the router, and this is where their share is read off a real run.
"""

from __future__ import annotations

import statistics

from cluster.planning.profile import Overhead, Profile

__all__ = ["overhead_from_bench", "least_squares_line"]


def least_squares_line(points: list[tuple[float, float]]) -> tuple[float, float] | None:
    """Least-squares (intercept, slope) through (x, y) points; None when x never varies."""
    n = len(points)
    if n < 2:
        return None
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    var = sum((x - mx) ** 2 for x, _ in points)
    if var <= 1e-9:
        return None
    slope = sum((x - mx) * (y - my) for x, y in points) / var
    return my - slope * mx, slope


def _prompt_prefill_ms(profile: Profile | None) -> float:
    """The profile's prefill of its mean prompt (ms), 0 without a profile."""
    if profile is None or not profile.drafters:
        return 0.0
    reqs = next(iter(profile.drafters.values())).requests
    return sum(profile.target_prefill.at(r.prompt_tokens - 1) for r in reqs) / len(reqs) if reqs else 0.0


def _medians(by_batch: dict[int, list[float]]) -> list[list[float]]:
    return [[b, round(statistics.median(v), 3)] for b, v in sorted(by_batch.items())]


# The rows the timed Proposes must span for points in them (c=1, 2, 4 spans 1.0-2.5 rows), and how
# close two scenarios' mean rows may lie before they count as one point (c=8 and c=16: 6.0 and 6.4)
_DRAFT_STEP_MIN_SPAN = 1.0
_DRAFT_STEP_SAME_ROWS = 0.5


def _draft_step_points(points: list[tuple[float, float]]) -> list[list[float]]:
    """[mean rows, ms per step] of the service's Propose, from each scenario's (mean rows, ms per
    step), where they span :data:`_DRAFT_STEP_MIN_SPAN` rows or more: scenarios of about the same
    rows averaged, and a step never cheaper than at fewer rows (a dip is noise; the work grows with
    the rows). [] where they do not span, or the cost falls from the fewest rows to the most (then
    the profile's grid, scaled, prices the Propose)."""
    pts = sorted(points)
    if len(pts) < 2 or pts[-1][0] - pts[0][0] < _DRAFT_STEP_MIN_SPAN or pts[-1][1] < pts[0][1]:
        return []
    groups: list[list[tuple[float, float]]] = []
    for p in pts:
        if groups and p[0] - groups[-1][0][0] < _DRAFT_STEP_SAME_ROWS:
            groups[-1].append(p)
        else:
            groups.append([p])
    out: list[list[float]] = []
    for g in groups:
        rows, ms = sum(r for r, _ in g) / len(g), sum(m for _, m in g) / len(g)
        out.append([round(rows, 3), round(max(ms, out[-1][1] if out else 0.0), 3)])
    return out if len(out) > 1 else []


def overhead_from_bench(result: dict, profile: Profile | None = None) -> Overhead:
    """Router and RPC time per round, and the scale of the target's Verify, from a `specdec bench
    serve` result (its scenarios' round split, scraped from the router's /metrics).

    The router's cost per row is fitted across scenarios of different mean batch (request-rounds
    per round); results from before the ``prefill`` phase held the rounds' prefills in the router
    phase, so there the prefill the profile predicts is taken out. The Verify RPC is the verify
    wall less the worker's own compute (the ``rpc`` phase). ``verify_scale`` is the median over
    scenarios of that compute over the profile's forward at the scenario's mean batch and tokens per
    row (k + 1), and ``verify_scale_by_batch`` / ``verify_scale_plain_by_batch`` the median per mean
    batch (rounded) of the speculative / plain scenarios (k under 0.5 per row); where the worker
    reported no compute time, the RPC is folded into the scale. ``prefill_scale``: the prefill
    phase's time over the profile's prefill of as many mean prompts as the scenario sent.
    ``draft_scale``: the median over scenarios of the draft worker's compute per timed Propose over
    the profile's Propose at that call's mean rows and steps (results from before the draft worker
    reported its compute: 1), and ``draft_scale_by_batch`` the median per mean rows (rounded).
    ``draft_step_by_rows``: each scenario's compute per draft step at its mean rows
    (:func:`_draft_step_points`), which then prices the Propose in place of the scaled grid. The
    draft RPC is the timed Proposes' wall less that compute (``propose_rpc_ms``), the mean over
    scenarios. Results from before the router measured it read it from the draft wait less the
    Propose as priced (:meth:`Overhead.propose_ms`) for the mean batch and k, only in scenarios where no
    round failed open: such a round waited out its draft deadline, which the simulator models itself
    (read as RPC time, a float32 c=8 run's waits priced every Propose 1 s dearer, and the simulated
    router then failed open 6x as often as the service). That reading also holds every wait for a
    pre-draft: 208-538 ms on the float32 Qwen pair at one and two clients."""
    prefill_ms = _prompt_prefill_ms(profile)
    propose = profile.draft_propose if profile is not None else None
    points = []
    rpc, draft_rpc, draft_waits, scales, prefill_scales, draft_scales = [], [], [], [], [], []
    by_batch: dict[bool, dict[int, list[float]]] = {True: {}, False: {}}  # plain? -> batch -> scales
    draft_by_rows: dict[int, list[float]] = {}
    draft_steps: list[tuple[float, float]] = []  # (mean rows, compute per draft step) of each scenario
    for r in result.get("results", []):
        s, split = r.get("summary", {}), r.get("summary", {}).get("split")
        if not split or r.get("mode") == "engine" or not split.get("rounds"):
            continue
        batch = (s.get("rounds") or split["rounds"]) / split["rounds"]
        router = split.get("router_ms_per_round", 0.0)
        if "prefill_ms_per_round" not in split:
            router -= prefill_ms * s.get("requests", 0) / split["rounds"]
        points.append((batch, max(0.0, router)))
        rpc_ms = split.get("rpc_ms_per_round")
        if rpc_ms is not None:
            rpc.append(rpc_ms)
        k = split.get("drafted_per_round", 0.0) / max(batch, 1.0)
        if profile is not None and split.get("verify_ms_per_round"):
            predicted = profile.target_forward.at(batch, k + 1)
            if predicted > 0:
                scales.append((split["verify_ms_per_round"] - (rpc_ms or 0.0)) / predicted)
                by_batch[k < 0.5].setdefault(max(1, round(batch)), []).append(scales[-1])
        if prefill_ms > 0 and split.get("prefill_ms_per_round") and s.get("requests"):
            prefill_scales.append(split["prefill_ms_per_round"] * split["rounds"] / (prefill_ms * s["requests"]))
        if split.get("proposes"):
            rows, steps, compute = split["propose_rows"], split["propose_steps"], split["propose_compute_ms"]
            predicted = propose.at(rows, steps) if propose is not None else 0.0
            if predicted > 0:
                draft_scales.append(compute / predicted)
                draft_by_rows.setdefault(max(1, round(rows)), []).append(draft_scales[-1])
            if steps:
                draft_steps.append((rows, compute / steps))
            if split.get("propose_rpc_ms") is not None:
                draft_rpc.append(split["propose_rpc_ms"])
        if k > 0 and split.get("draft_wait_ms_per_round") and not s.get("fail_open_rounds"):
            draft_waits.append((batch, k, split["draft_wait_ms_per_round"]))
    if not points:
        raise ValueError("the bench serve result has no round split (was the router's /metrics reachable?)")
    line = least_squares_line(points)
    fixed, per_row = line if line is not None and line[0] >= 0 and line[1] >= 0 else (0.0, 0.0)
    if per_row == 0.0:
        fixed = sum(t for _, t in points) / len(points)
    step_points = _draft_step_points(draft_steps)
    drafts = Overhead(
        draft_scale=round(statistics.median(draft_scales), 3) if draft_scales else 1.0,
        draft_scale_by_batch=_medians(draft_by_rows),
        draft_step_by_rows=step_points,
    )
    if draft_rpc:  # measured
        drpc = [sum(draft_rpc) / len(draft_rpc)]
    else:  # results from before the router measured it: the draft wait less the Propose as priced
        drpc = [max(0.0, wait - (drafts.propose_ms(propose, b, k) or 0.0)) for b, k, wait in draft_waits]
    if rpc:
        verify_rpc = sum(rpc) / len(rpc)
    else:  # unmeasured: in the scale when there is one
        verify_rpc = 0.0 if scales else Overhead.verify_rpc_ms
    return Overhead(
        router_ms=round(fixed, 3),
        router_ms_per_row=round(per_row, 4),
        verify_rpc_ms=round(verify_rpc, 3),
        draft_rpc_ms=round(min(drpc), 3) if drpc else Overhead.draft_rpc_ms,
        verify_scale=round(statistics.median(scales), 3) if scales else 1.0,
        verify_scale_by_batch=_medians(by_batch[False]),
        verify_scale_plain_by_batch=_medians(by_batch[True]),
        prefill_scale=round(statistics.median(prefill_scales), 3) if prefill_scales else 1.0,
        draft_scale=drafts.draft_scale,
        draft_scale_by_batch=drafts.draft_scale_by_batch,
        draft_step_by_rows=drafts.draft_step_by_rows,
        source=f"bench serve result ({len(points)} scenarios)",
    )
