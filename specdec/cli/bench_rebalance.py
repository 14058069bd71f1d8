"""`specdec bench rebalance` (skewed drafters: rebalancer vs static pairing) and `specdec bench plot`
(a PNG from a `specdec bench serve --json` result)."""

from __future__ import annotations

import argparse
import json
import sys

from specdec.cli.exit_codes import FAILED, OK, USAGE
from specdec.cli.serve import _bench_subparsers

__all__ = ["add_bench_rebalance"]


def _bench_rebalance(args: argparse.Namespace) -> int:
    from cluster.skew_bench import SkewOptions, format_skew, run_skew_bench

    opts = SkewOptions(
        target=args.target,
        draft=args.draft,
        draft_noise=args.draft_noise,
        slow_factor=args.slow_factor,
        target_delay_s=args.target_delay,
        draft_delay_s=args.draft_delay,
        concurrency=args.concurrency,
        requests=args.requests,
        max_tokens=args.max_tokens,
        repeats=args.repeats,
        period_s=args.period,
    )
    try:
        result = run_skew_bench(opts, progress=lambda msg: print(f"... {msg}", file=sys.stderr, flush=True))
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return FAILED
    print(format_skew(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.json}", file=sys.stderr)
    return OK


def _bench_plot(args: argparse.Namespace) -> int:
    from specdec.bench.serve_plot import plot_serve

    try:
        with open(args.result) as f:
            result = json.load(f)
        out = plot_serve(result, args.out or args.result.rsplit(".", 1)[0] + ".png")
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return USAGE
    print(f"wrote {out}")
    return OK


def add_bench_rebalance(sub: argparse._SubParsersAction) -> None:
    bsub = _bench_subparsers(sub)
    p = bsub.add_parser(
        "rebalance",
        help="skewed drafters: the rebalancer vs static pairing, and its reaction time",
        description="2 target and 2 draft workers on an embedded Ray cluster, drafter 0 slowed; the same "
        "closed-loop load through a statically paired router and a rebalancing one, alternating. Device "
        "speeds are emulated with the workers' bench_step_delay_s knob (see cluster/skew_bench.py).",
    )
    p.add_argument("--target", default="tiny", help="target model, or 'tiny' (random tiny pair, the default)")
    p.add_argument("--draft", default=None, help="draft model (default: the target; ignored with 'tiny')")
    p.add_argument("--draft-noise", type=float, default=0.01, help="'tiny': the drafter's weight noise")
    p.add_argument("--slow-factor", type=float, default=3.0, help="drafter 0's emulated step x this")
    p.add_argument("--target-delay", type=float, default=0.1, help="emulated target step (s per Verify)")
    p.add_argument("--draft-delay", type=float, default=0.02, help="emulated draft step (s per draft token)")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--requests", type=int, default=16, help="requests per run")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2, help="static / rebalancer alternations")
    p.add_argument("--period", type=float, default=1.0, help="telemetry and rebalancer period (s)")
    p.add_argument("--json", default=None, metavar="OUT")
    p.set_defaults(func=_bench_rebalance)

    p = bsub.add_parser("plot", help="PNG of a `bench serve --json` result: throughput and TPOT vs load")
    p.add_argument("result", help="the JSON written by `specdec bench serve --json`")
    p.add_argument("--out", default=None, metavar="PNG", help="default: next to the JSON")
    p.set_defaults(func=_bench_plot)
