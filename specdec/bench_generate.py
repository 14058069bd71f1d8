"""`specdec bench generate`: specdec side by side with transformers, interleaved in one process.

Every configuration decodes the same prompts greedily, prompt by prompt, each configuration in
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
  runs as ``specdec generate`` runs it (:class:`specdec.build.DraftOptions`: int8 weights and a
  frequency-ranked vocabulary subset by default); transformers gets the draft model as loaded.
* ``specdec_draft_adaptive``: SpecEngine with the draft model, ``KPolicy(adaptive=True)``.
* ``specdec_ngram``: SpecEngine with the n-gram (prompt-lookup) drafter.

Measured per configuration: output tokens/s (all tokens / all time), ms per output token per
request (request time / its tokens; p50 and p90 over requests), tokens per round tau, the draft
tokens per round k, acceptance per position, the per-token acceptance a (truncated-geometric MLE,
:func:`specdec.speedup.estimate_acceptance`), the cost ratio c and the Leviathan bound
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

import contextlib
import copy
import datetime
import logging
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from specdec.build import DraftOptions, check_same_vocab, make_draft_runner, model_drafter_on
from specdec.drafters import ModelDrafter, NgramProposer
from specdec.engine import KPolicy, SpecEngine
from specdec.models import LoadedModel, load_model
from specdec.prompts import Prompt, encode, load_prompts
from specdec.runner import ModelRunner
from specdec.sampling import SamplingParams
from specdec.speedup import estimate_acceptance, expected_tokens, speedup

log = logging.getLogger(__name__)

HF_TARGET, HF_ASSISTED, HF_ASSISTED_K = "hf_target", "hf_assisted", "hf_assisted_k"
SPEC_TARGET, SPEC_DRAFT_K, SPEC_ADAPTIVE, SPEC_NGRAM = (
    "specdec_target", "specdec_draft_k", "specdec_draft_adaptive", "specdec_ngram")
FAMILIES = (HF_TARGET, HF_ASSISTED, HF_ASSISTED_K, SPEC_TARGET, SPEC_DRAFT_K, SPEC_ADAPTIVE, SPEC_NGRAM)
NEEDS_DRAFT = (HF_ASSISTED, HF_ASSISTED_K, SPEC_DRAFT_K, SPEC_ADAPTIVE)
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


# ---------------------------------------------------------------------------------------- records
@dataclass
class Round:
    seconds: float  # wall time of the round (draft + verify + bookkeeping)
    committed: int  # tokens the round added to the output
    drafted: int  # draft tokens sent for verification
    draft_s: float  # time spent drafting


@dataclass
class Run:
    config: str
    prompt_index: int
    prompt_id: str
    repeat: int
    prompt_tokens: int
    seconds: float
    token_ids: list[int]
    text: str
    finish_reason: str
    rounds: list[Round]
    stats: dict | None = None  # specdec's RequestStats, as it counted them
    load_avg_1m: float | None = None  # the machine's 1-minute load average when the request ended

    @property
    def tokens(self) -> int:
        return len(self.token_ids)

    def accepted_per_round(self) -> list[tuple[int, int]]:
        """(accepted, drafted) per round usable for the acceptance estimate.

        A round commits its accepted drafts plus the target's own token; the last round of a
        request that ended on EOS may be cut short by the stop rule, so it is left out.
        """
        usable = self.rounds[:-1] if self.finish_reason == "stop" else self.rounds
        return [(max(0, min(r.committed - 1, r.drafted)), r.drafted) for r in usable]

    def as_dict(self) -> dict:
        d = asdict(self)
        d["rounds"] = {"seconds": [round(r.seconds, 5) for r in self.rounds],
                       "committed": [r.committed for r in self.rounds],
                       "drafted": [r.drafted for r in self.rounds],
                       "draft_s": [round(r.draft_s, 5) for r in self.rounds]}
        d["seconds"] = round(self.seconds, 5)
        d["output_tokens"] = self.tokens
        return d


def run_from_record(rec: dict) -> Run:
    """A :class:`Run` back from its JSON record (to summarise a saved result again)."""
    rd = rec["rounds"]
    rounds = [Round(*vals) for vals in zip(rd["seconds"], rd["committed"], rd["drafted"], rd["draft_s"])]
    return Run(rec["config"], rec["prompt_index"], rec["prompt_id"], rec["repeat"], rec["prompt_tokens"],
               rec["seconds"], rec["token_ids"], rec["text"], rec["finish_reason"], rounds, rec.get("stats"),
               rec.get("load_avg_1m"))


# (seconds, output token ids, text, finish reason, rounds, specdec's RequestStats as a dict or None)
Outcome = tuple[float, list[int], str, str, list[Round], dict | None]


# ---------------------------------------------------------------------------------------- specdec side
class TimedDrafter:
    """Wraps a drafter: times each propose() and counts the draft tokens that reached verification."""

    def __init__(self, inner):
        self.inner = inner
        self._seconds = 0.0
        self._drafts: list = []

    def propose(self, inputs):
        t0 = time.perf_counter()
        drafts = self.inner.propose(inputs)
        self._seconds += time.perf_counter() - t0
        self._drafts.extend(drafts)
        return drafts

    def release(self, request_id: str) -> None:
        self.inner.release(request_id)

    def take(self) -> tuple[int, float]:
        """(draft tokens, seconds) since the last take. Read after the step: the engine trims drafts to k."""
        out = (sum(len(d.tokens) for d in self._drafts), self._seconds)
        self._drafts, self._seconds = [], 0.0
        return out

    def __getattr__(self, name):
        return getattr(self.inner, name)


@dataclass
class SpecConfig:
    name: str
    engine: SpecEngine
    timer: TimedDrafter | None
    k: int | None  # fixed k, None for adaptive / n-gram / target-only


def run_spec(cfg: SpecConfig, prompt_ids: list[int], max_tokens: int) -> Outcome:
    """One request through the engine, step by step, timing each round."""
    engine = cfg.engine
    if cfg.timer is not None:
        cfg.timer.take()
    rounds: list[Round] = []
    t0 = time.perf_counter()
    rid = engine.add_request(prompt_ids, SamplingParams(max_tokens=max_tokens))
    while engine.has_work:
        ts = time.perf_counter()
        outputs = engine.step()
        te = time.perf_counter()
        committed = sum(len(o.new_token_ids) for o in outputs if o.request_id == rid)
        drafted, draft_s = cfg.timer.take() if cfg.timer is not None else (0, 0.0)
        rounds.append(Round(te - ts, committed, drafted, draft_s))
    seconds = time.perf_counter() - t0
    result = engine.result(rid)
    return seconds, list(result.token_ids), result.text, result.finish_reason, rounds, result.stats.as_dict()


# ---------------------------------------------------------------------------------------- transformers side
class _RoundClock:
    """A transformers streamer that timestamps each put() after the prompt: one per decode round."""

    def __init__(self):
        self.times: list[float] = []
        self.counts: list[int] = []
        self._prompt_seen = False

    def put(self, value) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())
        self.counts.append(int(value.numel()))

    def end(self) -> None:
        pass


@contextlib.contextmanager
def _record_candidates(sink: list[tuple[float, int]] | None) -> Iterator[bool]:
    """Time transformers' assisted candidate generator and count its candidates, per round.

    Patches ``AssistedCandidateGenerator.get_candidates`` for the duration of one call (the
    benchmark's own process only). Yields False when the class is not there (then no acceptance).
    """
    if sink is None:
        yield False
        return
    try:
        from transformers.generation import candidate_generator as cg

        cls = cg.AssistedCandidateGenerator
        original = cls.get_candidates
    except (ImportError, AttributeError):
        log.warning("transformers' AssistedCandidateGenerator not found: no acceptance figures for hf_assisted")
        yield False
        return

    def timed(self, input_ids, **kwargs):
        t0 = time.perf_counter()
        candidate_ids, logits = original(self, input_ids, **kwargs)
        sink.append((time.perf_counter() - t0, int(candidate_ids.shape[-1] - input_ids.shape[-1])))
        return candidate_ids, logits

    cls.get_candidates = timed
    try:
        yield True
    finally:
        cls.get_candidates = original


@dataclass
class HFConfig:
    name: str
    target: LoadedModel
    draft: LoadedModel | None = None
    assistant_config: object = None  # the assistant's GenerationConfig for this configuration
    k: int | None = None


def _hf_generation_config(target: LoadedModel, max_tokens: int):
    from transformers import GenerationConfig

    eos = sorted(target.eos_token_ids)
    pad = getattr(target.tokenizer, "pad_token_id", None)
    return GenerationConfig(do_sample=False, num_beams=1, max_new_tokens=max_tokens, min_new_tokens=0,
                            eos_token_id=eos, pad_token_id=eos[0] if pad is None else pad)


def assistant_config(draft: LoadedModel, k: int | None):
    """The assistant's generation config: transformers' defaults, or a fixed k (constant, no confidence stop)."""
    cfg = copy.deepcopy(draft.model.generation_config)
    if k is not None:
        cfg.num_assistant_tokens = k
        cfg.num_assistant_tokens_schedule = "constant"
        cfg.assistant_confidence_threshold = 0.0
    return cfg


@contextlib.contextmanager
def _assistant_config(cfg: HFConfig) -> Iterator[None]:
    if cfg.draft is None:
        yield
        return
    model = cfg.draft.model
    saved = model.generation_config
    model.generation_config = cfg.assistant_config  # any state transformers keeps there stays with this config
    try:
        yield
    finally:
        model.generation_config = saved


def run_hf(cfg: HFConfig, prompt_ids: list[int], max_tokens: int) -> Outcome:
    """One request through transformers' generate(), timing each round with a streamer."""
    target = cfg.target
    gen_config = _hf_generation_config(target, max_tokens)
    ids = torch.tensor([prompt_ids], device=target.device)
    clock, candidates = _RoundClock(), ([] if cfg.draft is not None else None)
    extra = {"assistant_model": cfg.draft.model} if cfg.draft is not None else {}
    with _assistant_config(cfg), _record_candidates(candidates) as recorded, torch.inference_mode():
        t0 = time.perf_counter()
        out = target.model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen_config,
                                    streamer=clock, **extra)
        seconds = time.perf_counter() - t0
    tokens = out[0, len(prompt_ids):].tolist()
    rounds = _hf_rounds(t0, clock, candidates if recorded else None)
    eos = target.eos_token_ids
    finish = "stop" if tokens and tokens[-1] in eos else "length"
    text = target.tokenizer.decode(tokens, skip_special_tokens=True)
    return seconds, tokens, text, finish, rounds, None


