"""`specdec bench ...`: benchmarks that put ratios side by side in one run."""

from __future__ import annotations

import argparse
import json
import sys


def _bench_runner(args: argparse.Namespace) -> int:
    from specdec.bench_runner import bench_runner, format_table

    result = bench_runner(args.model, dtype=args.dtype, context_len=args.context, repeat=args.repeat,
                          threads=args.threads, progress=lambda name: print(f"... {name}", file=sys.stderr))
    print(json.dumps(result, indent=2) if args.json else format_table(result))
    return 0


def add_bench(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="benchmarks (runner, generate, serve)")
    bsub = bench.add_subparsers(dest="bench_command", required=True)

    p = bsub.add_parser("runner", help="runner vs transformers forward: decode b=1, b=8, verify 5 tokens")
    p.add_argument("--model", required=True, help="pack name, HF folder, .gguf file or hub id")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--context", type=int, default=128, help="tokens already in the cache")
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_bench_runner)
