"""`specdec bench generate`: specdec side by side with transformers, interleaved in one process.

Every configuration decodes the same prompts greedily (or, with ``--temperature``, the specdec
configurations sample: rejection verification, trees drawn), prompt by prompt, each configuration in
turn (the order rotates from one prompt to the next), so drift and noise from other processes hit
all of them alike. Every speed figure is a ratio between configurations measured in this one run.

Configurations (``--configs`` takes the family names):

* ``hf_target``: transformers ``generate()`` with the target alone (greedy).
* ``hf_assisted``: transformers assisted generation (``assistant_model=``, batch 1) with the
  assistant's default schedule (up to 20 tokens, stopping early below confidence 0.4).
* ``hf_assisted_k``: assisted generation with a fixed number of draft tokens K
  (``num_assistant_tokens=K``, schedule ``constant``, confidence stop off): ``hf_assisted_k{K}``.
* ``specdec_target``: SpecEngine with no drafter (k = 0): plain decoding on our stack.
* ``specdec_draft_k``: SpecEngine with the draft model, fixed k: ``specdec_draft_k{K}``. The draft
  runs as ``specdec generate`` runs it (:class:`specdec.core.draft_options.DraftOptions`: int8 weights and a
  frequency-ranked vocabulary subset by default); transformers gets the draft model as loaded.
* ``specdec_draft_adaptive``: SpecEngine with the draft model's chain, ``KPolicy(adaptive=True)``.
* ``specdec_default``: the same with the draft options as given (the shipped defaults when no flag
  sets them: a token tree where ``DraftOptions.tree_width`` is above 1), as ``specdec generate`` runs.
* ``specdec_ngram``: SpecEngine with the n-gram (prompt-lookup) drafter.

Measured per configuration: output tokens/s (all tokens / all time), ms per output token per
request (request time / its tokens; p50 and p90 over requests), tokens per round tau, the draft
tokens per round k, acceptance per position, the per-token acceptance a (truncated-geometric MLE,
:func:`specdec.core.speedup.estimate_acceptance`), the cost ratio c and the Leviathan bound
speedup(a, c, k) (k: the mean draft length), efficiency = measured speedup / bound, and greedy
agreement with ``hf_target``.

Costs are measured inside the run. The target step is the median time of a decode round of the
same stack's target-only configuration (``specdec_target`` for specdec, ``hf_target`` for
transformers; the first round, which holds the prefill, is left out). The draft cost per token
is the drafter's time (our drafter, or transformers' candidate generator) divided by the tokens
it drafted, first round left out. c = draft cost per token / target step. The bound is relative
to plain decoding on the same stack, so efficiency compares with ``specdec_target`` (specdec) or
``hf_target`` (transformers); ``efficiency_vs_hf_target`` also gives the ratio against
``hf_target`` for every configuration.
"""

from __future__ import annotations

import datetime
import logging
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace

import torch

from specdec.bench.config_names import (
    FAMILIES,
    HF_ASSISTED,
    HF_ASSISTED_K,
    HF_TARGET,
    NEEDS_DRAFT,
    SPEC_ADAPTIVE,
    SPEC_DEFAULT,
    SPEC_DRAFT_K,
    SPEC_NGRAM,
    SPEC_TARGET,
    family,
    fixed_k,
)
from specdec.bench.hf_side import HFConfig, assistant_config, run_hf
from specdec.bench.records import Run
from specdec.bench.spec_side import SpecConfig, TimedDrafter, run_spec
from specdec.bench.summary import _r, summarize, sweep_summary
from specdec.core.build import check_same_vocab, make_draft_runner, model_drafter_on
from specdec.core.draft_options import DraftOptions
from specdec.core.drafters import ModelDrafter, NgramProposer
from specdec.core.engine import KPolicy, SpecEngine
from specdec.core.models import LoadedModel, load_model
from specdec.core.prompts import Prompt, encode, load_prompts
from specdec.core.runner import ModelRunner

log = logging.getLogger(__name__)

WARMUP_TOKENS = 4
WARMUP_PROMPT_TOKENS = 32


class BenchError(ValueError):
    """A benchmark that cannot run as asked; the message says what to change."""


