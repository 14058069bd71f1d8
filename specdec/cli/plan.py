"""`specdec profile`, `specdec simulate` and `specdec plan`: capacity planning (cluster/planning)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from pathlib import Path

from specdec.cli.exit_codes import FAILED, OK, USAGE
from specdec.core.dtypes import DTYPE_NAMES


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError("every value must be an integer >= 1")
    return tuple(sorted(set(values)))


def _floats(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError("every value must be > 0")
    return values


def _key_values(text: str, flag: str) -> dict[str, float]:
    """``"a=1,b=0.5"`` -> ``{"a": 1.0, "b": 0.5}``; a ValueError naming ``flag`` otherwise."""
    out = {}
    for item in _names(text):
        key, sep, value = (part.strip() for part in item.partition("="))
        try:
            if not (key and sep):
                raise ValueError(item)
            out[key] = float(value)
        except ValueError:
            raise ValueError(f"{flag}: expected KEY=NUMBER[,KEY=NUMBER...], got {item!r}") from None
    return out


def _names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _err(msg: str) -> None:
    print(f"error: {msg}", file=sys.stderr)


def _progress(msg: str) -> None:
    print(f"... {msg}", file=sys.stderr, flush=True)


def _note_thin(profile) -> None:
    """A profile whose time budget left parts out rests on fewer measurements (one pass over a
    grid, a prefill curve of one point): say so before its figures are read."""
    if profile is not None and profile.skipped:
        shown = "; ".join(profile.skipped[:3]) + (
            f"; and {len(profile.skipped) - 3} more" if len(profile.skipped) > 3 else ""
        )
        print(
            f"note: the profile's time budget ({profile.budget_s:.0f} s) left out {len(profile.skipped)} "
            f"part(s): {shown}. Its costs rest on fewer measurements; a larger `specdec profile "
            "--budget-s` measures them.",
            file=sys.stderr,
        )


def _quiet_router(args: argparse.Namespace) -> None:
    """The simulated router's own log lines (each draft move, depth change...) only with -v."""
    if not getattr(args, "verbose", False):
        logging.getLogger("router").setLevel(logging.WARNING)


# --------------------------------------------------------------------------- profile


def _profile(args: argparse.Namespace) -> int:
    from cluster.config import load_config
    from cluster.planning.calibration import overhead_from_bench
    from cluster.planning.profile import Profile, ProfileError
    from cluster.planning.profiler import ProfileOptions, take_profile
    from cluster.planning.sim_calibration import calibrate_draft_prefill
    from cluster.planning.workload import WorkloadError
    from specdec.core.build import IncompatibleModels
    from specdec.core.models import ModelLoadError
    from specdec.core.prompts import PromptSetError

    if args.recalibrate is None and args.target is None:
        _err("give --target (a model to profile), or --recalibrate PROFILE with --serve-json")
        return USAGE
    if args.recalibrate is not None and args.serve_json is None:
        _err("--recalibrate needs --serve-json: the bench serve result to calibrate by")
        return USAGE
    try:
        serve = load_config(args.config)
        bench = json.loads(Path(args.serve_json).read_text()) if args.serve_json else None
        measured = Profile.load(args.recalibrate) if args.recalibrate is not None else None
    except (OSError, ValueError, ProfileError) as exc:
        _err(str(exc))
        return USAGE
    opts = ProfileOptions(
        dtype=args.dtype,
        device=args.device,
        prompts=args.prompts,
        max_tokens=args.max_tokens,
        budget_s=args.budget_s,
        threads=args.threads,
        batches=args.batches,
        tokens=args.tokens,
        context=args.context,
        prefill_lengths=args.prefill,
        repeat=args.repeat,
        k_policy=serve.router.k_policy,
        drafters=tuple(_names(args.drafters)),
    )
    try:
        profile = measured or take_profile(args.target, args.draft, opts, progress=_progress)
        if bench is not None:
            profile.overhead = overhead_from_bench(bench, profile)
            _quiet_router(args)  # the draft prefill's calibration simulates the run
            scale = calibrate_draft_prefill(profile, serve, bench)
            if scale is not None:
                profile.overhead = dataclasses.replace(profile.overhead, draft_prefill_scale=scale)
    except (
        ModelLoadError,
        IncompatibleModels,
        PromptSetError,
        ProfileError,
        WorkloadError,
        ValueError,
        RuntimeError,
    ) as exc:
        _err(str(exc))
        return FAILED
    out = profile.save(args.output)
    print(f"wrote {out}", file=sys.stderr)
    print(_profile_summary(profile))
    return OK


