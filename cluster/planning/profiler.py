"""``specdec profile``: measure on this machine what the simulator's cost and acceptance models need.

In order, each within what is left of ``budget_s`` (a part that does not fit is listed in the
profile's ``skipped``): the target's forward by (batch, tokens per row) and its prefill by prompt
length; the same for the draft model built as the draft worker builds it (int8, vocabulary subset,
lookup guesses); then the acceptance run: each prompt through the single-process engine at batch 1
with the router's k policy, once per drafter (the draft model, the n-gram drafter), recording
every round's k, drafted and accepted tokens and the drafting time, and for the draft model how
far it agrees with the target's greedy output from each position (`greedy_path.py`). Router and RPC overheads come
from a `specdec bench serve` result (:func:`cluster.planning.calibration.overhead_from_bench`), or
stay at their defaults.
A part's cells are timed in interleaved passes and made monotone (:func:`_passes`,
:mod:`cluster.planning.monotone`).
"""

from __future__ import annotations

import logging
import math
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from cluster.planning.calibration import least_squares_line
from cluster.planning.greedy_path import draft_agreement
from cluster.planning.monotone import isotonic, monotone_grid
from cluster.planning.profile import Curve, DrafterStats, Grid, Overhead, Profile, RequestRounds
from specdec.bench.runner import median_ms
from specdec.core.request_state import KPolicy

log = logging.getLogger(__name__)

__all__ = ["ProfileOptions", "take_profile"]


@dataclass
class ProfileOptions:
    dtype: str = "bfloat16"
    device: str = "cpu"
    prompts: str = "humaneval:8"
    max_tokens: int = 128
    budget_s: float = 600.0
    threads: int | None = None
    batches: tuple[int, ...] = (1, 2, 4, 8)
    tokens: tuple[int, ...] = (1, 2, 4, 8, 13)
    draft_tokens: tuple[int, ...] = (1, 2, 4)
    draft_ks: tuple[int, ...] = (1, 2, 4, 8, 12)  # Propose lengths timed
    context: int = 168
    prefill_lengths: tuple[int, ...] = (16, 64, 128, 256, 512)
    repeat: int = 3
    k_policy: KPolicy = field(default_factory=lambda: KPolicy(k=4, adaptive=True, k_min=1, k_max=12, cost_ratio=0.2))
    drafters: tuple[str, ...] = ("draft", "ngram")


class _Budget:
    """The time, shared out between the parts: each part ends by its point of the budget (its
    share and those before it) and always gets its first measurement while any time is left, so a
    slow machine yields a coarser profile of every part rather than a fine grid and nothing else.
    The parts without which the profile predicts nothing (the target's forwards and prefill, the
    acceptance run) always get their first measurements (the one overrun the budget allows): one,
    and two prompt lengths for the target's prefill (a forward's time has a fixed part, which one
    point would leave out: its curve then prices a prefill in proportion to its tokens). The clock
    starts once the models are loaded."""

    def __init__(self, seconds: float, progress: Callable[[str], None]):
        self.t0 = time.monotonic()
        self.seconds = seconds
        self.progress = progress
        self.skipped: list[str] = []
        self.part_end = math.inf
        self.taken = 0  # measurements of the current part

    def part(self, until: float) -> None:
        """The next part ends at ``until`` x the budget from the start."""
        self.part_end = self.t0 + until * self.seconds
        self.taken = 0

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def left(self) -> float:
        return self.seconds - self.elapsed

    def allow(self, part: str, estimate_s: float = 0.0, must: int = 0) -> bool:
        """Whether to measure ``part`` now; the first ``must`` measurements of a part always are."""
        in_part = self.taken == 0 or time.monotonic() + estimate_s < self.part_end
        if (self.left() > estimate_s and in_part) or self.taken < must:
            self.taken += 1
            self.progress(f"[{self.elapsed:6.1f} s] {part}")
            return True
        self.progress(f"[{self.elapsed:6.1f} s] skipped (budget): {part}")
        self.skipped.append(part)
        return False


def _machine(threads: int) -> dict:
    import torch
    import transformers

    load = os.getloadavg() if hasattr(os, "getloadavg") else (0.0, 0.0, 0.0)
    return {
        "host": platform.node(),
        "platform": platform.platform(),
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "threads": threads,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "load_avg_1m_start": round(load[0], 2),
    }


def _device_name(device: str) -> str:
    import torch

    if device.startswith("cuda"):
        return f"cuda: {torch.cuda.get_device_name(0)}"
    return f"cpu: {platform.processor() or platform.machine()}, {os.cpu_count()} cores"