@dataclass
class BenchOptions:
    max_tokens: int = 128
    dtype: str = "bfloat16"
    repeat: int = 1
    k: int = 4
    hf_k: int | None = None  # None: the same as k
    k_sweep: tuple[int, ...] = ()
    configs: tuple[str, ...] = FAMILIES
    threads: int | None = None
    warmup: bool = True
    budget_s: float | None = None  # stop starting new prompts when the next would overrun this
    step_repeat: int = 5  # runner decode steps timed at the end for the model-only c (0: skip)
    draft_options: DraftOptions | None = None  # how specdec cheapens its draft model (None: build's defaults)
    temperature: float = 0.0  # above 0: specdec configurations sample (rejection verification) instead


# ---------------------------------------------------------------------------------------- configurations
def _expand(options: BenchOptions) -> list[str]:
    unknown = [c for c in options.configs if c not in FAMILIES]
    if unknown:
        raise BenchError(f"unknown configuration(s) {', '.join(unknown)}; choose from {', '.join(FAMILIES)}")
    hf_k = options.hf_k if options.hf_k is not None else options.k
    ks = sorted(set(options.k_sweep) | {options.k})
    hf_ks = sorted(set(options.k_sweep) | {hf_k})
    names = []
    for fam in FAMILIES:
        if fam not in options.configs:
            continue
        if fam == SPEC_DRAFT_K:
            names += [f"{SPEC_DRAFT_K}{k}" for k in ks]
        elif fam == HF_ASSISTED_K:
            names += [f"{HF_ASSISTED_K}{k}" for k in hf_ks]
        else:
            names.append(fam)
    return names


def build_configs(
    names: Sequence[str],
    target: LoadedModel,
    draft: LoadedModel | None,
    max_len: int,
    ngram_k: int = 4,
    draft_options: DraftOptions | None = None,
    temperature: float = 0.0,
) -> dict:
    """One target runner and one draft runner, shared by every specdec engine (they run one at a time).

    The draft runner is made as `specdec generate` and the draft workers make it
    (:func:`specdec.core.build.make_draft_runner`, :func:`specdec.core.build.model_drafter_on`); transformers gets
    the draft model as loaded.
    """
    target_runner = ModelRunner(target.model, num_slots=1, max_len=max_len)
    draft_runner = None
    if draft is not None and any(family(n) in (SPEC_DRAFT_K, SPEC_ADAPTIVE, SPEC_DEFAULT) for n in names):
        draft_runner = make_draft_runner(draft, 1, max_len, draft_options)
    options = draft_options or DraftOptions()

    def model_drafter(chain: bool = True) -> TimedDrafter:  # one per configuration, all on the one draft runner
        return TimedDrafter(model_drafter_on(draft_runner, replace(options, tree_width=1) if chain else options))

    configs: dict = {}
    for name in names:
        fam, k = family(name), fixed_k(name)
        if fam == HF_TARGET:
            configs[name] = HFConfig(name, target)
        elif fam in (HF_ASSISTED, HF_ASSISTED_K):
            configs[name] = HFConfig(name, target, draft, assistant_config(draft, k), k)
        else:
            drafter, policy = None, KPolicy(k=0)
            if fam == SPEC_NGRAM:
                drafter, policy = TimedDrafter(NgramProposer()), KPolicy(k=ngram_k)
            elif fam == SPEC_DRAFT_K:
                drafter, policy = model_drafter(), KPolicy(k=k)
            elif fam == SPEC_ADAPTIVE:
                drafter, policy = model_drafter(), KPolicy(adaptive=True)
            elif fam == SPEC_DEFAULT:
                drafter, policy = model_drafter(chain=False), KPolicy(adaptive=True)
            engine = SpecEngine(
                target_runner, target.tokenizer, drafter, k_policy=policy, eos_token_ids=target.eos_token_ids
            )
            configs[name] = SpecConfig(name, engine, drafter, k, temperature)
    return configs


def run_one(cfg, prompt_ids: list[int], max_tokens: int):
    return run_hf(cfg, prompt_ids, max_tokens) if isinstance(cfg, HFConfig) else run_spec(cfg, prompt_ids, max_tokens)


# ---------------------------------------------------------------------------------------- the run
def _load(model: str | LoadedModel | None, dtype: str) -> LoadedModel | None:
    if model is None or isinstance(model, LoadedModel):
        return model
    return load_model(model, dtype=dtype)