def _hf_rounds(t0: float, clock: _RoundClock, candidates: list[tuple[float, int]] | None) -> list[Round]:
    if candidates is not None and len(candidates) != len(clock.times):
        log.warning("assisted generation: %d candidate calls for %d rounds; acceptance left out",
                    len(candidates), len(clock.times))
        candidates = None
    rounds, last = [], t0
    for i, (t, n) in enumerate(zip(clock.times, clock.counts)):
        draft_s, drafted = candidates[i] if candidates is not None else (0.0, 0)
        rounds.append(Round(t - last, n, drafted, draft_s))
        last = t
    return rounds


# ---------------------------------------------------------------------------------------- configurations
def _expand(options: BenchOptions) -> list[str]:
    unknown = [c for c in options.configs if c not in FAMILIES]
    if unknown:
        raise BenchError(f"unknown configuration(s) {', '.join(unknown)}; choose from {', '.join(FAMILIES)}")
    hf_k = options.hf_k if options.hf_k is not None else options.k
    ks = sorted(set(options.k_sweep) | {options.k})
    hf_ks = sorted(set(options.k_sweep) | {hf_k})
    names = []
    for family in FAMILIES:
        if family not in options.configs:
            continue
        if family == SPEC_DRAFT_K:
            names += [f"{SPEC_DRAFT_K}{k}" for k in ks]
        elif family == HF_ASSISTED_K:
            names += [f"{HF_ASSISTED_K}{k}" for k in hf_ks]
        else:
            names.append(family)
    return names


