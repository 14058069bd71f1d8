"""`specdec bench serve --workload soak` (specdec.bench.soak) from the command line."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

from specdec.cli.exit_codes import FAILED, OK

__all__ = ["bench_soak"]


def bench_soak(args: argparse.Namespace, prompts, address: str, local_tokenizer: Callable[[str], Any]) -> int:
    """``local_tokenizer(model)``: the target's tokenizer when it is here, else None (text is sent)."""
    from specdec.bench import serve as bs
    from specdec.bench.soak import SoakOptions, format_soak, soak
    from specdec.core.prompts import encode as encode_prompt

    try:
        info = bs.server_info(address, args.credentials)
    except (ConnectionError, bs.BenchError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return FAILED
    tokenizer = local_tokenizer(args.engine_target or info["target"])
    url = args.metrics_url
    url = f"http://{address.rsplit(':', 1)[0]}:9400/metrics" if url == "auto" else None if url == "none" else url
    options = SoakOptions(
        minutes=args.soak_minutes,
        clients=args.clients,
        max_tokens=args.max_tokens,
        sample_s=args.sample_s,
        timeout_s=args.timeout,
        seed=args.seed,
    )
    result = soak(
        address,
        prompts,
        options,
        metrics_url=url,
        encode=(lambda p: encode_prompt(tokenizer, p)) if tokenizer is not None else None,
        credentials=args.credentials,
        progress=lambda msg: print(f"... {msg}", file=sys.stderr, flush=True),
    )
    result["server"] = info
    print(format_soak(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.json}", file=sys.stderr)
    return OK
