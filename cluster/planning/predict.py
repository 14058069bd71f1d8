"""A `specdec bench serve` run predicted from a profile, and put next to a measured one.

The prediction replays what the bench does: the profile's prompts in order (request i is prompt
i mod n, with that prompt's own output length and acceptance; the draft model's rounds replayed
from the prompt's greedy path where the profile has it), the bench's Poisson arrivals (the
same generator and seed) or its closed loop, every scenario once per mode, on the service the
serve config describes (its router config, worker slots; on one CPU machine the draft and the
target worker share the cores: their calls share the device while both run). The summaries have the bench's fields,
computed by the bench's own ``summarize``.
"""

from __future__ import annotations

import copy
import statistics
from dataclasses import dataclass
from typing import Any

from cluster.config import ServeConfig
from cluster.planning.costs import ProfileCosts
from cluster.planning.greedy_path import GreedyPath
from cluster.planning.profile import Profile, ProfileError
from cluster.planning.sim_trees import SimTrees
from cluster.planning.simulator import Deployment, SimResult, simulate
from cluster.planning.workload import AcceptanceModel, SimRequestSpec, WorkloadError, acceptance_pool
from specdec.bench.serve import poisson_arrivals, summarize
from specdec.bench.stats import bootstrap_band

__all__ = ["Scenario", "bench_requests", "predict_bench", "compare", "format_comparison"]


@dataclass(frozen=True)
class Scenario:
    kind: str  # "poisson" | "closed"
    x: float  # rate (requests/s) or clients

    @property
    def name(self) -> str:  # as bench serve names it
        return f"closed c={int(self.x)}" if self.kind == "closed" else f"poisson {self.x}/s"


def bench_requests(profile: Profile, n: int, max_tokens: int, arrivals: list[float]) -> list[SimRequestSpec]:
    """The bench's requests: prompt i mod (profiled prompts), its length, output and acceptance."""
    pools: dict[str, list[AcceptanceModel]] = {name: acceptance_pool(s) for name, s in profile.drafters.items()}
    paths = [r.agree for r in profile.drafters["draft"].requests] if "draft" in profile.drafters else []
    base = next(iter(profile.drafters.values()), None)
    if base is None or not base.requests:
        raise ProfileError("the profile has no acceptance run (profile with prompts and a budget that reaches it)")
    prof_max = int(profile.workload.get("max_tokens", 0))
    out = []
    for i in range(n):
        req = base.requests[i % len(base.requests)]
        stopped = req.finish_reason == "stop" or req.output_tokens < prof_max
        output = min(max_tokens, req.output_tokens) if stopped else max_tokens
        acc = {name: models[i % len(models)] for name, models in pools.items() if models}
        agree = paths[i % len(paths)] if paths and "draft" in acc else None
        if agree:  # the bench decodes greedily: its drafts follow the path
            acc["draft"] = GreedyPath(agree, acc["draft"])
        out.append(SimRequestSpec(arrivals[i], req.prompt_tokens, max(1, output), acc, f"{req.id}#{i}"))
    return out


def _deployment(profile: Profile, serve: ServeConfig, mode: str, colocated: bool, jitter: float = 0.0) -> Deployment:
    draft = serve.draft
    model_draft = draft is not None and draft.worker.model != "ngram"
    drafter = "draft" if model_draft and serve.router.default_mode == "draft" else "ngram"
    overlap = colocated and drafter == "draft" and serve.router.pipelined
    return Deployment(
        costs=ProfileCosts(profile, drafter, drafts_overlap_verifies=overlap),
        router=serve.router,
        groups=serve.target.replicas,
        drafts=draft.replicas if model_draft else 0,
        target_slots=serve.target.worker.num_slots,
        draft_slots=draft.worker.num_slots if model_draft else 8,
        max_context=serve.target.worker.max_len,
        colocated=colocated,
        mode=mode,
        jitter=jitter,
        # the draft worker's own trees; runners-up get no extra chance until one is measured
        trees=SimTrees.of_draft_worker(draft.worker.draft_options) if model_draft else None,
    )