def _family(name: str) -> str:
    for fam in (SPEC_DRAFT_K, HF_ASSISTED_K):
        if name.startswith(fam) and name[len(fam):].isdigit():
            return fam
    return name


def _fixed_k(name: str) -> int | None:
    fam = _family(name)
    return int(name[len(fam):]) if fam in (SPEC_DRAFT_K, HF_ASSISTED_K) else None


def build_configs(names: Sequence[str], target: LoadedModel, draft: LoadedModel | None, max_len: int,
                  ngram_k: int = 4, draft_options: DraftOptions | None = None) -> dict:
    """One target runner and one draft runner, shared by every specdec engine (they run one at a time).

    The draft runner is made as `specdec generate` and the draft workers make it
    (:func:`specdec.build.make_draft_runner`, :func:`specdec.build.model_drafter_on`); transformers gets the draft model as loaded.
    """
    target_runner = ModelRunner(target.model, num_slots=1, max_len=max_len)
    draft_runner = None
    if draft is not None and any(_family(n) in (SPEC_DRAFT_K, SPEC_ADAPTIVE) for n in names):
        draft_runner = make_draft_runner(draft, 1, max_len, draft_options)

    def model_drafter() -> TimedDrafter:  # one per configuration, all on the one draft runner
        return TimedDrafter(model_drafter_on(draft_runner, draft_options))
    configs: dict = {}
    for name in names:
        fam, k = _family(name), _fixed_k(name)
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
            engine = SpecEngine(target_runner, target.tokenizer, drafter, k_policy=policy,
                                eos_token_ids=target.eos_token_ids)
            configs[name] = SpecConfig(name, engine, drafter, k)
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

    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "cuda": torch.cuda.is_available(),
            "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None}


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


