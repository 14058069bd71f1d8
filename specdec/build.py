"""Assemble an engine from model specs: what `specdec generate`, the benches and the workers share."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from specdec.drafters import Drafter, ModelDrafter, NgramProposer, NoDrafter
from specdec.engine import KPolicy, SpecEngine
from specdec.models import LoadedModel, load_model
from specdec.runner import ModelRunner

log = logging.getLogger(__name__)

NO_DRAFT = ("none", "off", "")
NGRAM = "ngram"


class IncompatibleModels(ValueError):
    pass


@dataclass
class EngineParts:
    target: LoadedModel
    target_runner: ModelRunner
    draft: LoadedModel | None
    drafter: Drafter


def check_same_vocab(target: LoadedModel, draft: LoadedModel) -> None:
    """A draft must speak the target's token ids: same tokenizer vocabulary."""
    if target.tokenizer.get_vocab() != draft.tokenizer.get_vocab():
        raise IncompatibleModels(f"draft {draft.name!r} and target {target.name!r} have different tokenizers")


def make_drafter(spec: str | None, target: LoadedModel, dtype: str, device: str,
                 num_slots: int, max_len: int) -> tuple[LoadedModel | None, Drafter]:
    if spec is None or spec.lower() in NO_DRAFT:
        return None, NoDrafter()
    if spec.lower() == NGRAM:
        return None, NgramProposer()
    draft = load_model(spec, dtype=dtype, device=device)
    check_same_vocab(target, draft)
    return draft, ModelDrafter(ModelRunner(draft.model, num_slots=num_slots, max_len=max_len))


def build_engine(target: str, draft: str | None = None, dtype: str = "float32", device: str = "cpu",
                 num_slots: int = 8, max_len: int = 2048, k_policy: KPolicy | None = None,
                 verify_mode: str | None = None) -> tuple[SpecEngine, EngineParts]:
    tgt = load_model(target, dtype=dtype, device=device)
    runner = ModelRunner(tgt.model, num_slots=num_slots, max_len=max_len)
    draft_model, drafter = make_drafter(draft, tgt, dtype, device, num_slots, max_len)
    engine = SpecEngine(runner, tgt.tokenizer, drafter, k_policy=k_policy,
                        eos_token_ids=tgt.eos_token_ids, verify_mode=verify_mode)
    return engine, EngineParts(tgt, runner, draft_model, drafter)
