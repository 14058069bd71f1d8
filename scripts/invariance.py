"""Measure per-row invariance (docs/design.md, invariant 2): which ops give a row different numbers depending on the
rest of the forward, and what the runner's invariant forward costs against the fast one.

    python scripts/invariance.py ops [--threads N] [--device cpu|cuda]
    python scripts/invariance.py cost --model smollm2-135m-instruct|random:qwen2.5-1.5b [--dtype bfloat16]
        [--threads N] [--device cpu|cuda]

`ops` prints, per op and dtype, the largest |difference| of one row's result between a reference
shape (a 1-row GEMM, a 1-query attention over exactly its keys) and other shapes of the same call.
`cost` times decode b=1, decode b=8 and a 6-token verify with both forwards interleaved in one
process (ratios are what to keep; the machine may be shared). Current figures: docs/results.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

# (rows N, columns K) of weights: SmolLM2-135M and Qwen2.5-1.5B projections, lm_heads, a tiny model.
LINEAR_SHAPES = {
    "smollm2 up": (1536, 576),
    "smollm2 down": (576, 1536),
    "smollm2 lm_head": (49152, 576),
    "qwen1.5b q": (1536, 1536),
    "qwen1.5b up": (8960, 1536),
    "qwen1.5b down": (1536, 8960),
    "tiny": (64, 64),
}
ATTN_SHAPES = {"smollm2 9/3x64": (9, 3, 64), "qwen1.5b 12/2x128": (12, 2, 128)}


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def probe_ops(device: str) -> list[dict]:
    from specdec.core.attention import hidden_keys_bias, invariant_attention, padded_span, query_width

    gen = torch.Generator(device="cpu").manual_seed(0)
    rnd = lambda *shape: torch.randn(*shape, generator=gen).to(device)  # noqa: E731
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        for name, (n, k) in LINEAR_SHAPES.items():
            w, x = (rnd(n, k) * 0.05).to(dtype), rnd(256, k).to(dtype)
            out = {m: F.linear(x[:m], w) for m in range(1, 257)}
            cases = {
                "M=2-3 vs M=1": [(m, 1, 1) for m in (2, 3)],
                "M=4-256 vs M=1": [(m, 1, 1) for m in range(4, 257)],
                "M=5-11, not a multiple of 4, vs M=12": [(m, 12, m) for m in range(5, 12) if m % 4],
                "M=8-256, a multiple of 4, vs M=8": [(m, 8, 8) for m in range(8, 257, 4)],
            }
            for case, pairs in cases.items():
                worst = max(_diff(out[m][:r], out[ref][:r]) for m, ref, r in pairs)
                rows.append(dict(op="linear", shape=name, dtype=str(dtype), case=case, diff=worst))
        for name, (h, hkv, d) in ATTN_SHAPES.items():
            worst: dict[str, float] = {}
            for p in (5, 100, 511, 700):
                keys, vals = rnd(2, hkv, 1024, d).to(dtype), rnd(2, hkv, 1024, d).to(dtype)
                q = rnd(2, h, 13, d).to(dtype)

                def sdpa(qq, s, mask=None, b=1, keys=keys, vals=vals):
                    return F.scaled_dot_product_attention(
                        qq, keys[:b, :, :s], vals[:b, :, :s], attn_mask=mask, enable_gqa=True
                    )

                ref = sdpa(q[:1, :, :1], p + 1)
                key = torch.arange(1024, device=device)
                cases = {
                    "sdpa: span +37 masked": sdpa(q[:1, :, :1], p + 38, (key[: p + 38] <= p)[None, None, None]),
                    "sdpa: verify T=6": sdpa(
                        q[:1, :, :6], p + 6, (key[: p + 6] <= p + torch.arange(6, device=device)[:, None])[None, None]
                    )[:, :, :1],
                    "sdpa: batch of 2 rows": sdpa(
                        q[:, :, :1],
                        p + 200,
                        torch.stack([key[: p + 200] <= p, key[: p + 200] <= p + 199])[:, None, None],
                        b=2,
                    )[:1],
                }
                width = query_width(1, h, hkv)  # a 1-token decode in the invariant forward
                pos = p + torch.arange(13, device=device)
                ref_inv = invariant_attention(
                    q[:1, :, :width],
                    keys[:1, :, : padded_span(p + width)],
                    vals[:1, :, : padded_span(p + width)],
                    hidden_keys_bias(pos[None, :width], padded_span(p + width)),
                    d**-0.5,
                )
                big = invariant_attention(
                    q[:, :, :12],
                    keys[:, :, :1024],
                    vals[:, :, :1024],
                    hidden_keys_bias(torch.stack([pos[:12], pos[:12] + 200]), 1024),
                    d**-0.5,
                )
                cases[f"invariant: 2 rows, T=12, span 1024 vs T={width}"] = big[:1, :, :1]
                for c, out in cases.items():
                    base = ref_inv[:, :, :1] if c.startswith("invariant") else ref
                    worst[c] = max(worst.get(c, 0.0), _diff(out, base))
            for c, v in worst.items():
                rows.append(dict(op="attention", shape=name, dtype=str(dtype), case=c, diff=v))
        x = rnd(512, 1536).to(dtype)
        wn = rnd(1536).to(dtype)

        def rms(t, wn=wn):
            h32 = t.float()
            return wn * (h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + 1e-5)).to(t.dtype)

        rows.append(
            dict(
                op="rmsnorm",
                shape="1536",
                dtype=str(dtype),
                case="M=1..512 vs M=1",
                diff=max(_diff(rms(x[:m])[:1], rms(x[:1])) for m in (2, 3, 13, 512)),
            )
        )
        g = (rnd(1 << 14) * 4).to(dtype)
        alone = torch.cat([F.silu(g[i : i + 1]) for i in range(512)])
        rows.append(
            dict(
                op="F.silu",
                shape="elementwise",
                dtype=str(dtype),
                case="1 element vs inside 16384",
                diff=_diff(alone, F.silu(g)[:512]),
            )
        )
    return rows


def _load(model_spec: str, dtype, device: str = "cpu", layers: int | None = None):
    """A model pack / hub id / folder, or `random:qwen2.5-1.5b` (random weights, that shape;
    ``layers``: only that many of its layers)."""
    from specdec.core.models import load_model

    if not model_spec.startswith("random:"):
        return load_model(model_spec, dtype=dtype, device=device).model
    import random_models  # scripts/random_models.py: the shapes every GPU script builds

    return random_models.build(model_spec.removeprefix("random:"), dtype, device, layers=layers)


def time_cost(model_spec: str, dtype: str, context_len: int, repeat: int, device: str = "cpu") -> dict:
    """Median per-call ms of both forwards and the median of the paired ratios (invariant / fast,
    each pair run back to back), in wall and in CPU time (with one thread on a shared machine the
    CPU time is the steadier)."""
    from specdec.core.runner import ModelRunner

    runner = ModelRunner(_load(model_spec, dtype, device), num_slots=8, max_len=context_len + 16)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    context = list(range(100, 100 + context_len))
    slots = [runner.alloc_slot() for _ in range(8)]
    runner.forward(slots, [context] * 8, num_logits=0)
    cases = {"decode b=1": (1, 1), "decode b=8": (8, 1), "verify 6 tokens b=1": (1, 6), "verify 6 tokens b=8": (8, 6)}
    out = {}
    for name, (batch, new) in cases.items():
        times: dict[tuple[bool, str], list[float]] = {
            (inv, clock): [] for inv in (False, True) for clock in ("wall", "cpu")
        }
        for i in range(repeat + 2):
            for invariant in (False, True):
                sync()
                w0, c0 = time.perf_counter(), time.process_time()
                runner.forward(slots[:batch], [[7] * new] * batch, num_logits=new, invariant=invariant)
                sync()
                if i >= 2:  # warm-up
                    times[invariant, "wall"].append((time.perf_counter() - w0) * 1e3)
                    times[invariant, "cpu"].append((time.process_time() - c0) * 1e3)
                for s in slots[:batch]:
                    runner.rollback(s, context_len)
        row = {}
        for clock in ("wall", "cpu"):
            fast, inv = times[False, clock], times[True, clock]
            row[f"{clock} ms fast, invariant"] = [round(statistics.median(fast), 2), round(statistics.median(inv), 2)]
            row[f"{clock} cost"] = round(statistics.median(b / a for a, b in zip(fast, inv)) - 1, 3)
        out[name] = row
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=("ops", "cost"))
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=15)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.what == "ops":
        for row in probe_ops(args.device):
            print(f"{row['op']:10} {row['shape']:18} {row['dtype']:15} {row['case']:45} {row['diff']:.3g}")
    else:
        result = time_cost(args.model, args.dtype, args.context, args.repeat, args.device)
        print(
            json.dumps(
                dict(
                    model=args.model,
                    dtype=args.dtype,
                    context=args.context,
                    threads=torch.get_num_threads(),
                    device=args.device,
                    cases=result,
                ),
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