def measure_step_costs(target_runner: ModelRunner, draft_runner: ModelRunner, context: list[int],
                       repeat: int = 5) -> dict:
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
    return {"context_tokens": len(context), "repeat": repeat, "target_step_ms": _r(target_ms, 2),
            "draft_step_ms": _r(draft_ms, 2), "c": _r(draft_ms / target_ms)}


def _step_costs(configs: dict, target: LoadedModel, draft: LoadedModel | None, context: list[int],
                options: BenchOptions) -> dict | None:
    """measure_step_costs on the runners the run used (built here when no specdec configuration had them)."""
    if draft is None or options.step_repeat < 1:
        return None
    spec = [c for c in configs.values() if isinstance(c, SpecConfig)]
    target_runner = spec[0].engine.target if spec else ModelRunner(target.model, 1, len(context) + 2)
    draft_runner = next((c.timer.inner.runner for c in spec
                         if c.timer is not None and isinstance(c.timer.inner, ModelDrafter)), None)
    if draft_runner is None:
        draft_runner = make_draft_runner(draft, 1, len(context) + 2, options.draft_options)
    log.info("runner decode steps: target and draft, alternating")
    return measure_step_costs(target_runner, draft_runner, context, options.step_repeat)


def _rotated(names: list[str], i: int) -> list[str]:
    shift = i % len(names)
    return names[shift:] + names[:shift]


def run_benchmark(target: str | LoadedModel, draft: str | LoadedModel | None, prompts: str | Sequence[Prompt],
                  options: BenchOptions | None = None,
                  progress: Callable[[str], None] | None = None) -> dict:
    """Run every configuration on every prompt, interleaved; return the full result (JSON-able)."""
    options = options or BenchOptions()
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    if options.threads:
        torch.set_num_threads(options.threads)
    names = _expand(options)
    if not names:
        raise BenchError("no configurations to run")
    needs_draft = any(_family(n) in NEEDS_DRAFT for n in names)
    if needs_draft and draft is None:
        raise BenchError(f"the configurations {', '.join(n for n in names if _family(n) in NEEDS_DRAFT)} "
                         "need a draft model (--draft), or leave them out with --configs")
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
    ks = [k for k in (_fixed_k(n) for n in names) if k] + [KPolicy().k_max]  # + the adaptive k_max
    max_len = max(len(e) for e in encoded) + options.max_tokens + max(ks) + 8
    configs = build_configs(names, target_m, draft_m, max_len, ngram_k=options.k, draft_options=options.draft_options)
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
    line = (f"prompt {i}/{total} {run.prompt_id} {run.config}: {run.tokens} tokens in {run.seconds:.2f} s "
            f"({run.tokens / run.seconds:.2f} tok/s, {len(run.rounds)} rounds, load {run.load_avg_1m})")
    log.info(line)
    if progress is not None:
        progress(line)