def _model_info(loaded, dtype: str) -> dict:
    cfg = loaded.model.config
    heads = int(cfg.num_attention_heads)
    return {
        "model": loaded.name,
        "dtype": dtype,
        "config": {
            "layers": int(cfg.num_hidden_layers),
            "hidden": int(cfg.hidden_size),
            "heads": heads,
            "kv_heads": int(getattr(cfg, "num_key_value_heads", heads)),
            "head_dim": int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads),
            "vocab": int(cfg.vocab_size),
            "params": int(sum(p.numel() for p in loaded.model.parameters())),
        },
    }


def _ids(n: int) -> list[int]:
    """Placeholder token ids for timing (ids every vocabulary has)."""
    return [7 + i % 97 for i in range(n)]


def _passes(samples: dict, time_once: Callable[[Any], float], repeat: int, budget: _Budget, what: str) -> None:
    """Passes 2..``repeat``: every cell timed once per pass, in turn. A cell's repeats spread over the
    whole part rather than run back to back, so the machine's slow and fast windows (seconds long
    on a shared VM) fall on every cell alike and the grid keeps its shape."""
    pass_s = sum(statistics.median(v) for v in samples.values()) / 1e3
    for p in range(2, repeat + 1):
        if not budget.allow(f"{what}: pass {p} of {repeat}", pass_s):
            break
        for key in samples:
            samples[key].append(time_once(key))


def _cell_medians(samples: dict, keys: list) -> list[float]:
    return [statistics.median(samples[key]) for key in keys]


def _grid(runner, opts: ProfileOptions, sizes: tuple[int, ...], budget: _Budget, what: str) -> Grid | None:
    """Forward ms by (batch, tokens per row) after ``opts.context`` cached tokens per row: one
    timing of each cell batch by batch (as far as the budget goes), then more passes over the grid
    (:func:`_passes`); the medians made monotone (:mod:`cluster.planning.monotone`)."""
    context = _ids(opts.context)
    held: dict[int, list[int]] = {}  # batch -> its slots, each holding the context

    def time_once(key: tuple[int, int]) -> float:
        b, n = key
        slots = held[b]
        t0 = time.perf_counter()
        runner.forward(slots, [[7] * n] * b, num_logits=n)
        ms = (time.perf_counter() - t0) * 1e3
        for s in slots:
            runner.rollback(s, len(context))
        return ms

    samples: dict[tuple[int, int], list[float]] = {}
    try:
        for b in opts.batches:
            if not budget.allow(
                f"{what} forward, batch {b}, tokens per row {list(sizes)}", 0.0, must=int(what == "target")
            ):
                break
            held[b] = [runner.alloc_slot() for _ in range(b)]
            runner.forward(held[b], [context] * b, num_logits=0)
            for n in sizes:
                time_once((b, n))  # warm-up
                samples[b, n] = [time_once((b, n))]
        _passes(samples, time_once, opts.repeat, budget, f"{what} forward grid")
    finally:
        for slots in held.values():
            for s in slots:
                runner.free_slot(s)
    if not held:
        return None
    batches = list(held)
    rows = monotone_grid([_cell_medians(samples, [(b, n) for n in sizes]) for b in batches])
    block = runner.gemm_block if runner.invariant_numerics else None
    return Grid(batches, list(sizes), [[round(v, 3) for v in r] for r in rows], opts.context, block)


def _prefill_curve(runner, opts: ProfileOptions, budget: _Budget, what: str) -> Curve | None:
    """Prefill ms by prompt length, timed like :func:`_grid` (a first pass, then interleaved
    passes), made monotone."""
    slot = runner.alloc_slot()

    def time_once(n: int) -> float:
        t0 = time.perf_counter()
        runner.forward([slot], [_ids(n)], num_logits=0)
        ms = (time.perf_counter() - t0) * 1e3
        runner.rollback(slot, 0)
        return ms

    samples: dict[int, list[float]] = {}
    try:
        for n in opts.prefill_lengths:
            must = 2 if what == "target" else 0
            if n + 1 > runner.max_len or not budget.allow(f"{what} prefill of {n} tokens", 0.0, must=must):
                break
            time_once(n)  # warm-up
            samples[n] = [time_once(n)]
        _passes(samples, time_once, opts.repeat, budget, f"{what} prefill")
    finally:
        runner.free_slot(slot)
    if not samples:
        return None
    lengths = list(samples)
    return Curve(lengths, [round(v, 3) for v in isotonic(_cell_medians(samples, lengths))])