def _machine() -> dict:
    import transformers

    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.cuda.is_available(),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


def _warmup(configs: dict, prompt_ids: list[int], max_tokens: int) -> None:
    """A few tokens through every configuration on a short prompt: first-call costs stay out of the figures."""
    for name, cfg in configs.items():
        log.info("warm-up: %s", name)
        run_one(cfg, prompt_ids[:WARMUP_PROMPT_TOKENS], min(WARMUP_TOKENS, max_tokens))


def _decode_step_ms(runner: ModelRunner, slot: int, context: list[int]) -> float:
    t0 = time.perf_counter()
    runner.forward([slot], [[context[-1]]])
    ms = (time.perf_counter() - t0) * 1e3
    runner.rollback(slot, len(context))
    return ms


def measure_step_costs(
    target_runner: ModelRunner, draft_runner: ModelRunner, context: list[int], repeat: int = 5
) -> dict:
    """Single-token decode step of the target and of the draft on the runner, alternating, at one context.

    The model-only cost ratio c (no drafter bookkeeping), next to the c measured inside the run.
    """
    runners = {"target": target_runner, "draft": draft_runner}
    slots = {name: runner.alloc_slot() for name, runner in runners.items()}
    try:
        for name, runner in runners.items():
            runner.forward([slots[name]], [context], num_logits=0)
            _decode_step_ms(runner, slots[name], context)  # warm
        times: dict[str, list[float]] = {name: [] for name in runners}
        for _ in range(repeat):
            for name, runner in runners.items():
                times[name].append(_decode_step_ms(runner, slots[name], context))
    finally:
        for name, runner in runners.items():
            runner.free_slot(slots[name])
    target_ms, draft_ms = statistics.median(times["target"]), statistics.median(times["draft"])
    return {
        "context_tokens": len(context),
        "repeat": repeat,
        "target_step_ms": _r(target_ms, 2),
        "draft_step_ms": _r(draft_ms, 2),
        "c": _r(draft_ms / target_ms),
    }


def _step_costs(
    configs: dict, target: LoadedModel, draft: LoadedModel | None, context: list[int], options: BenchOptions
) -> dict | None:
    """measure_step_costs on the runners the run used (built here when no specdec configuration had them)."""
    if draft is None or options.step_repeat < 1:
        return None
    spec = [c for c in configs.values() if isinstance(c, SpecConfig)]
    target_runner = spec[0].engine.target if spec else ModelRunner(target.model, 1, len(context) + 2)
    draft_runner = next(
        (c.timer.inner.runner for c in spec if c.timer is not None and isinstance(c.timer.inner, ModelDrafter)), None
    )
    if draft_runner is None:
        draft_runner = make_draft_runner(draft, 1, len(context) + 2, options.draft_options)
    log.info("runner decode steps: target and draft, alternating")
    return measure_step_costs(target_runner, draft_runner, context, options.step_repeat)


def _rotated(names: list[str], i: int) -> list[str]:
    shift = i % len(names)
    return names[shift:] + names[:shift]