def predict_bench(
    profile: Profile,
    serve: ServeConfig,
    scenarios: list[Scenario],
    requests: int,
    max_tokens: int,
    modes: tuple[str, ...] = ("auto", "off"),
    seed: int = 0,
    colocated: bool = True,
    draws: int = 1,
    after: dict[str, Any] | None = None,
    jitter: float = 0.0,
) -> dict[str, Any]:
    """What `specdec bench serve` would report: {"results": [{scenario, kind, x, mode, summary, sim}]}.
    The runs go in the bench's order through one router (its learned state carried over: the
    verify cost line, the pooled acceptance, the drafters' measured waits), as the service's.
    ``draws`` > 1: each run simulated that many times, the acceptance (and ``jitter``) drawn with seeds ``seed``,
    ``seed`` + 1, ... (the arrivals stay the bench's, from ``seed``), and the numbers averaged:
    with a few requests, one draw's k or tau moves by tens of percent. ``after``: a `specdec bench
    serve` result the same service ran just before (the protocol's calibration run): its runs are
    simulated first and not reported, so the router starts from what that run taught the
    service's, not from a fresh router's priors. ``jitter``: the spread of each simulated call's
    time (Deployment.jitter); with greedy paths it is what makes the draws differ."""
    if draws < 1:
        raise WorkloadError(f"draws must be at least 1 (got {draws})")
    memory = None
    if after is not None:
        past, opts = scenarios_of(after)
        past_modes = tuple(opts.get("modes") or modes)
        args = (opts.get("requests") or requests, opts.get("max_tokens", max_tokens), past_modes, opts.get("seed", 0))
        _, memory = _runs(profile, serve, past, *args, colocated, 1, None, jitter)
    results, _ = _runs(profile, serve, scenarios, requests, max_tokens, modes, seed, colocated, draws, memory, jitter)
    return {"profile": {"device": profile.device, "target": profile.target, "draft": profile.draft}, "results": results}


def _runs(profile, serve, scenarios, requests, max_tokens, modes, seed, colocated, draws, memory, jitter=0.0):
    """predict_bench's runs, from the router ``memory`` given; (results, the memory after them)."""
    results = []
    for sc in scenarios:
        for mode in modes:
            if sc.kind == "poisson":
                arrivals = poisson_arrivals(requests, sc.x, seed)
            elif sc.kind == "closed":
                arrivals = [0.0] * requests
            else:
                raise WorkloadError(f"unknown scenario kind {sc.kind!r}")
            reqs = bench_requests(profile, requests, max_tokens, arrivals)
            dep = _deployment(profile, serve, mode, colocated, jitter)
            closed = int(sc.x) if sc.kind == "closed" else 0
            runs: list[SimResult] = [
                simulate(dep, reqs, seed=seed + d, closed=closed, memory=copy.deepcopy(memory)) for d in range(draws)
            ]
            memory = runs[0].memory
            results.append(
                {
                    "scenario": sc.name,
                    "kind": sc.kind,
                    "x": sc.x,
                    "mode": mode,
                    "summary": _mean([r.summary for r in runs]),
                    "utilization": _mean([r.utilization for r in runs]),
                    "mean_batch": round(sum(r.mean_batch for r in runs) / draws, 3),
                    "draws": draws,
                    "spread": _spread([r.summary for r in runs]),
                }
            )
    return results, memory


def _mean(dicts: list[dict[str, Any]]) -> dict[str, Any]:
    """The numbers averaged over ``dicts`` (same keys; nested dicts too, e.g. the round split);
    anything else as in the first."""
    if len(dicts) == 1:
        return dicts[0]
    out: dict[str, Any] = {}
    for key, value in dicts[0].items():
        numbers = [d.get(key) for d in dicts]
        if isinstance(value, dict) and all(isinstance(v, dict) for v in numbers):
            out[key] = _mean(numbers)
        elif (
            isinstance(value, int | float)
            and not isinstance(value, bool)
            and all(isinstance(v, int | float) for v in numbers)
        ):
            out[key] = round(sum(numbers) / len(numbers), 4)
        else:
            out[key] = value
    return out


