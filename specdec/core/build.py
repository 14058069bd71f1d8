"""Assemble an engine from model specs: what `specdec generate`, the benches and the workers share."""

from __future__ import annotations

import logging
import string
from dataclasses import dataclass
from typing import TYPE_CHECKING

from specdec.core.draft_options import DraftOptions
from specdec.core.drafters import Drafter, ModelDrafter, NgramProposer, NoDrafter
from specdec.core.engine import KPolicy, SpecEngine
from specdec.core.models import LoadedModel, load_model
from specdec.core.ngram import NgramDrafter
from specdec.core.runner import ModelRunner
from specdec.core.tree_drafting import TreeShape

if TYPE_CHECKING:
    from specdec.core.tp_group import LocalGroup

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
    group: LocalGroup | None = None  # the target's tensor-parallel ranks; close() when done

    def close(self) -> None:
        if self.group is not None:
            self.group.close()


def check_same_vocab(target: LoadedModel, draft: LoadedModel) -> None:
    """A draft must speak the target's token ids: same tokenizer vocabulary."""
    if target.tokenizer.get_vocab() != draft.tokenizer.get_vocab():
        raise IncompatibleModels(f"draft {draft.name!r} and target {target.name!r} have different tokenizers")


def _markup(text: str) -> bool:
    """Whitespace and punctuation only (code fences, brackets and newlines, indentation)."""
    core = text.strip()
    return (core == "" and text != "") or (core != "" and all(c in string.punctuation for c in core))


def frequency_ranked_vocab(tokenizer, n: int) -> list[int]:
    """The n most frequent ids of a BPE vocabulary (its lowest ids), its special tokens, and every
    later id whose text is only whitespace and punctuation. Merge order ranks words well but not
    the markup a chat or code model emits all the time: Qwen2.5's code fence "```" is id 73594, so a
    32,768-id draft could never propose the fence that opens almost every coding answer, and every
    request's first draft failed at its first token. The markup adds
    ~3,600 rows to Qwen's 32,768."""
    specials = [int(i) for i in getattr(tokenizer, "added_tokens_decoder", {})]
    size = len(tokenizer)
    markup = [i for i in range(min(n, size), size) if _markup(tokenizer.decode([i]))]
    return sorted(set(range(min(n, size))) | set(specials) | set(markup))


def make_draft_runner(
    draft: LoadedModel, num_slots: int, max_len: int, options: DraftOptions | None = None
) -> ModelRunner:
    options = options or DraftOptions()
    vocab = None
    if options.vocab and options.vocab < draft.model.config.vocab_size:
        vocab = frequency_ranked_vocab(draft.tokenizer, options.vocab)
    # A draft's numbers may change (the target verifies): it takes the fast forward.
    runner = ModelRunner(
        draft.model,
        num_slots=num_slots,
        max_len=max_len,
        weight_quant=options.quant,
        vocab_subset=vocab,
        invariant_numerics=False,
    )
    runner.capture()  # CUDA graphs of the static steps on a GPU; nothing elsewhere
    return runner


def model_drafter_on(runner: ModelRunner, options: DraftOptions | None = None) -> ModelDrafter:
    """A drafter on a draft runner; several may share one runner if they run one at a time."""
    options = options or DraftOptions()
    # Lookup guesses need a match of two tokens or more: a one-token match is mostly noise.
    tree = None
    if options.tree_width > 1:
        tree = TreeShape(width=options.tree_width, expand=options.tree_expand, nodes=options.tree_nodes)
    return ModelDrafter(runner, lookup=NgramDrafter(min_ngram=2) if options.lookup else None, tree=tree)


def make_model_drafter(
    draft: LoadedModel, num_slots: int, max_len: int, options: DraftOptions | None = None
) -> ModelDrafter:
    return model_drafter_on(make_draft_runner(draft, num_slots, max_len, options), options)


def make_drafter(
    spec: str | None,
    target: LoadedModel,
    dtype: str,
    device: str,
    num_slots: int,
    max_len: int,
    options: DraftOptions | None = None,
) -> tuple[LoadedModel | None, Drafter]:
    if spec is None or spec.lower() in NO_DRAFT:
        return None, NoDrafter()
    if spec.lower() == NGRAM:
        return None, NgramProposer()
    draft = load_model(spec, dtype=dtype, device=device)
    check_same_vocab(target, draft)
    return draft, make_model_drafter(draft, num_slots, max_len, options)


def build_engine(
    target: str,
    draft: str | None = None,
    dtype: str = "float32",
    device: str = "cpu",
    num_slots: int = 8,
    max_len: int = 2048,
    k_policy: KPolicy | None = None,
    verify_mode: str | None = None,
    draft_options: DraftOptions | None = None,
    tensor_parallel: int = 1,
) -> tuple[SpecEngine, EngineParts]:
    """`tensor_parallel` > 1 shards the target over that many ranks: this process and child processes
    (they split the cores); call ``parts.close()`` when done."""
    tgt = load_model(target, dtype=dtype, device=device)
    runner = ModelRunner(tgt.model, num_slots=num_slots, max_len=max_len)
    group = None
    if tensor_parallel > 1:
        import torch

        from specdec.core.tp_group import GroupSpec, LocalGroup

        group = LocalGroup(GroupSpec(target, tensor_parallel, dtype, device, num_slots, max_len))
        torch.set_num_threads(group.threads)
        runner = group.start(runner)
    else:
        runner.capture()  # CUDA graphs of the static steps on a GPU; nothing elsewhere
    draft_model, drafter = make_drafter(draft, tgt, dtype, device, num_slots, max_len, draft_options)
    engine = SpecEngine(
        runner, tgt.tokenizer, drafter, k_policy=k_policy, eos_token_ids=tgt.eos_token_ids, verify_mode=verify_mode
    )
    return engine, EngineParts(tgt, runner, draft_model, drafter, group)
