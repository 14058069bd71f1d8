"""`specdec bench ...`: benchmarks that put ratios side by side in one run."""

from __future__ import annotations

import argparse
import json
import sys

from specdec.core.draft_options import add_draft_option_flags, draft_options_from_args
from specdec.core.dtypes import DTYPE_NAMES


def _bench_runner(args: argparse.Namespace) -> int:
    from specdec.bench.runner import (
        bench_runner,
        format_prefill,
        format_sweep,
        format_table,
        forward_sweep,
        prefill_times,
    )

    if args.tp > 1:
        from specdec.bench.tp import bench_tp, format_tp_table

        result = bench_tp(
            args.model,
            args.tp,
            dtype=args.dtype,
            context_len=args.context,
            repeat=args.repeat,
            threads=args.threads,
            lm_heads=args.lm_head,
            progress=lambda name: print(f"... {name}", file=sys.stderr),
        )
        print(json.dumps(result, indent=2) if args.json else format_tp_table(result))
        return 0
    if args.prefill:
        result = prefill_times(
            args.model, args.prefill, dtype=args.dtype, context_len=args.context, threads=args.threads
        )
        print(json.dumps(result, indent=2) if args.json else format_prefill(result))
        return 0
    if args.tokens_sweep:
        result = forward_sweep(
            args.model,
            args.tokens_sweep,
            dtype=args.dtype,
            context_len=args.context,
            repeat=args.repeat,
            threads=args.threads,
            as_draft=args.as_draft,
        )
        print(json.dumps(result, indent=2) if args.json else format_sweep(result))
        return 0
    result = bench_runner(
        args.model,
        dtype=args.dtype,
        context_len=args.context,
        repeat=args.repeat,
        threads=args.threads,
        progress=lambda name: print(f"... {name}", file=sys.stderr),
    )
    print(json.dumps(result, indent=2) if args.json else format_table(result))
    return 0


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError("every value must be >= 1")
    return values


# The configuration families of specdec.bench.generate.FAMILIES, spelled out here so that building
# the parser does not import torch (a unit test keeps the two equal).
FAMILIES = (
    "hf_target",
    "hf_assisted",
    "hf_assisted_k",
    "specdec_target",
    "specdec_draft_k",
    "specdec_draft_adaptive",
    "specdec_ngram",
    "specdec_default",
)


def _name_list(text: str) -> tuple[str, ...]:
    names = tuple(x.strip() for x in text.split(",") if x.strip())
    if "all" in names:
        return FAMILIES
    unknown = [n for n in names if n not in FAMILIES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown configuration(s) {', '.join(unknown) or '(none)'}; choose from {', '.join(FAMILIES)} or 'all'"
        )
    return names


def _bench_generate(args: argparse.Namespace) -> int:
    from pathlib import Path

    from specdec.bench.generate import BenchError, BenchOptions, run_benchmark
    from specdec.bench.report import format_table, plot
    from specdec.core.build import IncompatibleModels
    from specdec.core.models import ModelLoadError
    from specdec.core.prompts import PromptSetError

    draft_options = draft_options_from_args(args)
    options = BenchOptions(
        max_tokens=args.max_tokens,
        dtype=args.dtype,
        repeat=args.repeat,
        k=args.k,
        hf_k=args.hf_k,
        k_sweep=args.k_sweep,
        configs=args.configs,
        threads=args.threads,
        warmup=not args.no_warmup,
        budget_s=args.budget_s,
        draft_options=draft_options,
        temperature=args.temperature,
    )
    try:
        result = run_benchmark(args.target, args.draft, args.prompts, options)
    except (BenchError, IncompatibleModels, PromptSetError, ModelLoadError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))
        print(f"wrote {out}", file=sys.stderr)
    png = args.plot or (str(Path(args.json).with_suffix(".png")) if args.json else None)
    if png:
        print(f"wrote {plot(result, png)}", file=sys.stderr)
    print(format_table(result))
    return 0


def add_bench(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="benchmarks (runner, generate, serve)")
    bsub = bench.add_subparsers(dest="bench_command", required=True)

    p = bsub.add_parser("runner", help="runner vs transformers forward: decode b=1, b=8, verify 5 tokens")
    p.add_argument("--model", required=True, help="pack name, HF folder, .gguf file or hub id")
    p.add_argument("--dtype", default="bfloat16", choices=DTYPE_NAMES)
    p.add_argument("--context", type=int, default=128, help="tokens already in the cache")
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument(
        "--tokens-sweep",
        type=_int_list,
        default=(),
        metavar="N1,N2,...",
        help="instead: the runner's forward time for each number of tokens per forward (verify cost vs k)",
    )
    p.add_argument(
        "--prefill",
        type=_int_list,
        default=(),
        metavar="C1,C2,...",
        help="instead: a prompt of --context tokens prefilled in one forward and in chunks of each size, "
        "invariant and fast (seconds, and whether the last logits match the one forward's)",
    )
    p.add_argument(
        "--as-draft",
        action="store_true",
        help="with --tokens-sweep: build the runner as drafters do (int8 weights, vocabulary subset)",
    )
    p.add_argument(
        "--tp",
        type=int,
        default=1,
        metavar="N",
        help="instead: the runner at TP N beside TP 1 (same total threads), with the all-reduce share",
    )
    p.add_argument(
        "--lm-head",
        type=lambda t: tuple(x for x in t.split(",") if x),
        default=("split", "replicated"),
        metavar="MODE,...",
        help="with --tp: lm_head modes to measure (split, replicated)",
    )
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_bench_runner)

    p = bsub.add_parser("generate", help="specdec vs transformers generate() and assisted generation, interleaved")
    p.add_argument("--target", required=True, help="pack name, HF folder, .gguf file or hub id")
    p.add_argument("--draft", default=None, help="draft model (needed by the hf_assisted* and specdec_draft* configs)")
    p.add_argument(
        "--prompts",
        default="humaneval:8",
        help="humaneval[:N] (the model writes the whole function), humaneval-body[:N] (only the body), "
        "or FILE.jsonl[:N]",
    )
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", choices=DTYPE_NAMES)
    p.add_argument("--repeat", type=int, default=1, help="passes over the prompts")
    p.add_argument("--k", type=int, default=4, help="draft tokens per round for the fixed-k and n-gram configs")
    p.add_argument("--hf-k", type=int, default=None, help="k for hf_assisted_k (default: --k)")
    p.add_argument(
        "--k-sweep",
        type=_int_list,
        default=(),
        metavar="K1,K2,...",
        help="also run every fixed-k configuration at each of these k (plots speedup per k)",
    )
    p.add_argument(
        "--configs",
        type=_name_list,
        default=FAMILIES,
        metavar="NAME,...",
        help=f"configurations to run (default all): {', '.join(FAMILIES)}",
    )
    add_draft_option_flags(p)
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sample at this temperature (unseeded: rejection verification) instead of decoding greedily; "
        "specdec configurations only, their outputs are then draws, not compared token by token (default 0)",
    )
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="stop starting prompts when the next one would end past this many seconds",
    )
    p.add_argument("--no-warmup", action="store_true", help="skip the short warm-up run of every configuration")
    p.add_argument("--json", default=None, metavar="OUT", help="write the full result (per-request records) here")
    p.add_argument("--plot", default=None, metavar="PNG", help="plot file (default: next to --json, .png)")
    p.set_defaults(func=_bench_generate)