def run_benchmark(
    target: str | LoadedModel,
    draft: str | LoadedModel | None,
    prompts: str | Sequence[Prompt],
    options: BenchOptions | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict:
    """Run every configuration on every prompt, interleaved; return the full result (JSON-able)."""
    options = options or BenchOptions()
    date = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    if options.threads:
        torch.set_num_threads(options.threads)
    names = _expand(options)
    if not names:
        raise BenchError("no configurations to run")
    sampled_hf = [n for n in names if n.startswith("hf_")] if options.temperature > 0 else []
    if sampled_hf or options.temperature < 0:
        raise BenchError(
            f"--temperature {options.temperature}: specdec configurations sample at a temperature above 0; "
            f"leave out {', '.join(sampled_hf) or 'nothing'} with --configs specdec_..., or give a temperature >= 0"
        )
    needs_draft = any(family(n) in NEEDS_DRAFT for n in names)
    if needs_draft and draft is None:
        raise BenchError(
            f"the configurations {', '.join(n for n in names if family(n) in NEEDS_DRAFT)} "
            "need a draft model (--draft), or leave them out with --configs"
        )
    prompt_list = load_prompts(prompts) if isinstance(prompts, str) else list(prompts)
    if not prompt_list:
        raise BenchError("no prompts")
    t_load = time.perf_counter()
    target_m = _load(target, options.dtype)
    draft_m = _load(draft, options.dtype) if needs_draft else None
    if draft_m is not None:
        check_same_vocab(target_m, draft_m)
    load_s = time.perf_counter() - t_load
    encoded = [encode(target_m.tokenizer, p) for p in prompt_list]
    ks = [k for k in (fixed_k(n) for n in names) if k] + [KPolicy().k_max]  # + the adaptive k_max
    max_len = max(len(e) for e in encoded) + options.max_tokens + max(ks) + 8
    configs = build_configs(
        names,
        target_m,
        draft_m,
        max_len,
        ngram_k=options.k,
        draft_options=options.draft_options,
        temperature=options.temperature,
    )
    if options.warmup:
        _warmup(configs, encoded[0], options.max_tokens)
    runs, started, done = [], time.perf_counter(), 0
    total = options.repeat * len(encoded)
    jobs = [(rep, i) for rep in range(options.repeat) for i in range(len(encoded))]
    for rep, i in jobs:
        if _over_budget(options.budget_s, started, done, total):
            break
        for name in _rotated(names, done):
            runs.append(_timed_run(configs[name], name, i, prompt_list[i], rep, encoded[i], options.max_tokens))
            _report(progress, runs[-1], done + 1, total)
        done += 1
    wall_s = time.perf_counter() - started
    summary = summarize(runs, names)
    summary["runner_steps"] = _step_costs(configs, target_m, draft_m, encoded[0], options)
    return {
        "meta": _meta(options, target_m, draft_m, prompts, prompt_list, encoded, done, total, date, load_s, wall_s),
        "configs": names,
        "summary": summary,
        "sweep": sweep_summary(summary, names),
        "records": [r.as_dict() for r in runs],
    }


def _over_budget(budget_s: float | None, started: float, done: int, total: int) -> bool:
    if budget_s is None or done == 0:
        return False
    elapsed = time.perf_counter() - started
    if elapsed + elapsed / done <= budget_s:
        return False
    log.warning("time budget %.0f s: stopping after %d of %d prompts (%.0f s so far)", budget_s, done, total, elapsed)
    return True


def _timed_run(cfg, name: str, index: int, prompt: Prompt, rep: int, ids: list[int], max_tokens: int) -> Run:
    seconds, tokens, text, finish, rounds, stats = run_one(cfg, ids, max_tokens)
    load = round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None
    return Run(name, index, prompt.id, rep, len(ids), seconds, tokens, text, finish, rounds, stats, load)


def _report(progress: Callable[[str], None] | None, run: Run, i: int, total: int) -> None:
    line = (
        f"prompt {i}/{total} {run.prompt_id} {run.config}: {run.tokens} tokens in {run.seconds:.2f} s "
        f"({run.tokens / run.seconds:.2f} tok/s, {len(run.rounds)} rounds, load {run.load_avg_1m})"
    )
    log.info(line)
    if progress is not None:
        progress(line)


def _meta(options, target_m, draft_m, prompts, prompt_list, encoded, done, total, date, load_s, wall_s) -> dict:
    return {
        "target": target_m.name,
        "draft": draft_m.name if draft_m is not None else None,
        "dtype": options.dtype,
        "max_tokens": options.max_tokens,
        "temperature": options.temperature,
        "repeat": options.repeat,
        "k": options.k,
        "hf_k": options.hf_k if options.hf_k is not None else options.k,
        "k_sweep": list(options.k_sweep),
        "draft_options": asdict(options.draft_options or DraftOptions()),
        "prompts": prompts if isinstance(prompts, str) else f"{len(prompt_list)} prompts",
        "prompt_ids": [p.id for p in prompt_list],
        "prompt_tokens": [len(e) for e in encoded],
        "requests_done": done,
        "requests_planned": total,
        "budget_s": options.budget_s,
        "order": "interleaved: per prompt every configuration in turn, the order rotating by one each prompt",
        "ms_per_token": "per request: request wall time / its output tokens (prefill included); p50/p90 over requests",
        "bound_baseline": {"specdec": SPEC_TARGET, "transformers": HF_TARGET},
        "date": date,  # when the run started (UTC)
        "machine": _machine(),
        "load_s": round(load_s, 2),
        "wall_s": round(wall_s, 2),
    }