def _meta(options, target_m, draft_m, prompts, prompt_list, encoded, done, total, date, load_s, wall_s) -> dict:
    return {
        "target": target_m.name, "draft": draft_m.name if draft_m is not None else None,
        "dtype": options.dtype, "max_tokens": options.max_tokens, "repeat": options.repeat,
        "k": options.k, "hf_k": options.hf_k if options.hf_k is not None else options.k,
        "k_sweep": list(options.k_sweep),
        "draft_options": asdict(options.draft_options or DraftOptions()),
        "prompts": prompts if isinstance(prompts, str) else f"{len(prompt_list)} prompts",
        "prompt_ids": [p.id for p in prompt_list], "prompt_tokens": [len(e) for e in encoded],
        "requests_done": done, "requests_planned": total, "budget_s": options.budget_s,
        "order": "interleaved: per prompt every configuration in turn, the order rotating by one each prompt",
        "ms_per_token": "per request: request wall time / its output tokens (prefill included); p50/p90 over requests",
        "bound_baseline": {"specdec": SPEC_TARGET, "transformers": HF_TARGET},
        "date": date,  # when the run started (UTC)
        "machine": _machine(), "load_s": round(load_s, 2), "wall_s": round(wall_s, 2),
    }


# ---------------------------------------------------------------------------------------- summary
def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in [0, 100]); None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _r(x: float | None, nd: int = 4) -> float | None:
    return None if x is None or (isinstance(x, float) and not math.isfinite(x)) else round(x, nd)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _prefix_match(ref: list[int], out: list[int]) -> float:
    n = max(len(ref), len(out))
    if n == 0:
        return 1.0
    i = 0
    while i < min(len(ref), len(out)) and ref[i] == out[i]:
        i += 1
    return i / n


def _per_position(runs: Sequence[Run]) -> list[float]:
    drafted: list[int] = []
    accepted: list[int] = []
    for run in runs:
        for n, k in run.accepted_per_round():
            for counts, m in ((drafted, k), (accepted, n)):
                counts.extend([0] * (m - len(counts)))
                for j in range(m):
                    counts[j] += 1
    accepted.extend([0] * (len(drafted) - len(accepted)))
    return [round(a / d, 4) for a, d in zip(accepted, drafted) if d]


def _step_ms(runs: Sequence[Run]) -> float | None:
    """Median duration of the decode rounds (first round, with the prefill, left out) of a k = 0 configuration."""
    times = [r.seconds for run in runs for r in run.rounds[1:]]
    return statistics.median(times) * 1e3 if times else None


def _aggregate(runs: Sequence[Run]) -> dict:
    tokens = sum(r.tokens for r in runs)
    seconds = sum(r.seconds for r in runs)
    rounds = [rd for r in runs for rd in r.rounds]
    later = [rd for r in runs for rd in r.rounds[1:]]
    pairs = [p for r in runs for p in r.accepted_per_round()]
    drafted_later = sum(rd.drafted for rd in later)
    ms_tok = [r.seconds * 1e3 / r.tokens for r in runs if r.tokens]
    has_drafts = any(rd.drafted for rd in rounds)
    return {
        "requests": len(runs), "tokens": tokens, "seconds": seconds,
        "tok_s": tokens / seconds if seconds else None,
        "ms_per_token_p50": percentile(ms_tok, 50), "ms_per_token_p90": percentile(ms_tok, 90),
        "rounds": len(rounds), "tau": tokens / len(rounds) if rounds else None,
        "k_mean": sum(rd.drafted for rd in rounds) / len(rounds) if rounds else 0.0,
        "a": estimate_acceptance([n for n, _ in pairs], [k for _, k in pairs]) if has_drafts else None,
        "acceptance_per_position": _per_position(runs) if has_drafts else [],
        "draft_ms_per_token": sum(rd.draft_s for rd in later) * 1e3 / drafted_later if drafted_later else None,
        "round_ms": statistics.mean(rd.seconds for rd in later) * 1e3 if later else None,
        "draft_ms_per_round": statistics.mean(rd.draft_s for rd in later) * 1e3 if later else None,
    }


