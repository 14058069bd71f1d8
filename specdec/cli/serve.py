"""`specdec serve` (the disaggregated service on Ray) and `specdec bench serve` (drive a running one).

The router, the launcher and Ray are imported inside the handlers only: ``specdec --help`` and the
other commands never load them (nor grpc).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

from specdec.cli.bench_abuse import add_abuse_args
from specdec.cli.credentials import (
    add_client_credential_args,
    add_server_security_args,
    client_credentials,
    security_overrides,
)
from specdec.cli.exit_codes import FAILED, OK, USAGE
from specdec.core.dtypes import DTYPE_NAMES
from specdec.core.log_format import LOG_FORMATS, set_log_format

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- serve


def _load_serve_config(args: argparse.Namespace):
    from cluster.config import load_config

    return load_config(
        args.config,
        target=args.target,
        draft=args.draft,
        dtype=args.dtype,
        port=args.port,
        metrics_port=args.metrics_port,
        http_port=args.http_port,
        address=args.address,
        tensor_parallel=args.tp,
        security=security_overrides(args),
    )


def _serve(args: argparse.Namespace) -> int:
    set_log_format(args.log_format)
    try:
        cfg = _load_serve_config(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return USAGE
    if args.print_config:
        import yaml

        print(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
        return OK
    from cluster.launch import serve

    try:
        return serve(cfg)
    except ValueError as exc:  # the config cannot work (tensor_parallel vs the heads, a bad certificate, ...)
        print(f"error: {exc}", file=sys.stderr)
        return USAGE
    except RuntimeError as exc:  # a worker failed to start: say why, no stack trace
        print(f"error: {exc}", file=sys.stderr)
        return FAILED
    except (OSError, ConnectionError) as exc:  # the port is taken; no Ray cluster at --address
        print(f"error: {exc}", file=sys.stderr)
        return FAILED


def _add_serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="serve the Generation gRPC API: draft and target workers on Ray, the router here",
        description="Start (or join, with --address auto) a Ray cluster, create the target and draft worker "
        "actors, and serve specdec.v1.Generation with /metrics. SIGINT/SIGTERM stops it cleanly.",
    )
    p.add_argument("--config", default=None, metavar="YAML", help="deployment config (default: configs/default.yaml)")
    p.add_argument(
        "--target",
        default=None,
        help="target model: a pack name, a model folder, a .gguf file or a pulled hub id ORG/NAME@REVISION",
    )
    p.add_argument("--draft", default=None, help="draft model (as --target), 'ngram' (n-gram draft worker) or 'none'")
    p.add_argument("--dtype", default=None, choices=DTYPE_NAMES, help="both pools")
    p.add_argument("--port", type=int, default=None, help="gRPC port (default 50051; 0 = any free port)")
    p.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="Prometheus /metrics port (default 9400; 0 = any free port; -1 = off)",
    )
    p.add_argument(
        "--http-port",
        type=int,
        default=None,
        help="the OpenAI-compatible HTTP API's port, on the gRPC port's host (default 8000; 0 = off)",
    )
    p.add_argument(
        "--address",
        default=None,
        help="Ray cluster to join ('auto' = the running one); default: an embedded local cluster",
    )
    p.add_argument(
        "--log-format",
        default="text",
        choices=LOG_FORMATS,
        help="log lines as text or JSON objects (the access log, logger specdec.access, gives its fields)",
    )
    p.add_argument(
        "--tp",
        type=int,
        default=None,
        metavar="N",
        help="target.tensor_parallel: ranks per target worker (whole heads each; one node)",
    )
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    add_server_security_args(p)
    p.set_defaults(func=_serve)


# --------------------------------------------------------------------------- bench serve


class _EngineRunner:
    """The single-process engine at batch 1 (in this process; imports torch), for bench serve."""

    def __init__(self, args: argparse.Namespace, info: dict):
        import torch

        from specdec.core.build import build_engine
        from specdec.core.request_state import KPolicy

        if args.engine_threads:
            torch.set_num_threads(args.engine_threads)
        target = args.engine_target or info["target"]
        draft = args.engine_draft or info.get("draft") or "none"
        dtype = args.engine_dtype or info.get("dtype") or "bfloat16"
        self.policy = KPolicy(k=args.k, adaptive=not args.fixed_k, k_min=1, k_max=args.k_max)
        options = None
        if args.engine_draft_options:
            from specdec.core.draft_options import draft_options_from_dict

            options = draft_options_from_dict(json.loads(args.engine_draft_options))
        self.engine, self.parts = build_engine(
            target,
            draft,
            dtype=dtype,
            num_slots=1,
            max_len=args.engine_max_len,
            k_policy=self.policy,
            draft_options=options,
        )
        self.config = {
            "target": target,
            "draft": draft,
            "dtype": dtype,
            "k_policy": dict(self.policy.__dict__),
            "threads": torch.get_num_threads(),
            "draft_options": str(options or "default"),
        }

    def one(self, prompt, max_tokens: int) -> dict:
        from specdec.core.params import SamplingParams
        from specdec.core.prompts import encode

        ids = encode(self.parts.target.tokenizer, prompt)
        t0 = time.perf_counter()
        rid = self.engine.add_request(ids, SamplingParams(max_tokens=max_tokens, temperature=0.0))
        t_first = t_last = None
        while self.engine.has_work:
            for out in self.engine.step():
                if out.new_token_ids:
                    now = time.perf_counter()
                    t_first = t_first or now
                    t_last = now
        res = self.engine.result(rid)
        return {
            "id": prompt.id,
            "mode": "engine",
            "tokens": len(res.token_ids),
            "t_start": t0,
            "t_first": t_first,
            "t_last": t_last,
            "t_end": time.perf_counter(),
            "stats": res.stats.as_dict(),
            "finish_reason": res.finish_reason,
            "token_ids": res.token_ids,
            "error": None,
        }


def _local_tokenizer(model: str):
    """The target's tokenizer when its files are here (a prepared pack, a folder, a GGUF file or a
    pulled hub id: specdec.core.model_source), else None."""
    try:
        from transformers import AutoTokenizer

        from specdec.core.model_source import local_files

        folder, gguf_file = local_files(model)
        kwargs = {"gguf_file": gguf_file} if gguf_file else {}
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True, **kwargs)
    except Exception:  # noqa: BLE001 - optional: the server can tokenize text itself
        return None


def _servers(specs: list[str]) -> dict[str, str]:
    """``[LABEL=]HOST:PORT`` flags -> {label: address} (unlabelled: the address is the label)."""
    out = {}
    for spec in specs or ["127.0.0.1:50051"]:
        label, _, address = spec.rpartition("=")
        out[label or address] = address
    return out


def _bench_mixed(args: argparse.Namespace, prompts) -> int:
    from specdec.bench import serve as bs
    from specdec.bench.serve_mixed import MixedOptions, bench_mixed, format_mixed
    from specdec.core.prompts import encode as encode_prompt

    servers = _servers(args.server)
    try:
        info = bs.server_info(next(iter(servers.values())), args.credentials)
    except (ConnectionError, bs.BenchError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return FAILED
    tokenizer = _local_tokenizer(args.engine_target or info["target"])
    if tokenizer is None:
        print(f"error: the mixed workload needs the target's tokenizer here ({info['target']})", file=sys.stderr)
        return USAGE
    options = MixedOptions(
        streams=args.streams,
        stream_tokens=args.max_tokens,
        long_prompts=MixedOptions.long_prompts if args.long_prompts is None else args.long_prompts,
        long_tokens=MixedOptions.long_tokens if args.long_tokens is None else args.long_tokens,
        repeat=args.repeat,
        timeout=args.timeout,
    )
    result = bench_mixed(
        servers,
        prompts,
        lambda p: encode_prompt(tokenizer, p),
        options,
        progress=lambda msg: print(f"... {msg}", file=sys.stderr, flush=True),
        credentials=args.credentials,
    )
    result["server"] = info
    print(format_mixed(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.json}", file=sys.stderr)
    return OK


def _bench_serve(args: argparse.Namespace) -> int:
    from specdec.bench import serve as bs
    from specdec.bench.serve_report import format_table
    from specdec.core.prompts import PromptSetError, load_prompts

    try:
        prompts = load_prompts(args.prompts)
        args.credentials = client_credentials(args)
    except (PromptSetError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return USAGE
    if args.workload == "mixed":
        return _bench_mixed(args, prompts)
    if args.workload == "soak":
        from specdec.cli.bench_soak import bench_soak

        return bench_soak(args, prompts, next(iter(_servers(args.server).values())), _local_tokenizer)
    if args.workload == "abuse":
        from specdec.cli.bench_abuse import bench_abuse

        return bench_abuse(args, prompts, next(iter(_servers(args.server).values())))
    args.server = next(iter(_servers(args.server).values()))
    options = bs.BenchOptions(
        max_tokens=args.max_tokens,
        concurrency=tuple(args.concurrency),
        rates=tuple(args.rate),
        requests=args.requests,
        modes=tuple(args.modes),
        warmup=not args.no_warmup,
        seed=args.seed,
        metrics_url=args.metrics_url,
        timeout=args.timeout,
        apis=tuple(args.api),
        http_url=args.http,
    )

    def progress(msg: str) -> None:
        print(f"... {msg}", file=sys.stderr, flush=True)

    engine = encode = None
    try:
        info = bs.server_info(args.server, args.credentials)
        if args.engine:
            progress(f"loading the single-process engine ({args.engine_target or info['target']}) in this process")
            engine = _EngineRunner(args, info)
            if options.warmup:
                engine.one(prompts[0], 8)
            tokenizer = engine.parts.target.tokenizer
        else:
            tokenizer = _local_tokenizer(args.engine_target or info["target"])
        if tokenizer is not None:
            from specdec.core.prompts import encode as encode_prompt

            def encode(prompt):
                return encode_prompt(tokenizer, prompt)
        else:
            progress("the target's tokenizer is not available here: sending prompt text (the server tokenizes)")
        result = bs.bench_serve(
            args.server, prompts, options, progress=progress, engine=engine, encode=encode, credentials=args.credentials
        )
    except (ConnectionError, bs.BenchError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return FAILED
    text = format_table(result)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.json}", file=sys.stderr)
    return OK


def _csv_ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def _csv_floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x.strip()]


def _add_bench_serve_parser(bsub: argparse._SubParsersAction) -> None:
    p = bsub.add_parser(
        "serve",
        help="drive a running service: closed loop and Poisson arrivals; spec vs off vs the engine",
        description="N concurrent clients (closed loop) and Poisson arrivals against a running `specdec serve`; "
        "throughput, TTFT and TPOT p50/p99 and acceptance, with speculation on (AUTO) and off "
        "(per-request OFF) side by side, and the single-process engine at batch 1.",
    )
    p.add_argument(
        "--server",
        action="append",
        default=None,
        metavar="[LABEL=]HOST:PORT",
        help="the service (default 127.0.0.1:50051); the mixed workload takes several, e.g. "
        "budget=127.0.0.1:50051 --server nobudget=127.0.0.1:50052, and measures them in turn",
    )
    p.add_argument(
        "--workload",
        choices=["standard", "mixed", "soak", "abuse"],
        default="standard",
        help="standard: closed loop and Poisson scenarios; mixed: a burst of long prompts among short streams; "
        "soak: minutes of mixed load with cancels and deadlines, memory and KV slots over time; "
        "abuse: one client's wall of long prompts, a burst and never-reading streams beside another "
        "client's short request, against the idle service (and with --engine, one forward per prompt)",
    )
    p.add_argument("--soak-minutes", type=float, default=5.0, help="soak: how long")
    p.add_argument("--clients", type=int, default=4, help="soak: concurrent clients")
    p.add_argument("--sample-s", type=float, default=15.0, help="soak: seconds between samples")
    p.add_argument("--streams", type=int, default=1, help="mixed: concurrent short streams")
    p.add_argument(
        "--long-prompts", type=int, default=None, help="mixed: long prompts in the burst (4); abuse: in the wall (8)"
    )
    p.add_argument("--long-tokens", type=int, default=None, help="mixed, abuse: tokens per long prompt (3000, 4000)")
    p.add_argument("--repeat", type=int, default=1, help="mixed: runs per server (alternating servers)")
    p.add_argument("--prompts", default="humaneval:8", help="humaneval, humaneval:N, FILE.jsonl or FILE.jsonl:N")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument(
        "--concurrency",
        type=_csv_ints,
        default=[1],
        metavar="N1,N2,...",
        help="closed-loop client counts (one scenario each)",
    )
    p.add_argument(
        "--rate",
        type=_csv_floats,
        default=[],
        metavar="R1,...",
        help="Poisson arrival rates in requests/s (one open-loop scenario each)",
    )
    p.add_argument("--requests", type=int, default=None, help="requests per scenario (default: one per prompt)")
    p.add_argument(
        "--modes",
        type=lambda s: [m for m in s.split(",") if m],
        default=["auto", "off"],
        metavar="MODE,...",
        help="speculation modes to compare (auto, draft, ngram, off)",
    )
    p.add_argument(
        "--api",
        type=lambda s: [a for a in s.split(",") if a],
        default=["grpc"],
        metavar="API,...",
        help="grpc and/or http (the OpenAI-compatible gateway, streaming completions): each scenario through "
        "each, same prompts and settings, with the gateway's overhead per request and per chunk",
    )
    p.add_argument(
        "--http",
        default=None,
        metavar="URL",
        help="the gateway for --api http (default: http://<the server's host>:8000)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the Poisson arrivals")
    p.add_argument(
        "--metrics-url",
        default="auto",
        help="router /metrics URL for the round time split ('auto': the server host, port 9400; 'none' to skip)",
    )
    p.add_argument("--timeout", type=float, default=600.0, help="per-request deadline (s)")
    p.add_argument("--no-warmup", action="store_true")
    p.add_argument("--engine", action="store_true", help="also run the single-process engine at batch 1")
    p.add_argument("--engine-target", default=None, help="engine target (default: the server's target model)")
    p.add_argument("--engine-draft", default=None, help="engine draft (default: the server's draft model)")
    p.add_argument("--engine-dtype", default=None, help="engine dtype (default: the server's)")
    p.add_argument("--engine-threads", type=int, default=None, help="engine torch threads (default: torch's)")
    p.add_argument("--engine-max-len", type=int, default=4096)
    p.add_argument(
        "--engine-draft-options",
        default=None,
        metavar="JSON",
        help="engine drafter options (specdec.core.draft_options.DraftOptions), "
        'e.g. \'{"quant": null, "vocab": null}\'; '
        "match the draft worker's draft_options",
    )
    p.add_argument("--k", type=int, default=4, help="engine k (initial k when adaptive)")
    p.add_argument("--k-max", type=int, default=12)
    p.add_argument("--fixed-k", action="store_true", help="engine: fixed k instead of adaptive")
    p.add_argument("--json", default=None, metavar="OUT", help="write the full result here")
    add_client_credential_args(p)
    add_abuse_args(p)
    p.set_defaults(func=_bench_serve)


# --------------------------------------------------------------------------- registration


def _bench_subparsers(sub: argparse._SubParsersAction) -> argparse._SubParsersAction:
    bench = sub.choices.get("bench")
    if bench is None:
        bench = sub.add_parser("bench", help="benchmarks")
        return bench.add_subparsers(dest="bench_command", required=True)
    for action in bench._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action
    return bench.add_subparsers(dest="bench_command", required=True)


def add_serve(sub: argparse._SubParsersAction) -> None:
    """Register `serve`, and `serve` under the existing `bench` group (add after add_bench)."""
    _add_serve_parser(sub)
    _add_bench_serve_parser(_bench_subparsers(sub))
