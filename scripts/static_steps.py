"""Time the runner's static-shape steps (specdec/core/static_step.py) against its eager forward, and
check that they give the same logits.

    python scripts/static_steps.py [--model smollm2-135m-instruct|random:qwen2.5-1.5b] [--dtype bfloat16]
        [--context 128] [--max-len 512] [--repeat 15] [--min-span 256] [--threads N] [--device cpu|cuda]

Two runners over one model, the same context cached in 8 slots: one eager, one with static shapes
(on a GPU, its buckets captured as CUDA graphs first; the capture's time and memory are printed).
Decode b=1, decode b=8 and a 5-token verify at b=8 run back to back on both, rolled back after each
call; prints the median ms of each, the median of the paired ratios (static / eager), and whether
every call's logits were bitwise equal (in invariant numerics they must be: docs/design.md,
invariant 2). Ratios are what to keep: the machine may be shared. Current figures: docs/results.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from invariance import _load  # scripts/invariance.py: model packs and random:<shape> models

from specdec.core.runner import ModelRunner
from specdec.core.static_step import MIN_SPAN, StaticSteps

CASES = {"decode b=1": (1, 1), "decode b=8": (8, 1), "verify 5 tokens b=8": (8, 5)}


def compare(
    model_spec: str, dtype: str, context_len: int, max_len: int, repeat: int, min_span: int, device: str
) -> dict:
    """`max_len` sets the span buckets: the static step attends over the smallest that holds the
    context (at least `min_span` keys), the eager forward over the context rounded to a key block."""
    model = _load(model_spec, dtype, device)
    eager = ModelRunner(model, num_slots=8, max_len=max_len, static_shapes=False)
    static = ModelRunner(model, num_slots=8, max_len=max_len, static_shapes=True)
    static.static = StaticSteps(static, static.static_max_width, min_span=min_span)
    captured = static.capture()
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    context = list(range(100, 100 + context_len))
    slots = [eager.alloc_slot() for _ in range(8)]
    for runner in (eager, static):
        if runner is static:
            [static.alloc_slot() for _ in range(8)]
        runner.forward(slots, [context] * 8, num_logits=0)
    out = {}
    for name, (batch, new) in CASES.items():
        times: dict[str, list[float]] = {"eager": [], "static": []}
        logits, equal = {}, True
        for i in range(repeat + 2):
            for label, runner in (("eager", eager), ("static", static)):
                sync()
                t0 = time.perf_counter()
                logits[label] = runner.forward(slots[:batch], [[7 + i] * new] * batch, num_logits=new)
                sync()
                if i >= 2:  # warm-up
                    times[label].append((time.perf_counter() - t0) * 1e3)
                for s in slots[:batch]:
                    runner.rollback(s, context_len)
            equal &= all(torch.equal(a, b) for a, b in zip(logits["eager"], logits["static"]))
        ratios = [s / e for e, s in zip(times["eager"], times["static"])]
        out[name] = {
            "ms eager, static": [round(statistics.median(times[k]), 2) for k in ("eager", "static")],
            "static / eager": round(statistics.median(ratios), 3),
            "logits equal": equal,
        }
    buckets = captured["buckets"]
    return {"cases": out, "captured": {**captured, "buckets": len(buckets)}, "spans": static.static.spans}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--min-span", type=int, default=MIN_SPAN)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    result = compare(args.model, args.dtype, args.context, args.max_len, args.repeat, args.min_span, args.device)
    settings = dict(model=args.model, dtype=args.dtype, context=args.context, max_len=args.max_len)
    settings["threads"] = torch.get_num_threads()
    print(json.dumps(dict(settings, device=args.device, min_span=args.min_span, **result), indent=1))


if __name__ == "__main__":
    main()
