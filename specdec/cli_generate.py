"""`specdec generate`: one prompt through the single-process engine (or a server, with --server)."""

from __future__ import annotations

import argparse
import json
import sys
import time

DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"


def encode_prompt(tokenizer, text: str, chat: bool) -> list[int]:
    """Raw text is tokenized as the tokenizer does by default; --chat applies the chat template."""
    if chat:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    return list(tokenizer(text)["input_ids"])


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
    from specdec.params import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.seed, stop=tuple(args.stop),
                          stop_token_ids=tuple(args.stop_token_id), ignore_eos=args.ignore_eos)


def _run_local(args: argparse.Namespace) -> dict:
    from specdec.build import DraftOptions, build_engine
    from specdec.scheduler import KPolicy

    params = sampling_params(args)
    t0 = time.perf_counter()
    engine, parts = build_engine(args.target, args.draft, dtype=args.dtype, device=args.device, num_slots=1,
                                 max_len=args.max_context,
                                 k_policy=KPolicy(k=args.k, adaptive=args.adaptive_k),
                                 verify_mode=args.verify,
                                 draft_options=DraftOptions(quant=args.draft_quant, vocab=args.draft_vocab or None,
                                                            lookup=args.draft_lookup == "on"))
    load_s = time.perf_counter() - t0
    prompt = encode_prompt(parts.target.tokenizer, args.prompt, args.chat)
    t0 = time.perf_counter()
    (result,) = engine.generate([prompt], params)
    gen_s = time.perf_counter() - t0
    n = len(result.token_ids)
    return {
        "text": result.text, "token_ids": result.token_ids, "finish_reason": result.finish_reason,
        "stats": result.stats.as_dict(),
        "usage": {"prompt_tokens": len(prompt), "completion_tokens": n},
        "timing": {"load_s": round(load_s, 3), "generate_s": round(gen_s, 3),
                   "tokens_per_s": round(n / gen_s, 2) if gen_s > 0 else None},
    }


def _generate(args: argparse.Namespace) -> int:
    if args.server:
        from specdec.rpc.client import RemoteError, run_remote  # lazy: grpc only for --server

        try:
            out = run_remote(args)
        except (RemoteError, ConnectionError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
    else:
        out = _run_local(args)
    if args.json:
        print(json.dumps(out))
    else:
        print(out["text"])
        s = out["stats"]
        timing = out.get("timing", {})
        print(f"[{out['finish_reason']}] {out['usage']['completion_tokens']} tokens, "
              f"{timing.get('tokens_per_s')} tok/s, rounds {s['rounds']}, drafted {s['drafted']}, "
              f"accepted {s['accepted']} ({s['acceptance_rate']:.0%})", file=sys.stderr)
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
    p.add_argument("--verify", choices=["greedy", "rejection", "invariant"], default=None,
                   help="verification mode (default: greedy at temperature 0, invariant if seeded, else rejection)")
    p.add_argument("--draft-quant", choices=["int8", "none"], default="int8",
                   help="weight-only int8 for the draft model (CPU); the target is never changed")
    p.add_argument("--draft-vocab", type=int, default=32768,
                   help="draft lm_head over the N most frequent ids + special tokens (0 = full vocabulary)")
    p.add_argument("--draft-lookup", choices=["on", "off"], default="on",
                   help="the draft model also checks prompt-lookup guesses, drafting copied text in one forward")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--max-context", type=int, default=4096, help="KV-cache length per sequence")
    p.add_argument("--server", default=None, metavar="HOST:PORT", help="send the request to a running service")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_generate)