def _time_proposes(drafter, seqs: list[list[int]], ks: tuple[int, ...], repeat: int, max_tokens: int) -> list[float]:
    from specdec.core.drafters import DraftInput
    from specdec.core.params import SamplingParams, VerifyMode

    params = SamplingParams(max_tokens=max_tokens)
    ids = [f"p{i}" for i in range(len(seqs))]

    def propose(k: int) -> None:
        drafts = drafter.propose([DraftInput(r, s, params, VerifyMode.GREEDY, k) for r, s in zip(ids, seqs)])
        for s, d in zip(seqs, drafts):
            s.extend(d.tokens[:k] or [7])

    try:
        propose(1)  # caches the prompts
        return [round(median_ms(lambda k=k: propose(k), repeat, warmup=1), 3) for k in ks]
    finally:
        for r in ids:
            drafter.release(r)


def _propose_grid(d_runner, prompt_ids: list[list[int]], opts: ProfileOptions, budget: _Budget) -> Grid | None:
    """A draft worker's Propose by (batch, k): B of the workload's prompts, each round continuing
    from the last draft (all accepted), the prefill untimed; made monotone like the forward grid."""
    from specdec.core.build import model_drafter_on

    ks = tuple(k for k in opts.draft_ks if k <= opts.k_policy.k_max) or (1,)
    rows, batches = [], []
    for b in opts.batches:
        if not budget.allow(f"draft Propose, batch {b}, k {list(ks)}", 0.0):
            break
        seqs = [list(prompt_ids[i % len(prompt_ids)]) for i in range(b)]
        rows.append(_time_proposes(model_drafter_on(d_runner), seqs, ks, opts.repeat, opts.max_tokens))
        batches.append(b)
    return Grid(batches, list(ks), [[round(v, 3) for v in r] for r in monotone_grid(rows)], 0) if rows else None


class _Recorder:
    """A drafter that notes each proposal's k, its draft length and its time."""

    def __init__(self, inner):
        self.inner = inner
        self.calls: list[tuple[int, int, float]] = []

    def propose(self, inputs):
        t0 = time.perf_counter()
        drafts = self.inner.propose(inputs)
        dt = time.perf_counter() - t0
        for inp, d in zip(inputs, drafts):
            self.calls.append((inp.k, min(len(d.tokens), inp.k), dt))
        return drafts

    def prefill(self, inputs):
        self.inner.prefill(inputs)

    def release(self, request_id):
        self.inner.release(request_id)


def _fit_draft_ms(samples: list[tuple[int, float]]) -> tuple[float, float]:
    """ms = fixed + per_token x k over (k, ms) samples; all per token when the line says nothing sane."""
    samples = [(k, ms) for k, ms in samples if k > 0]
    if not samples:
        return 0.0, 0.0
    line = least_squares_line(samples)
    if line is None or line[0] < 0 or line[1] <= 0:
        return 0.0, sum(t for _, t in samples) / sum(k for k, _ in samples)
    return line


def _acceptance(engine_factory, name: str, prompts, tokenizer, opts: ProfileOptions, budget: _Budget) -> DrafterStats:
    from specdec.core.params import SamplingParams
    from specdec.core.prompts import encode

    engine, recorder = engine_factory()
    requests: list[RequestRounds] = []
    timing: list[tuple[int, float]] = []
    last = 0.0
    for prompt in prompts:
        if not budget.allow(f"acceptance, {name} drafter: {prompt.id}", last, must=1):
            break
        t0 = time.monotonic()
        ids = encode(tokenizer, prompt)
        rid = engine.add_request(ids, SamplingParams(max_tokens=opts.max_tokens))
        rounds: dict[tuple[int, int, int], int] = {}
        first_round: list[int] = []
        first = True
        while engine.has_work:
            recorder.calls.clear()
            before = engine.running[0].stats.accepted if engine.running else 0
            engine.step()
            req = engine.finished.get(rid) or engine.running[0]
            for k, d, dt in recorder.calls:
                a = req.stats.accepted - before
                rounds[(k, d, a)] = rounds.get((k, d, a), 0) + 1
                first_round = first_round or [k, d, a]
                if not first:
                    timing.append((k, dt * 1e3))
                first = False
        res = engine.result(rid)
        agree = draft_agreement(recorder.inner, ids, list(res.token_ids)) if name == "draft" else []
        requests.append(
            RequestRounds(
                id=prompt.id,
                prompt_tokens=len(ids),
                output_tokens=len(res.token_ids),
                finish_reason=res.finish_reason,
                rounds=[[k, d, a, n] for (k, d, a), n in sorted(rounds.items())],
                first=first_round,
                agree=agree,
            )
        )
        last = time.monotonic() - t0
    fixed, per_token = _fit_draft_ms(timing) if name == "draft" else (0.0, 0.0)
    return DrafterStats(name, requests, round(fixed, 3), round(per_token, 3))