def _profile_summary(p) -> str:
    g = p.target_forward
    lines = [
        f"profile of {p.target['model']} ({p.target['dtype']})"
        + (f" + draft {p.draft['model']}" if p.draft else "")
        + f" on {p.device}, {p.elapsed_s:.0f} s"
        + (f"; skipped by the budget: {', '.join(p.skipped)}" if p.skipped else ""),
        f"target forward ms at context {g.context} (rows: batch {g.batch}; columns: tokens per row {g.tokens}):",
    ]
    lines += [f"  b={b:<3} " + " ".join(f"{v:8.1f}" for v in row) for b, row in zip(g.batch, g.ms)]
    lines.append(
        "target prefill ms: " + ", ".join(f"{n}: {v:.0f}" for n, v in zip(p.target_prefill.tokens, p.target_prefill.ms))
    )
    for name, s in p.drafters.items():
        sm = s.summary()
        extra = f", drafting {s.draft_ms_fixed:.1f} + {s.draft_ms_per_token:.1f} ms x k" if name == "draft" else ""
        lines.append(
            f"{name}: {len(s.requests)} prompts, acceptance {sm['acceptance']:.3f} (MLE {sm['acceptance_mle']:.3f}), "
            f"k {sm['k_mean']:.2f}, tau {sm['tau']:.2f}{extra}"
        )
    o = p.overhead
    lines.append(
        f"overhead per round: router {o.router_ms:.2f} ms + {o.router_ms_per_row:.3f} ms/row, verify RPC "
        f"{o.verify_rpc_ms:.2f} ms, draft RPC {o.draft_rpc_ms:.2f} ms, verify x {o.verify_scale:.2f} "
        f"(by batch: speculative {o.verify_scale_by_batch}, plain {o.verify_scale_plain_by_batch}), "
        f"prefill x {o.prefill_scale:.2f}, draft Propose "
        + (
            "per step "
            + ", ".join(f"{ms:.1f} ms at {rows:.2g} row{'' if rows == 1 else 's'}" for rows, ms in o.draft_step_by_rows)
            + ", then as the grid grows"
            if o.draft_step_by_rows
            else f"x {o.draft_scale:.2f}"
        )
        + f", draft prefill x {o.draft_prefill_scale:.2f} ({o.source})"
    )
    return "\n".join(lines)


# --------------------------------------------------------------------------- simulate


