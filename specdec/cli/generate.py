"""`specdec generate`: one prompt through the single-process engine (or a server, with --server)."""

from __future__ import annotations

import argparse
import json
import sys
import time

from specdec.cli.credentials import add_client_credential_args
from specdec.core.draft_options import add_draft_option_flags, draft_options_from_args
from specdec.core.dtypes import DTYPE_NAMES

DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--seed", type=int, default=None, help="seeded sampling is reproducible (invariant mode)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--stop-token-id", action="append", type=int, default=[], help="stop token id (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")


def sampling_params(args: argparse.Namespace):
    from specdec.core.params import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=tuple(args.stop),
        stop_token_ids=tuple(args.stop_token_id),
        ignore_eos=args.ignore_eos,
    )


def _run_local(args: argparse.Namespace) -> dict:
    from specdec.core.build import build_engine
    from specdec.core.request_state import KPolicy

    params = sampling_params(args)
    t0 = time.perf_counter()
    engine, parts = build_engine(
        args.target,
        args.draft,
        dtype=args.dtype,
        device=args.device,
        num_slots=1,
        max_len=args.max_context,
        k_policy=KPolicy(k=args.k, adaptive=args.adaptive_k),
        verify_mode=args.verify,
        draft_options=draft_options_from_args(args),
        tensor_parallel=args.tp,
    )
    load_s = time.perf_counter() - t0
    from specdec.core.prompts import encode_prompt

    try:
        prompt = encode_prompt(parts.target.tokenizer, args.prompt, args.chat)
        t0 = time.perf_counter()
        (result,) = engine.generate([prompt], params)
        gen_s = time.perf_counter() - t0
    finally:
        parts.close()
    n = len(result.token_ids)
    return {
        "text": result.text,
        "token_ids": result.token_ids,
        "finish_reason": result.finish_reason,
        "stats": result.stats.as_dict(),
        "usage": {"prompt_tokens": len(prompt), "completion_tokens": n},
        "timing": {
            "load_s": round(load_s, 3),
            "generate_s": round(gen_s, 3),
            "tokens_per_s": round(n / gen_s, 2) if gen_s > 0 else None,
        },
    }


def _run_remote(args: argparse.Namespace) -> dict:
    """``specdec generate --server HOST:PORT``: the local mode's flags and JSON, over gRPC.

    Model: ``--target`` is sent as the model name unless it is the CLI's default (then the server's
    default model is used). ``--draft none|off`` -> speculation OFF, ``ngram`` -> NGRAM, anything
    else -> AUTO (the server's draft model). ``--k`` is sent as the request's k unless
    ``--adaptive-k`` (then the server's k policy). ``--dtype``, ``--device`` and ``--max-context``
    are the server's business and are ignored.
    """
    import grpc

    from specdec.cli.credentials import client_credentials
    from specdec.rpc.client import SpecdecClient

    draft = (args.draft or "").lower()
    mode = "off" if draft in ("none", "off", "") else "ngram" if draft == "ngram" else "auto"
    kwargs = dict(
        model="" if args.target in (None, DEFAULT_TARGET) else args.target,
        chat=args.chat,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=args.stop,
        stop_token_ids=args.stop_token_id,
        ignore_eos=args.ignore_eos,
        mode=mode,
        k=0 if args.adaptive_k else max(0, args.k),
        verify_mode=args.verify,
    )
    try:
        credentials = client_credentials(args)
    except (ValueError, OSError) as exc:
        raise RemoteError(f"credentials: {exc}") from None
    try:
        with SpecdecClient(args.server, credentials=credentials) as client:
            t0 = time.perf_counter()
            out = client.generate(args.prompt, **kwargs)
            gen_s = time.perf_counter() - t0
    except grpc.RpcError as exc:
        raise RemoteError(f"{args.server}: {exc.code().name}: {exc.details()}") from None
    n = len(out.token_ids)
    return {
        "text": out.text,
        "token_ids": out.token_ids,
        "finish_reason": out.finish_reason,
        "stats": out.stats,
        "usage": out.usage,
        "timing": {"generate_s": round(gen_s, 3), "tokens_per_s": round(n / gen_s, 2) if gen_s > 0 else None},
        "request_id": out.request_id,
        "server": args.server,
    }


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


class RemoteError(RuntimeError):
    """The server refused or failed the request (message: address, status code, details)."""


def _generate(args: argparse.Namespace) -> int:
    if args.server:
        try:
            out = _run_remote(args)  # imports grpc: only for --server
        except (RemoteError, ConnectionError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
    else:
        from specdec.core.tp import TPError

        try:
            out = _run_local(args)
        except TPError as exc:  # --tp that the model's heads do not allow
            print(f"error: {exc}", file=sys.stderr)
            return 1
    if args.json:
        print(json.dumps(out))
    else:
        print(out["text"])
        s = out["stats"]
        timing = out.get("timing", {})
        print(
            f"[{out['finish_reason']}] {out['usage']['completion_tokens']} tokens, "
            f"{timing.get('tokens_per_s')} tok/s, rounds {s['rounds']}, drafted {s['drafted']}, "
            f"accepted {s['accepted']} ({s['acceptance_rate']:.0%})",
            file=sys.stderr,
        )
    return 0


def add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text for one prompt with speculative decoding")
    p.add_argument("--target", default=DEFAULT_TARGET, help="pack name, HF folder, .gguf file or hub id")
    p.add_argument("--draft", default=DEFAULT_DRAFT, help="a draft model, 'ngram', or 'none'")
    p.add_argument("--prompt", required=True, help="raw text, tokenized as the tokenizer does by default")
    p.add_argument("--chat", action="store_true", help="apply the chat template to the prompt")
    add_sampling_args(p)
    p.add_argument("--k", type=int, default=4, help="draft tokens per round (fixed)")
    p.add_argument("--adaptive-k", action="store_true", help="adapt k per request from its acceptance")
    p.add_argument(
        "--verify",
        choices=["greedy", "rejection", "invariant"],
        default=None,
        help="verification mode (default: greedy at temperature 0, invariant if seeded, else rejection)",
    )
    add_draft_option_flags(p)
    p.add_argument("--dtype", default="bfloat16", choices=DTYPE_NAMES)
    p.add_argument("--device", default="cpu")
    p.add_argument("--max-context", type=int, default=4096, help="KV-cache length per sequence")
    p.add_argument("--tp", type=_positive, default=1, help="tensor-parallel ranks for the target (local processes)")
    p.add_argument("--server", default=None, metavar="HOST:PORT", help="send the request to a running service")
    add_client_credential_args(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_generate)