def take_profile(
    target: str,
    draft: str | None,
    opts: ProfileOptions,
    overhead: Overhead | None = None,
    progress: Callable[[str], None] = lambda _: None,
) -> Profile:
    import torch

    from specdec.core.build import check_same_vocab, make_draft_runner, model_drafter_on
    from specdec.core.drafters import NgramProposer
    from specdec.core.engine import SpecEngine
    from specdec.core.models import load_model
    from specdec.core.prompts import encode, load_prompts
    from specdec.core.runner import ModelRunner

    if opts.threads:
        torch.set_num_threads(opts.threads)
    machine = _machine(torch.get_num_threads())
    prompts = load_prompts(opts.prompts)
    progress(f"loading {target}" + (f" and {draft}" if draft else ""))
    tgt = load_model(target, dtype=opts.dtype, device=opts.device)
    prompt_ids = [encode(tgt.tokenizer, p) for p in prompts]
    dft = load_model(draft, dtype=opts.dtype, device=opts.device) if draft else None
    if dft is not None:
        check_same_vocab(tgt, dft)
    budget = _Budget(opts.budget_s, progress)
    max_len = max(opts.context + max(opts.tokens) + 1, max(opts.prefill_lengths) + 1, 4096)
    slots = sum(opts.batches)  # the grid holds every batch's rows at once (its passes interleave them)
    with torch.inference_mode():
        t_runner = ModelRunner(tgt.model, num_slots=slots, max_len=max_len)
        model_draft = dft is not None and "draft" in opts.drafters
        budget.part(0.2 if model_draft else 0.35)
        t_grid = _grid(t_runner, opts, opts.tokens, budget, "target")
        budget.part(0.3 if model_draft else 0.5)
        t_prefill = _prefill_curve(t_runner, opts, budget, "target")
        if t_grid is None or t_prefill is None:
            raise RuntimeError(f"the budget of {opts.budget_s:.0f} s did not cover the target's forwards")
        d_runner = d_grid = d_prefill = d_propose = None
        if dft is not None:
            d_runner = make_draft_runner(dft, slots, max_len)
            budget.part(0.35)
            d_grid = _grid(d_runner, opts, opts.draft_tokens, budget, "draft")
            budget.part(0.4)
            d_prefill = _prefill_curve(d_runner, opts, budget, "draft")
            budget.part(0.55)
            d_propose = _propose_grid(d_runner, prompt_ids, opts, budget)
        drafters: dict[str, DrafterStats] = {}
        eos = tgt.eos_token_ids
        runs = [n for n in opts.drafters if n != "draft" or (d_runner is not None and d_grid is not None)]
        for i, name in enumerate(runs):

            def factory(name=name):
                inner = model_drafter_on(d_runner) if name == "draft" else NgramProposer()
                rec = _Recorder(inner)
                runner = ModelRunner(tgt.model, num_slots=1, max_len=max_len)
                # n-gram drafts at the router's fixed price (router/draft_depth.py want_k), model drafts measured
                engine = SpecEngine(
                    runner, tgt.tokenizer, rec, k_policy=opts.k_policy, eos_token_ids=eos, price_drafts=name == "draft"
                )
                return engine, rec

            done = budget.elapsed / budget.seconds if budget.seconds > 0 else 1.0
            budget.part(done + max(0.0, 1.0 - done) / (len(runs) - i))  # the drafters share what is left
            drafters[name] = _acceptance(factory, name, prompts, tgt.tokenizer, opts, budget)
    machine["load_avg_1m_end"] = round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else 0.0
    return Profile(
        machine=machine,
        device=_device_name(opts.device),
        target=_model_info(tgt, opts.dtype),
        target_forward=t_grid,
        target_prefill=t_prefill,
        draft=_model_info(dft, opts.dtype) if dft is not None else None,
        draft_forward=d_grid,
        draft_prefill=d_prefill,
        draft_propose=d_propose,
        overhead=overhead or Overhead(),
        drafters=drafters,
        workload={"prompts": opts.prompts, "max_tokens": opts.max_tokens, "k_policy": vars(opts.k_policy)},
        tp=None,
        created=datetime.now(UTC).isoformat(timespec="seconds"),
        budget_s=opts.budget_s,
        elapsed_s=round(budget.elapsed, 1),
        skipped=budget.skipped,
    )