def _simulate(args: argparse.Namespace) -> int:
    from cluster.config import load_config
    from cluster.planning.predict import Scenario, compare, format_comparison, predict_bench, scenarios_of
    from cluster.planning.profile import Profile, ProfileError
    from cluster.planning.sim_calibration import draft_prefill_ms_per_token, timed_kinds
    from cluster.planning.workload import WorkloadError
    from specdec.bench.serve_report import format_table

    _quiet_router(args)
    try:
        profile = Profile.load(args.profile)
        _note_thin(profile)
        serve = load_config(args.config)
        measured = json.loads(Path(args.compare).read_text()) if args.compare else None
        after = json.loads(Path(args.after).read_text()) if args.after else None
    except (OSError, ValueError) as exc:
        _err(str(exc))
        return USAGE
    scenarios = [Scenario("closed", c) for c in args.concurrency] + [Scenario("poisson", r) for r in args.rate]
    requests, max_tokens, modes, seed = args.requests, args.max_tokens, tuple(_names(args.modes)), args.seed
    if measured is not None:
        scenarios, opts = scenarios_of(measured)
        requests = opts.get("requests") or requests
        max_tokens = opts.get("max_tokens", max_tokens)
        modes = tuple(opts.get("modes", modes))
        seed = opts.get("seed", seed)
    if not scenarios:
        _err("give --rate and/or --concurrency, or --compare a bench serve result")
        return USAGE
    if not 0 <= args.jitter <= 1:
        _err(f"--jitter must be in [0, 1] (got {args.jitter})")
        return USAGE
    try:
        pred = predict_bench(
            profile,
            serve,
            scenarios,
            requests,
            max_tokens,
            modes,
            seed,
            not args.separate_devices,
            args.draws,
            after,
            args.jitter,
        )
    except (ProfileError, WorkloadError) as exc:
        _err(str(exc))
        return FAILED
    model = profile.target["model"]
    pred["server"] = {"address": "simulated", "target": model, "draft": (profile.draft or {}).get("model"),
                      "dtype": profile.target["dtype"], "device": profile.device}  # fmt: skip
    if measured is not None:
        pred["comparison"] = compare(pred, measured)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(pred, indent=1))
        print(f"wrote {args.json}", file=sys.stderr)
    print(format_table(pred))
    if measured is not None:
        print("\npredicted vs measured (error = predicted / measured - 1):")
        print(format_comparison(pred["comparison"]))
        kinds = timed_kinds(measured)  # like with like: the ways the service prefilled its drafter
        p_ms = draft_prefill_ms_per_token(pred, profile, kinds)
        m_ms = draft_prefill_ms_per_token(measured, profile, kinds)
        if p_ms is not None and m_ms is not None:
            print(f"the drafter's prefill per token: {p_ms:.2f} / {m_ms:.2f} ms ({p_ms / m_ms - 1:+.0%})")
    return OK


# --------------------------------------------------------------------------- plan


def _plan(args: argparse.Namespace) -> int:
    from cluster.config import DEFAULT_CONFIG, load_config
    from cluster.planning.catalog import CatalogError, load_catalog
    from cluster.planning.plan_report import format_plan, plot_cost_frontier, plot_latency_vs_rate
    from cluster.planning.planner import SLO, PlanError, PlanWorkload, SearchSpace, plan
    from cluster.planning.profile import Profile, ProfileError
    from cluster.planning.workload import (
        AcceptanceModel,
        WorkloadError,
        acceptance_pool,
        load_trace,
        parse_lengths,
        profile_lengths,
    )

    _quiet_router(args)
    if not args.rate and not args.trace:
        _err("give the arrivals: --rate R (requests/s) or --trace FILE")
        return USAGE
    if args.requests < 1:
        _err("--requests must be >= 1")
        return USAGE
    try:
        catalog = load_catalog(args.catalog)
        if args.efficiency:
            catalog = catalog.with_efficiency(_key_values(args.efficiency, "--efficiency"))
        router = load_config(args.config or DEFAULT_CONFIG.with_name("cluster.yaml")).router
        profile = Profile.load(args.profile) if args.profile else None
        _note_thin(profile)
        acceptance: dict[str, list[AcceptanceModel]] = {}
        if args.acceptance is not None:
            acceptance["draft"] = [AcceptanceModel.iid(args.acceptance)]
        elif profile is not None and "draft" in profile.drafters:
            acceptance["draft"] = acceptance_pool(profile.drafters["draft"])
        prompts, outputs = profile_lengths(profile) if profile else ([], [])
        workload = PlanWorkload(
            rate=args.rate or 0.0,
            prompt=parse_lengths(args.prompt_tokens, prompts),
            output=parse_lengths(args.output_tokens, outputs),
            acceptance=acceptance,
            requests=args.requests,
            seed=args.seed,
        )
        if args.trace:
            workload.trace = load_trace(args.trace, acceptance, args.seed)
            span = max(r.t for r in workload.trace) or 1.0
            workload.rate = workload.rate or len(workload.trace) / span
        space = SearchSpace(
            target_devices=_names(args.devices) if args.devices else None,
            tp=list(args.tp) if args.tp else None,
            draft_devices=_names(args.draft_devices) if args.draft_devices else None,
            k_policies=tuple(_names(args.k_policies)),
            max_batches=args.max_batch,
            runners_up=args.runners_up,
            max_groups=args.max_groups,
            draft_ratios=args.draft_ratios,
        )
        bad = [k for k in space.k_policies if k not in ("adaptive", "k4", "off")]
        if bad:
            raise PlanError(f"unknown k policies {bad}: use adaptive, k4 or off")
        slo = SLO(args.ttft_p99_ms, args.tpot_p99_ms, args.min_throughput)
        if args.jobs < 1:
            raise PlanError(f"--jobs must be >= 1 (got {args.jobs})")
        result = plan(catalog, args.target, args.draft, workload, slo, space, router, _progress, args.jobs)
    except (CatalogError, PlanError, WorkloadError, ProfileError, ValueError) as exc:
        _err(str(exc))
        return USAGE
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result.to_dict(), indent=1))
        print(f"wrote {args.json}", file=sys.stderr)
    print(format_plan(result))
    if args.plot and result.best is not None:
        prefix = Path(args.plot)
        prefix.parent.mkdir(parents=True, exist_ok=True)
        rates = [round(workload.rate * f, 4) for f in (0.25, 0.5, 0.75, 1.0, 1.25, 1.5)]
        _progress(f"latency against rate: {len(rates)} rates x {1 + len(result.runners_up)} deployments")
        curves = result.sweep([result.best] + result.runners_up, rates)
        slo_d = result.question["slo"]
        a = plot_latency_vs_rate(curves, prefix.with_name(prefix.name + "-latency.png"), slo_d)
        b = plot_cost_frontier(result.evaluated, prefix.with_name(prefix.name + "-frontier.png"), slo_d)
        print(f"wrote {a} and {b}", file=sys.stderr)
    return OK if result.best is not None else FAILED


