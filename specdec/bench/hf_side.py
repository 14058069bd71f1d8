"""The transformers side of `specdec bench generate`: `generate()` alone and assisted generation,
with the candidate generator's rounds and time recorded."""

from __future__ import annotations

import contextlib
import copy
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from specdec.bench.records import Outcome, Round
from specdec.core.models import LoadedModel

log = logging.getLogger(__name__)


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
    return GenerationConfig(
        do_sample=False,
        num_beams=1,
        max_new_tokens=max_tokens,
        min_new_tokens=0,
        eos_token_id=eos,
        pad_token_id=eos[0] if pad is None else pad,
    )


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
        out = target.model.generate(
            ids, attention_mask=torch.ones_like(ids), generation_config=gen_config, streamer=clock, **extra
        )
        seconds = time.perf_counter() - t0
    tokens = out[0, len(prompt_ids) :].tolist()
    rounds = _hf_rounds(t0, clock, candidates if recorded else None)
    eos = target.eos_token_ids
    finish = "stop" if tokens and tokens[-1] in eos else "length"
    text = target.tokenizer.decode(tokens, skip_special_tokens=True)
    return seconds, tokens, text, finish, rounds, None


def _hf_rounds(t0: float, clock: _RoundClock, candidates: list[tuple[float, int]] | None) -> list[Round]:
    if candidates is not None and len(candidates) != len(clock.times):
        log.warning(
            "assisted generation: %d candidate calls for %d rounds; acceptance left out",
            len(candidates),
            len(clock.times),
        )
        candidates = None
    rounds, last = [], t0
    for i, (t, n) in enumerate(zip(clock.times, clock.counts)):
        draft_s, drafted = candidates[i] if candidates is not None else (0.0, 0)
        rounds.append(Round(t - last, n, drafted, draft_s))
        last = t
    return rounds