def _agreement(runs: Sequence[Run], refs: dict[tuple[int, int], list[int]]) -> tuple[float | None, float | None]:
    pairs = [(refs[(r.prompt_index, r.repeat)], r.token_ids) for r in runs if (r.prompt_index, r.repeat) in refs]
    if not pairs:
        return None, None
    exact = sum(ref == out for ref, out in pairs) / len(pairs)
    prefix = statistics.mean(_prefix_match(ref, out) for ref, out in pairs)
    return exact, prefix


def _median_ratio(runs: Sequence[Run], base_runs: Sequence[Run]) -> float | None:
    """Median over requests of (tok/s of the request / tok/s of the baseline on the same prompt and pass).

    Less sensitive than the ratio of totals to a burst of load from other processes hitting one request.
    """
    base = {(r.prompt_index, r.repeat): r.tokens / r.seconds for r in base_runs if r.tokens and r.seconds}
    ratios = [(r.tokens / r.seconds) / base[(r.prompt_index, r.repeat)]
              for r in runs if r.tokens and r.seconds and (r.prompt_index, r.repeat) in base]
    return statistics.median(ratios) if ratios else None


def summarize(runs: Sequence[Run], names: Sequence[str]) -> dict:
    by_name = {n: [r for r in runs if r.config == n] for n in names}
    agg = {n: _aggregate(rs) for n, rs in by_name.items() if rs}
    refs = {(r.prompt_index, r.repeat): r.token_ids for r in by_name.get(HF_TARGET, [])}
    steps = {HF_TARGET: _step_ms(by_name.get(HF_TARGET, [])), SPEC_TARGET: _step_ms(by_name.get(SPEC_TARGET, []))}
    tok_s = {n: a["tok_s"] for n, a in agg.items()}
    hf_assisted = [n for n in agg if _family(n) in (HF_ASSISTED, HF_ASSISTED_K)]
    best_hf = max(hf_assisted, key=lambda n: tok_s[n] or 0.0) if hf_assisted else None
    out = {}
    for name, a in agg.items():
        base = HF_TARGET if name.startswith("hf_") else SPEC_TARGET
        s = dict(a)
        s["family"], s["fixed_k"], s["bound_baseline"] = _family(name), _fixed_k(name), base
        s["speedup_vs_hf_target"] = _ratio(tok_s[name], tok_s.get(HF_TARGET))
        s["speedup_vs_hf_assisted"] = _ratio(tok_s[name], tok_s.get(HF_ASSISTED))
        s["speedup_vs_best_hf_assisted"] = _ratio(tok_s[name], tok_s.get(best_hf)) if best_hf else None
        s["speedup_vs_specdec_target"] = _ratio(tok_s[name], tok_s.get(SPEC_TARGET))
        s["speedup_vs_hf_target_median"] = _median_ratio(by_name[name], by_name.get(HF_TARGET, []))
        s["speedup_vs_hf_assisted_median"] = _median_ratio(by_name[name], by_name.get(HF_ASSISTED, []))
        s["speedup_vs_specdec_target_median"] = _median_ratio(by_name[name], by_name.get(SPEC_TARGET, []))
        s["target_step_ms"] = steps[base]
        s.update(_bound(s, steps[base], _ratio(tok_s[name], tok_s.get(base))))
        s["efficiency_vs_hf_target"] = _ratio(s["speedup_vs_hf_target"], s["bound"])
        s["agreement_exact"], s["agreement_prefix"] = _agreement(by_name[name], refs)
        out[name] = {k: (_r(v) if isinstance(v, float) else v) for k, v in s.items()}
    out_meta = {"best_hf_assisted": best_hf}
    return {"configs": out, **out_meta}