def add_plan(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("profile", help="measure this machine for the capacity simulator (JSON profile)")
    p.add_argument("--target", default=None, help="pack name, HF folder, .gguf file or hub id")
    p.add_argument("--draft", default=None, help="draft model (its forwards, and its acceptance on the prompts)")
    p.add_argument("--dtype", default="bfloat16", choices=DTYPE_NAMES)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--prompts", default="humaneval:8", help="acceptance workload: humaneval[:N] or FILE.jsonl[:N]")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--budget-s", type=float, default=600.0, help="stop measuring after this many seconds")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--batches", type=_ints, default=(1, 2, 4, 8), metavar="B1,B2,...")
    p.add_argument("--tokens", type=_ints, default=(1, 2, 4, 8, 13), metavar="T1,T2,...", help="tokens per row")
    p.add_argument("--context", type=int, default=168, help="cached tokens per row while timing forwards")
    p.add_argument("--prefill", type=_ints, default=(16, 64, 128, 256, 512), metavar="N1,N2,...")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--drafters", default="draft,ngram", help="acceptance runs: draft (the --draft model), ngram")
    p.add_argument("--config", default=None, help="serve config whose router k policy the acceptance run uses")
    p.add_argument(
        "--serve-json", default=None, help="a `specdec bench serve --json` result: overheads, scales of the costs"
    )
    p.add_argument(
        "--recalibrate", default=None, metavar="PROFILE", help="measure nothing: PROFILE calibrated by --serve-json"
    )
    p.add_argument("-o", "--output", default="profile.json")
    p.set_defaults(func=_profile)

    p = sub.add_parser("simulate", help="predict a `specdec bench serve` run on this machine from a profile")
    p.add_argument("--profile", required=True)
    p.add_argument("--config", default=None, help="the service's config (default configs/default.yaml)")
    p.add_argument("--compare", default=None, help="a `specdec bench serve --json` result: its scenarios, side by side")
    p.add_argument(
        "--after",
        default=None,
        metavar="BENCH_JSON",
        help="a `specdec bench serve --json` result the same service ran just before: simulated first, unreported,"
        " so the router starts with what that run taught the service's",
    )
    p.add_argument("--rate", type=_floats, default=(), metavar="R1,R2,...", help="Poisson arrival rates (requests/s)")
    p.add_argument("--concurrency", type=_ints, default=(), metavar="C1,C2,...", help="closed-loop clients")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--modes", default="auto,off")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--draws",
        type=int,
        default=8,
        help="simulations per scenario, acceptance and jitter drawn anew, numbers averaged",
    )
    p.add_argument(
        "--jitter",
        type=float,
        default=0.05,
        help="spread of each simulated call's time, exp(N(0, JITTER)): the service's own (its Verify of one"
        " shape spread ~6 %% on a 2-core CPU VM); the router's k follows measured times",
    )
    p.add_argument("--separate-devices", action="store_true", help="draft and target on their own devices")
    p.add_argument("--json", default=None, metavar="OUT")
    p.set_defaults(func=_simulate)

    p = sub.add_parser("plan", help="the cheapest deployment of a GPU catalog that meets latency objectives")
    p.add_argument("--target", required=True, help="a model of the catalog (e.g. llama-3.1-70b)")
    p.add_argument("--draft", default=None, help="a model of the catalog, or none")
    p.add_argument("--catalog", default=None, help="devices and models YAML (default cluster/planning/catalog.yaml)")
    p.add_argument(
        "--efficiency",
        default=None,
        metavar="KEY=V,...",
        help="replace the catalog's roofline efficiencies, e.g. forward_overhead_ms_per_layer=0.11",
    )
    p.add_argument("--config", default=None, help="router settings (default configs/cluster.yaml)")
    p.add_argument("--rate", type=float, default=None, help="Poisson arrivals, requests/s")
    p.add_argument("--trace", default=None, help="JSONL/CSV trace: t, prompt_tokens, output_tokens per request")
    p.add_argument("--prompt-tokens", default="512", help="N, uniform:A:B, normal:MEAN:SD or profile")
    p.add_argument("--output-tokens", default="256", help="N, uniform:A:B, normal:MEAN:SD or profile")
    p.add_argument("--acceptance", type=float, default=None, help="per-token acceptance of the draft (i.i.d.)")
    p.add_argument("--profile", default=None, help="take acceptance (and 'profile' lengths) from a profile")
    p.add_argument("--ttft-p99-ms", type=float, default=None)
    p.add_argument("--tpot-p99-ms", type=float, default=None)
    p.add_argument("--min-throughput", type=float, default=None, help="tokens/s")
    p.add_argument("--devices", default=None, help="target device types (default: all in the catalog)")
    p.add_argument("--tp", type=_ints, default=None, metavar="T1,T2,...", help="TP degrees (default: all that fit)")
    p.add_argument(
        "--draft-devices", default=None, help="colocated and/or device types (default: colocated + the 2 cheapest)"
    )
    p.add_argument("--k-policies", default="adaptive,off", help="adaptive, k4, off")
    p.add_argument(
        "--draft-ratios", type=_floats, default=(1.0,), metavar="R1,R2", help="draft replicas per target group"
    )
    p.add_argument("--max-batch", type=_ints, default=(32, 128), metavar="B1,B2,...")
    p.add_argument("--requests", type=int, default=200, help="simulated requests per deployment")
    p.add_argument("--max-groups", type=int, default=64, help="target groups tried per configuration, at most")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--runners-up", type=int, default=3)
    p.add_argument(
        "--jobs",
        type=int,
        default=os.cpu_count() or 1,
        help="simulations run at once, in processes (default: the CPUs; the answer does not depend on it)",
    )
    p.add_argument("--json", default=None, metavar="OUT")
    p.add_argument("--plot", default=None, metavar="PREFIX", help="PREFIX-latency.png and PREFIX-frontier.png")
    p.set_defaults(func=_plan)
