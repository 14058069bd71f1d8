"""`specdec bench runner`: our runner vs transformers' forward with its own cache, side by side, and
the runner with its weights in the plain layout (specdec/core/packed.py: what packing buys); with
``--prefill``, a long prompt in one forward beside the same prompt in chunks."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch

from specdec.core.models import load_model
from specdec.core.packed import PackedWeight
from specdec.core.runner import ModelRunner


@dataclass
class Case:
    name: str
    runner_ms: float
    transformers_ms: float
    plain_ms: float  # the runner over plain [out, in] weights (F.linear), where packing applies

    @property
    def speedup(self) -> float:  # > 1: the runner is faster
        return self.transformers_ms / self.runner_ms


def median_ms(fn: Callable[[], None], repeat: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _hf_case(model, batch: int, context: list[int], new: int, repeat: int) -> float:
    from transformers import DynamicCache

    ids = torch.tensor([context] * batch)
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        model(input_ids=ids, past_key_values=cache, use_cache=True)
        step = torch.tensor([[7] * new] * batch)

        def run():
            model(input_ids=step, past_key_values=cache, use_cache=True)
            cache.crop(-new)  # back to the same context every repeat

        return median_ms(run, repeat)


def forward_times(
    runner: ModelRunner, batch: int, context: list[int], sizes: Sequence[int], repeat: int, warmup: int = 2
) -> dict[int, float]:
    """Median ms of the runner's forward over ``batch`` rows of n new tokens each (logits for all
    n, as a verify), for each n in ``sizes``, after ``context`` cached tokens per row (cached once)."""
    slots = [runner.alloc_slot() for _ in range(batch)]
    try:
        if context:
            runner.forward(slots, [context] * batch, num_logits=0)
        out = {}
        for new in sizes:
            feeds = [[7] * new] * batch

            def run(feeds=feeds, new=new):
                runner.forward(slots, feeds, num_logits=new)
                for s in slots:
                    runner.rollback(s, len(context))

            out[new] = median_ms(run, repeat, warmup)
        return out
    finally:
        for s in slots:
            runner.free_slot(s)


def _runner_case(runner: ModelRunner, batch: int, context: list[int], new: int, repeat: int) -> float:
    return forward_times(runner, batch, context, (new,), repeat)[new]


CASES = (("decode b=1", 1, 1), ("decode b=8", 8, 1), ("verify 5 tokens b=1", 1, 5))


def _onednn_layout(runner: ModelRunner) -> bool:
    """Whether the runner's weights are in oneDNN's layout, which plain weights are compared with
    (the compiled bf16 loop packs plain weights for every call: no layout to compare there)."""
    head = runner.lm_head
    return runner.packed and not (isinstance(head, PackedWeight) and head.panels)


def bench_runner(
    model_spec: str,
    dtype: str = "bfloat16",
    context_len: int = 128,
    repeat: int = 10,
    threads: int | None = None,
    progress: Callable[[str], None] = lambda _: None,
) -> dict:
    if threads:
        torch.set_num_threads(threads)
    loaded = load_model(model_spec, dtype=dtype)
    runner = ModelRunner(loaded.model, num_slots=8, max_len=context_len + 8)
    plain = ModelRunner(loaded.model, num_slots=8, max_len=context_len + 8, pack_weights=False)
    context = list(range(100, 100 + context_len))
    cases = []
    for name, batch, new in CASES:
        progress(name)
        r = _runner_case(runner, batch, context, new, repeat)
        t = _hf_case(loaded.model, batch, context, new, repeat)
        p = _runner_case(plain, batch, context, new, repeat) if _onednn_layout(runner) else r
        cases.append(Case(name, r, t, p))
    return {
        "model": model_spec,
        "dtype": dtype,
        "context_len": context_len,
        "repeat": repeat,
        "threads": torch.get_num_threads(),
        "packed": runner.packed,
        "cases": [asdict(c) | {"speedup": round(c.speedup, 3)} for c in cases],
    }


def forward_sweep(
    model_spec: str,
    sizes: tuple[int, ...],
    dtype: str = "bfloat16",
    context_len: int = 168,
    repeat: int = 7,
    threads: int | None = None,
    as_draft: bool = False,
) -> dict:
    """The runner's forward time by tokens per forward (one sequence): how a verify of k + 1 tokens,
    or a draft forward with lookup guesses, grows with k. `as_draft` builds the runner as the
    drafters do (specdec.core.draft_options.DraftOptions: int8 weights, vocabulary subset)."""
    from specdec.core.build import make_draft_runner

    if threads:
        torch.set_num_threads(threads)
    loaded = load_model(model_spec, dtype=dtype)
    max_len = context_len + max(sizes) + 1
    runner = make_draft_runner(loaded, 1, max_len) if as_draft else ModelRunner(loaded.model, 1, max_len)
    context = list(range(100, 100 + context_len))
    with torch.inference_mode():
        ms = forward_times(runner, 1, context, sizes, repeat)
    return {
        "model": model_spec,
        "dtype": dtype,
        "as_draft": as_draft,
        "context_len": context_len,
        "repeat": repeat,
        "threads": torch.get_num_threads(),
        "forward_ms": {str(n): round(v, 2) for n, v in ms.items()},
        "relative_to_one_token": {str(n): round(v / ms[sizes[0]], 3) for n, v in ms.items()},
    }


def format_sweep(result: dict) -> str:
    lines = [
        f"{result['model']} ({result['dtype']}{', as a draft' if result['as_draft'] else ''}, context "
        f"{result['context_len']}, {result['threads']} threads, median of {result['repeat']})",
        f"{'tokens':>8}{'ms':>10}{'relative':>10}",
    ]
    for n, v in result["forward_ms"].items():
        lines.append(f"{n:>8}{v:>10.1f}{result['relative_to_one_token'][n]:>9.2f}x")
    return "\n".join(lines)


def format_table(result: dict) -> str:
    lines = [
        f"{result['model']} ({result['dtype']}, context {result['context_len']}, "
        f"{result['threads']} threads, median of {result['repeat']})",
        f"{'case':<22}{'runner ms':>12}{'transformers ms':>17}{'ratio':>8}{'plain weights ms':>18}{'ratio':>8}",
    ]
    for c in result["cases"]:
        lines.append(
            f"{c['name']:<22}{c['runner_ms']:>12.1f}{c['transformers_ms']:>17.1f}{c['speedup']:>7.2f}x"
            f"{c['plain_ms']:>18.1f}{c['plain_ms'] / c['runner_ms']:>7.2f}x"
        )
    if not result["packed"]:
        lines.append("(oneDNN cannot pack these weights here: the runner ran on plain weights)")
    return "\n".join(lines)


def prefill_runner(model_spec: str, dtype: str, max_len: int, threads: int | None = None) -> ModelRunner:
    """A one-slot runner of ``model_spec`` for prompts up to ``max_len`` tokens, its kernels loaded
    (a short forward) so the first timed prefill does not pay for them."""
    if threads:
        torch.set_num_threads(threads)
    loaded = load_model(model_spec, dtype=dtype)
    runner = ModelRunner(loaded.model, num_slots=1, max_len=max_len + 1)
    warm = runner.alloc_slot()
    runner.forward([warm], [[100 + i for i in range(8)]], num_logits=1)
    runner.free_slot(warm)
    return runner


def prefill_seconds(
    runner: ModelRunner, prompt: Sequence[int], chunk: int | None = None, invariant: bool | None = None
) -> tuple[float, torch.Tensor]:
    """Seconds to prefill ``prompt`` into a fresh slot in chunks of ``chunk`` tokens (None: one
    forward), and the last token's logits. ``invariant``: the runner's default when None (what a
    target worker runs)."""
    chunk = chunk or len(prompt)
    slot = runner.alloc_slot()
    try:
        t0 = time.perf_counter()
        for at in range(0, len(prompt), chunk):
            piece = prompt[at : at + chunk]
            logits = runner.forward([slot], [piece], num_logits=int(at + chunk >= len(prompt)), invariant=invariant)
        return time.perf_counter() - t0, logits[0]
    finally:
        runner.free_slot(slot)


def prefill_times(
    model_spec: str,
    chunks: Sequence[int],
    dtype: str = "float32",
    context_len: int = 4000,
    threads: int | None = None,
) -> dict:
    """Seconds to prefill one prompt of ``context_len`` tokens in one forward and in chunks of each
    size in ``chunks``, with the invariant forward (what a greedy or seeded request's prefill runs)
    and the fast one (SDPA). Each invariant way must give the last token bitwise equal logits."""
    runner = prefill_runner(model_spec, dtype, context_len, threads)
    prompt = [100 + (i * 7919) % (runner.vocab_size - 100) for i in range(context_len)]
    rows = []
    for invariant in (True, False):
        want = None
        for chunk in (context_len, *chunks):
            seconds, logits = prefill_seconds(runner, prompt, chunk, invariant)
            want = logits if want is None else want
            rows.append(
                {
                    "invariant": invariant,
                    "chunk": chunk,
                    "seconds": round(seconds, 4),
                    "same_logits": bool(torch.equal(logits, want)),
                }
            )
    return {
        "model": model_spec,
        "dtype": dtype,
        "context_len": context_len,
        "threads": torch.get_num_threads(),
        "rows": rows,
    }


def unchunked_prefills(
    model_spec: str,
    prompts: Sequence[Sequence[int]],
    dtype: str = "float32",
    threads: int | None = None,
    progress: Callable[[str], None] = lambda _: None,
) -> dict:
    """Each prompt prefilled in one forward, one after the other, in this process: the reference a
    service's chunked prefill of the same prompts is held to (`specdec bench serve --workload abuse`)."""
    runner = prefill_runner(model_spec, dtype, max(len(p) for p in prompts), threads)
    seconds = []
    for i, p in enumerate(prompts):
        seconds.append(prefill_seconds(runner, p)[0])
        progress(f"reference: prompt {i + 1}/{len(prompts)} of {len(p)} tokens in {seconds[-1]:.1f} s")
    return {
        "model": model_spec,
        "dtype": dtype,
        "threads": torch.get_num_threads(),
        "prompt_tokens": [len(p) for p in prompts],
        "seconds": [round(s, 4) for s in seconds],
        "total_s": round(sum(seconds), 4),
    }


def format_prefill(result: dict) -> str:
    lines = [
        f"{result['model']} ({result['dtype']}, a {result['context_len']}-token prompt, {result['threads']} threads)",
        f"{'forward':<10}{'chunk':>7}{'seconds':>10}{'vs one':>8}  last logits as one forward",
    ]
    one = {}
    for r in result["rows"]:
        one.setdefault(r["invariant"], r["seconds"])
        lines.append(
            f"{'invariant' if r['invariant'] else 'fast':<10}{r['chunk']:>7}{r['seconds']:>10.2f}"
            f"{r['seconds'] / one[r['invariant']]:>7.2f}x  {'bitwise' if r['same_logits'] else 'differ'}"
        )
    return "\n".join(lines)
