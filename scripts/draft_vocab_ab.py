"""A/B of the draft model's lm_head subset: the first 32,768 ids + special tokens (before
2026-11-27) against ``frequency_ranked_vocab`` (those + every later id that is only whitespace and
punctuation), on the single-process engine at batch 1, prompts alternating A/B. Prints each
request's first draft next to the target's first tokens, then rounds, acceptance, tau and tok/s per
subset, and whether the outputs are identical (they must be: the target verifies). bench/NOTES.md,
2026-11-27::

    .venv/bin/python scripts/draft_vocab_ab.py --dtype float32 --prompts humaneval:4 --max-tokens 48
"""

from __future__ import annotations

import argparse
import time

import torch

from specdec.core.build import frequency_ranked_vocab
from specdec.core.drafters import DraftInput, ModelDrafter
from specdec.core.engine import SpecEngine
from specdec.core.models import load_model
from specdec.core.ngram import NgramDrafter
from specdec.core.params import SamplingParams, VerifyMode
from specdec.core.prompts import encode, load_prompts
from specdec.core.request_state import KPolicy
from specdec.core.runner import ModelRunner


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--prompts", default="humaneval:4")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    target = load_model(args.target, dtype=args.dtype)
    draft = load_model(args.draft, dtype=args.dtype)
    specials = [int(i) for i in getattr(draft.tokenizer, "added_tokens_decoder", {})]
    subsets = {
        "before": sorted(set(range(32768)) | set(specials)),
        "now": frequency_ranked_vocab(draft.tokenizer, 32768),
    }
    quant = "int8" if args.dtype == "bfloat16" else None  # as the draft worker builds it (DraftOptions)
    engines, drafters = {}, {}
    for name, vocab in subsets.items():
        runner = ModelRunner(
            draft.model, num_slots=1, max_len=4096, weight_quant=quant, vocab_subset=vocab, invariant_numerics=False
        )
        drafters[name] = ModelDrafter(runner, lookup=NgramDrafter(min_ngram=2))
        engines[name] = SpecEngine(
            ModelRunner(target.model, num_slots=1, max_len=4096),
            target.tokenizer,
            drafters[name],
            k_policy=KPolicy(k=4, adaptive=True, k_min=1, k_max=12, cost_ratio=0.2),
            eos_token_ids=target.eos_token_ids,
        )
    totals = {name: {"tokens": 0, "rounds": 0, "drafted": 0, "accepted": 0, "s": 0.0} for name in subsets}
    outputs: dict[str, list] = {name: [] for name in subsets}
    decode = target.tokenizer.decode
    for i, prompt in enumerate(load_prompts(args.prompts)):
        ids = encode(target.tokenizer, prompt)
        for name in ("before", "now") if i % 2 == 0 else ("now", "before"):
            first = drafters[name].propose([DraftInput("probe", ids, SamplingParams(), VerifyMode.GREEDY, 4)])[0]
            drafters[name].release("probe")
            t0 = time.perf_counter()
            res = engines[name].generate([ids], SamplingParams(max_tokens=args.max_tokens))[0]
            t = totals[name]
            t["s"] += time.perf_counter() - t0
            t["tokens"] += len(res.token_ids)
            t["rounds"] += res.stats.rounds
            t["drafted"] += res.stats.drafted
            t["accepted"] += res.stats.accepted
            outputs[name].append(res.token_ids)
            print(f"{prompt.id} {name}: first draft {decode(first.tokens)!r}, target {decode(res.token_ids[:4])!r}")
    for name, t in totals.items():
        print(
            f"{name}: {len(subsets[name])} ids, rounds {t['rounds']}, "
            f"acceptance {t['accepted'] / max(t['drafted'], 1):.3f}, "
            f"tau {t['tokens'] / max(t['rounds'], 1):.2f}, {t['tokens'] / t['s']:.3f} tok/s"
        )
    print("outputs identical:", outputs["before"] == outputs["now"])


if __name__ == "__main__":
    main()