def _spread(summaries: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Each compared metric's 10th and 90th percentile over the draws. With a few requests a
    percentile of the run is one request's, and the draws split by which request that is (two
    groups of TPOT p50 at a saturating rate): their mean can sit
    between the groups, where no run lands, so the band says how far one run may fall from it."""
    out: dict[str, list[float]] = {}
    for key, _ in _METRICS:
        values = [s[key] for s in summaries if isinstance(s.get(key), int | float)]
        if len(values) == len(summaries) and len(values) > 1:
            deciles = statistics.quantiles(values, n=10, method="inclusive")
            if deciles[-1] > deciles[0]:  # without jitter OFF's draws never move: no band
                out[key] = [round(deciles[0], 4), round(deciles[-1], 4)]
    return out


def scenarios_of(bench: dict[str, Any]) -> tuple[list[Scenario], dict[str, Any]]:
    """The scenarios and options of a `specdec bench serve` result, to predict the same run."""
    opts = bench.get("options") or {}
    seen: list[Scenario] = []
    for r in bench.get("results", []):
        if r.get("mode") == "engine":
            continue
        sc = Scenario(r["kind"], float(r["x"]))
        if sc not in seen:
            seen.append(sc)
    if not seen:
        raise WorkloadError("the bench serve result has no scenarios")
    return seen, opts


_METRICS = (
    ("throughput_tok_s", "tok/s"),
    ("ttft_ms_p50", "TTFT p50"),
    ("tpot_ms_p50", "TPOT p50"),
    ("tpot_ms_p99", "TPOT p99"),
    ("k_mean", "k"),
    ("tau", "tau"),
)


# The medians a run's own requests decide: with 8 requests a p50 is the mean of two of them
_RUN_BAND_METRICS = ("ttft_ms_p50", "tpot_ms_p50")


def compare(predicted: dict[str, Any], measured: dict[str, Any]) -> list[dict[str, Any]]:
    """Per scenario and mode: predicted, measured and the relative error of each metric; the
    draws' band of the prediction, and for the medians the run's own (:func:`bootstrap_band` over
    its requests' records, where the result keeps them)."""
    # The simulator models the gRPC API: HTTP rows of a `bench serve --api grpc,http` run are not compared.
    meas = {(r["scenario"], r["mode"]): r for r in measured.get("results", []) if r.get("api", "grpc") == "grpc"}
    rows = []
    for r in predicted["results"]:
        run = meas.get((r["scenario"], r["mode"]))
        if run is None:
            continue
        m, records = run["summary"], run.get("records") or []
        row: dict[str, Any] = {"scenario": r["scenario"], "mode": r["mode"]}
        for key, _ in _METRICS:
            p, v = r["summary"].get(key), m.get(key)
            row[key] = {"predicted": p, "measured": v, "error": round(p / v - 1.0, 4) if p and v else None}
            band = r.get("spread", {}).get(key)
            if band and v is not None:
                row[key]["draws_p10_p90"] = band
                row[key]["within_draws"] = band[0] <= v <= band[1]
            own = (
                bootstrap_band(records, lambda rs, key=key: summarize(rs, 1.0)[key])
                if key in _RUN_BAND_METRICS
                else None
            )
            if own and p is not None:
                row[key]["run_p10_p90"] = [round(x, 3) for x in own]
                row[key]["within_run"] = own[0] <= p <= own[1]
        rows.append(row)
    return rows


def format_comparison(rows: list[dict[str, Any]]) -> str:
    head = ["scenario", "mode"] + [f"{label} pred / meas (err)" for _, label in _METRICS]
    lines = [" | ".join(head), " | ".join(["---"] * len(head))]

    def cell(c: dict) -> str:
        p, m, e = c["predicted"], c["measured"], c["error"]
        if p is None or m is None:
            return "-"
        text = f"{p:.4g} / {m:.4g} ({e:+.0%})" if e is not None else f"{p:.4g} / {m:.4g}"
        if "draws_p10_p90" in c:  # the draws' 10-90 % band; "!" where the measured run fell outside it
            lo, hi = c["draws_p10_p90"]
            text += f" [{lo:.4g}-{hi:.4g}{'' if c['within_draws'] else ' !'}]"
        if "run_p10_p90" in c:  # the run's own band; "!" where the prediction fell outside it
            lo, hi = c["run_p10_p90"]
            text += f" run [{lo:.4g}-{hi:.4g}{'' if c['within_run'] else ' !'}]"
        return text

    for r in rows:
        lines.append(" | ".join([r["scenario"], r["mode"]] + [cell(r[k]) for k, _ in _METRICS]))
    if any("draws_p10_p90" in r[k] for r in rows for k, _ in _METRICS):
        lines.append(
            "[lo-hi]: the draws' 10th to 90th percentile (acceptance and jitter drawn anew); '!': the run fell outside"
        )
    if any("run_p10_p90" in r[k] for r in rows for k, _ in _METRICS):
        lines.append(
            "run [lo-hi]: the measured median's 10th to 90th percentile over resamples of the run's requests"
            " (what a run of this size holds by chance); '!': the prediction fell outside"
        )
    return "\n".join(lines)