def _bound(s: dict, step_ms: float | None, measured: float | None) -> dict:
    """c, the verify-round cost, the Leviathan bound speedup(a, c, k_mean) and efficiency = measured / bound."""
    k = s["k_mean"]
    if not k:  # plain decoding: the bound is 1 by definition
        return {"c": None, "verify_ratio": None, "bound": 1.0, "efficiency": measured}
    c = _ratio(s["draft_ms_per_token"], step_ms)
    verify = _ratio(None if s["round_ms"] is None else s["round_ms"] - s["draft_ms_per_round"], step_ms)
    if s["a"] is None or c is None:
        return {"c": c, "verify_ratio": verify, "bound": None, "efficiency": None}
    bound = speedup(s["a"], c, k)
    # The same bound with the verify round as measured (it grows with k once compute-bound): what
    # is left between it and the measured speedup is prefill and per-round overhead.
    bound_v = expected_tokens(s["a"], k) / (k * c + verify) if verify else None
    return {"c": c, "verify_ratio": verify, "bound": bound, "efficiency": _ratio(measured, bound),
            "bound_measured_verify": bound_v, "efficiency_measured_verify": _ratio(measured, bound_v)}


def sweep_summary(summary: dict, names: Sequence[str]) -> dict | None:
    """Speedup per fixed k (specdec vs specdec_target, transformers vs hf_target) and the bound curve."""
    cfgs = summary["configs"]
    out = {}
    for fam, key in ((SPEC_DRAFT_K, "speedup_vs_specdec_target"), (HF_ASSISTED_K, "speedup_vs_hf_target")):
        rows = sorted((cfgs[n]["fixed_k"], n) for n in names if n in cfgs and _family(n) == fam)
        if len(rows) < 2:
            continue
        a_vals = [cfgs[n]["a"] for _, n in rows if cfgs[n]["a"] is not None]
        c_vals = [cfgs[n]["c"] for _, n in rows if cfgs[n]["c"] is not None]
        a = statistics.mean(a_vals) if a_vals else None
        c = statistics.mean(c_vals) if c_vals else None
        k_max = max(k for k, _ in rows)
        out[fam] = {
            "k": [k for k, _ in rows], "speedup": [cfgs[n][key] for _, n in rows], "vs": key,
            "a": _r(a), "c": _r(c),
            "bound_k": list(range(0, k_max + 1)),
            "bound": [_r(speedup(a, c, k)) for k in range(0, k_max + 1)] if a is not None and c is not None else None,
            "best_k": max(rows, key=lambda kn: cfgs[kn[1]][key] or 0.0)[0],
        }
    return out or None


# ---------------------------------------------------------------------------------------- presentation
TABLE_COLUMNS = (
    ("config", None), ("tok/s", "tok_s"), ("ms/tok p50", "ms_per_token_p50"), ("p90", "ms_per_token_p90"),
    ("x hf_target", "speedup_vs_hf_target"), ("x hf_target med", "speedup_vs_hf_target_median"),
    ("x hf_assisted", "speedup_vs_hf_assisted"), ("x best hf_asst", "speedup_vs_best_hf_assisted"),
    ("x specdec_target", "speedup_vs_specdec_target"),
    ("tau", "tau"), ("k", "k_mean"), ("a", "a"), ("c", "c"), ("bound", "bound"), ("eff", "efficiency"),
    ("v", "verify_ratio"), ("eff v", "efficiency_measured_verify"),
    ("eff vs hf_target", "efficiency_vs_hf_target"), ("agree exact", "agreement_exact"),
    ("agree prefix", "agreement_prefix"),
)


def _cell(v) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 10 else f"{v:.1f}"
    return str(v)


def format_table(result: dict) -> str:
    """Markdown table, configurations as rows, with a header line saying what was run."""
    meta, summary = result["meta"], result["summary"]
    lines = [
        f"target {meta['target']}, draft {meta['draft']}, {meta['dtype']}, prompts {meta['prompts']} "
        f"({meta['requests_done']} requests x {len(result['configs'])} configs), max_tokens {meta['max_tokens']}, "
        f"{meta['machine']['torch_threads']} threads, {meta['wall_s']:.0f} s",
        "",
        "| " + " | ".join(h for h, _ in TABLE_COLUMNS) + " |",
        "|" + "|".join("---" if key is None else "---:" for _, key in TABLE_COLUMNS) + "|",
    ]
    for name, s in summary["configs"].items():
        cells = [name] + [_cell(s.get(key)) for _, key in TABLE_COLUMNS[1:]]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "bound = speedup(a, c, k) (Leviathan) relative to the same stack's target-only run "
        "(specdec_target for specdec_*, hf_target for hf_*); eff = measured speedup over that baseline / bound; "
        f"best hf_asst = {summary.get('best_hf_assisted')}; med = median over requests of the per-request "
        "ratio (robust to a burst of load on one request); ms/tok = request time / output tokens; "
        "c = drafter time per draft token / target decode step, both measured in the run; v = verify time "
        "per round / target decode step; eff v = measured speedup / (tau(a, k) / (k c + v)), the bound with "
        "the verify as measured.",
    ]
    steps = summary.get("runner_steps")
    if steps:
        lines.append(f"runner decode step at {steps['context_tokens']} tokens of context: target "
                     f"{steps['target_step_ms']} ms, draft {steps['draft_step_ms']} ms, model-only c = {steps['c']}.")
    return "\n".join(lines)


def plot(result: dict, path: str | Path) -> Path:
    """PNG: speedup vs hf_target per configuration (bars, bound ticks); speedup per k with the bound curve."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    sweep = result.get("sweep") or {}
    fig, axes = plt.subplots(1, 2 if sweep else 1, figsize=(13 if sweep else 8, 4.8), squeeze=False)
    _plot_configs(axes[0][0], result)
    if sweep:
        _plot_sweep(axes[0][1], sweep)
    meta = result["meta"]
    fig.suptitle(f"{meta['target']} / {meta['draft']} ({meta['dtype']}, {meta['prompts']}, "
                 f"{meta['max_tokens']} tokens, {meta['machine']['torch_threads']} threads)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plot_configs(ax, result: dict) -> None:
    cfgs = result["summary"]["configs"]
    names = list(cfgs)
    ref = HF_TARGET if HF_TARGET in cfgs else SPEC_TARGET  # the reference the bars are relative to
    vals = [cfgs[n][f"speedup_vs_{ref}"] or 0.0 for n in names]
    colors = ["tab:gray" if n.startswith("hf_") else "tab:blue" for n in names]
    ax.bar(range(len(names)), vals, color=colors)
    for i, n in enumerate(names):  # the bound, placed on the reference's scale through the stack's baseline
        base = cfgs.get(cfgs[n]["bound_baseline"], {})
        b, scale = cfgs[n]["bound"], base.get(f"speedup_vs_{ref}")
        if b is not None and scale and cfgs[n]["k_mean"]:
            ax.plot([i - 0.4, i + 0.4], [b * scale] * 2, color="black", lw=1.5)
        ax.text(i, vals[i], f"{vals[i]:.2f}", ha="center", va="bottom", fontsize=7)
        med = cfgs[n].get(f"speedup_vs_{ref}_median")
        if med is not None:
            ax.plot([i], [med], marker="o", color="orange", ms=4)
    ax.axhline(1.0, color="red", lw=0.8, ls="--")
    ax.set_xticks(range(len(names)), names, rotation=35, ha="right", fontsize=7)
    ax.set_ylabel(f"speedup vs {ref} (tok/s ratio)")
    ax.set_title("per configuration: bars all tokens / all time, orange median per request, "
                 "black Leviathan bound", fontsize=8)


def _plot_sweep(ax, sweep: dict) -> None:
    styles = {SPEC_DRAFT_K: ("tab:blue", "specdec (vs specdec_target)"),
              HF_ASSISTED_K: ("tab:gray", "transformers assisted (vs hf_target)")}
    for fam, data in sweep.items():
        color, label = styles[fam]
        ax.plot(data["k"], data["speedup"], "o-", color=color, label=f"{label}, measured")
        if data["bound"] is not None:
            ax.plot(data["bound_k"], data["bound"], "--", color=color,
                    label=f"bound a={data['a']:.2f} c={data['c']:.2f}")
    ax.axhline(1.0, color="red", lw=0.8, ls="--")
    ax.set_xlabel("k (draft tokens per round)")
    ax.set_ylabel("speedup over the same stack's target-only")
    ax.set_title("per k", fontsize=9)
    ax.legend(fontsize=7)
