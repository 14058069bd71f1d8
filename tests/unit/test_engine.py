"""SpecEngine: lossless against transformers alone, on tiny models and SmolLM2-135M (float32)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import specdec.core.target as target_module
from specdec.core.drafters import ModelDrafter, NgramProposer, NoDrafter
from specdec.core.engine import KPolicy, SpecEngine
from specdec.core.ngram import NgramDrafter
from specdec.core.params import SamplingParams
from specdec.core.round_types import VerifyResult
from specdec.core.runner import ModelRunner
from specdec.core.tree_drafting import TreeShape
from tests.conftest import load_hf


def _engine(
    target_model,
    tokenizer,
    drafter_kind: str,
    draft_model=None,
    k: int = 3,
    adaptive: bool = False,
    num_slots: int = 4,
    max_len: int = 256,
) -> SpecEngine:
    runner = ModelRunner(target_model, num_slots=num_slots, max_len=max_len)
    if drafter_kind == "model":
        drafter = ModelDrafter(ModelRunner(draft_model, num_slots=num_slots, max_len=max_len))
    elif drafter_kind == "model-cheap":  # int8 weights + a frequency-ranked vocabulary subset
        vocab = list(range(8192)) + [target_model.generation_config.eos_token_id]
        drafter = ModelDrafter(
            ModelRunner(draft_model, num_slots=num_slots, max_len=max_len, weight_quant="int8", vocab_subset=vocab)
        )
    elif drafter_kind == "model-lookup":  # the draft model also checks prompt-lookup guesses
        drafter = ModelDrafter(
            ModelRunner(draft_model, num_slots=num_slots, max_len=max_len), lookup=NgramDrafter(min_ngram=1)
        )
    elif drafter_kind == "model-tree":  # a token tree: 2 nodes grown per level, 3 children each, + lookup
        drafter = ModelDrafter(
            ModelRunner(draft_model, num_slots=num_slots, max_len=max_len),
            lookup=NgramDrafter(min_ngram=1),
            tree=TreeShape(width=3, expand=2, nodes=10),
        )
    elif drafter_kind == "ngram":
        drafter = NgramProposer()
    else:
        drafter = NoDrafter()
    eos = {target_model.generation_config.eos_token_id}
    return SpecEngine(runner, tokenizer, drafter, KPolicy(k=k, adaptive=adaptive), eos_token_ids=eos)


def _hf_greedy(model, prompt: list[int], max_new: int) -> list[int]:
    eos = model.generation_config.eos_token_id
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            do_sample=False,
            max_new_tokens=max_new,
            eos_token_id=eos,
            pad_token_id=eos,
            attention_mask=torch.ones(1, len(prompt)),
        )
    return out[0, len(prompt) :].tolist()


def _prompts(vocab_hi: int, lengths=(3, 11, 1, 24, 7), seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_hi, (n,), generator=gen).tolist() for n in lengths]


@pytest.mark.parametrize("drafter", ["model", "model-lookup", "model-tree", "ngram", "none"])
def test_greedy_matches_transformers_tiny(tiny, drafter):
    prompts = _prompts(256)
    max_tokens = [5, 17, 32, 40, 9]
    refs = [_hf_greedy(tiny["target"], p, m) for p, m in zip(prompts, max_tokens)]
    # A stop token id taken from inside one reference: generation must stop right after it.
    stop_id = refs[3][6]
    params = [SamplingParams(max_tokens=m) for m in max_tokens]
    params[3] = SamplingParams(max_tokens=max_tokens[3], stop_token_ids=(stop_id,))
    # Fewer slots than requests: continuous admission as others finish.
    engine = _engine(tiny["target"], tiny["tokenizer"], drafter, tiny["draft"], k=4, num_slots=3)
    proposed = []
    propose = engine.drafter.propose
    engine.drafter.propose = lambda inputs: proposed.extend(drafts := propose(inputs)) or drafts
    results = engine.generate(prompts, params)
    if drafter == "model-tree":  # trees were verified, not chains
        assert any(d.parents is not None and d.depth < d.k for d in proposed)
    for i, (res, ref) in enumerate(zip(results, refs)):
        if i == 3:
            ref = ref[: ref.index(stop_id) + 1]
            assert res.finish_reason == "stop"
        assert res.token_ids == ref, f"request {i}"
    assert engine.target.free_slots == 3
    if drafter.startswith("model"):
        assert sum(r.stats.drafted for r in results) > 0
        assert 0 < sum(r.stats.accepted for r in results) < sum(r.stats.drafted for r in results)


def test_greedy_qwen2_adaptive_k(tiny_paths):
    model = load_hf(tiny_paths["qwen2"])
    tok = AutoTokenizer.from_pretrained(tiny_paths["qwen2"])
    prompts = _prompts(256, lengths=(5, 13), seed=2)
    refs = [_hf_greedy(model, p, 30) for p in prompts]
    # The model drafts for itself: every draft token must be accepted.
    engine = _engine(model, tok, "model", load_hf(tiny_paths["qwen2"]), k=2, adaptive=True)
    results = engine.generate(prompts, SamplingParams(max_tokens=30))
    assert [r.token_ids for r in results] == refs
    for r in results:
        assert r.stats.accepted == r.stats.drafted > 0
        assert r.stats.acceptance_rate == 1.0


def test_broken_verifier_is_caught(tiny, monkeypatch):
    """The greedy comparison above can fail: a verifier that accepts every draft token breaks it."""

    def accept_all(logits, draft, params, mode, *, start_pos, generator):
        return VerifyResult(tokens=list(draft.tokens) + [int(torch.argmax(logits[-1]))], num_accepted=len(draft.tokens))

    monkeypatch.setattr(target_module, "verify", accept_all)
    prompts = _prompts(256, lengths=(4, 9))
    refs = [_hf_greedy(tiny["target"], p, 24) for p in prompts]
    engine = _engine(tiny["target"], tiny["tokenizer"], "model", tiny["draft"], k=4)
    results = engine.generate(prompts, SamplingParams(max_tokens=24))
    assert [r.token_ids for r in results] != refs


def test_broken_tree_verifier_is_caught(tiny, monkeypatch):
    """A tree verifier that takes the deepest path whatever the target says breaks the comparison."""
    from specdec.core.token_tree import leaf_paths

    honest = target_module.verify_tree

    def deepest(logits, draft, params, mode, *, start_pos, generator):
        if not draft.tokens:  # nothing to misjudge in an empty tree (the tail of a request)
            return honest(logits, draft, params, mode, start_pos=start_pos, generator=generator)
        path = max(leaf_paths(draft.parents), key=len)
        last = int(torch.argmax(logits[path[-1] + 1]))
        return VerifyResult(tokens=[draft.tokens[i] for i in path] + [last], num_accepted=len(path)), path

    monkeypatch.setattr(target_module, "verify_tree", deepest)
    prompts = _prompts(256, lengths=(4, 9))
    refs = [_hf_greedy(tiny["target"], p, 24) for p in prompts]
    engine = _engine(tiny["target"], tiny["tokenizer"], "model-tree", tiny["draft"], k=4)
    # Every tree is verified whole: the sizer cuts by measured time, and a loaded machine can make
    # it cut every node, which would leave the broken verifier nothing to get wrong.
    monkeypatch.setattr(engine.tree_sizer, "cut", lambda drafts, draft_s: list(drafts))
    results = engine.generate(prompts, SamplingParams(max_tokens=24))
    assert [r.token_ids for r in results] != refs


@pytest.mark.parametrize(
    "drafter,k",
    [("model", 1), ("model", 3), ("model", 7), ("model-lookup", 5), ("model-tree", 4), ("ngram", 3), ("none", 0)],
)
def test_invariant_sampling_is_identical_for_any_drafter_and_k(tiny, drafter, k):
    prompts = _prompts(256, lengths=(6, 2, 15), seed=5)
    params = [
        SamplingParams(max_tokens=25, temperature=0.9, seed=11),
        SamplingParams(max_tokens=25, temperature=1.3, top_p=0.9, seed=12),
        SamplingParams(max_tokens=25, temperature=0.7, top_k=20, seed=13),
    ]
    reference = _engine(tiny["target"], tiny["tokenizer"], "none", k=0).generate(prompts, params)
    engine = _engine(tiny["target"], tiny["tokenizer"], drafter, tiny["draft"], k=k)
    results = engine.generate(prompts, params)
    assert [r.token_ids for r in results] == [r.token_ids for r in reference]
    # Alone (batch of one) gives the same tokens as in the batch.
    alone = _engine(tiny["target"], tiny["tokenizer"], drafter, tiny["draft"], k=k).generate(prompts[1:2], params[1])
    assert alone[0].token_ids == reference[1].token_ids
    # Sampling really happened: a different seed gives different text.
    other = _engine(tiny["target"], tiny["tokenizer"], "none", k=0).generate(
        prompts[:1], SamplingParams(max_tokens=25, temperature=0.9, seed=999)
    )
    assert other[0].token_ids != reference[0].token_ids


def test_rejection_mode_runs_and_respects_limits(tiny):
    prompts = _prompts(256, lengths=(6, 10), seed=7)
    engine = _engine(tiny["target"], tiny["tokenizer"], "model", tiny["draft"], k=4)
    results = engine.generate(prompts, SamplingParams(max_tokens=20, temperature=1.0))
    for r in results:
        assert r.finish_reason in ("stop", "length")
        assert 1 <= len(r.token_ids) <= 20
        assert r.stats.drafted > 0


def test_cancel_frees_slots(tiny):
    engine = _engine(tiny["target"], tiny["tokenizer"], "model", tiny["draft"], k=3, num_slots=2)
    rid = engine.add_request([1, 2, 3], SamplingParams(max_tokens=50))
    engine.step()
    assert engine.target.free_slots == 1
    assert engine.cancel(rid)
    assert engine.target.free_slots == 2
    assert engine.result(rid).finish_reason == "cancelled"
    assert not engine.has_work


@pytest.fixture(scope="module")
def smollm(smollm_path):
    target = load_hf(smollm_path)
    # A real, cheaper draft with the same vocabulary: the first 8 of SmolLM2's 30 layers.
    draft = AutoModelForCausalLM.from_pretrained(smollm_path, dtype=torch.float32, num_hidden_layers=8).eval()
    return {"target": target, "draft": draft, "tokenizer": AutoTokenizer.from_pretrained(smollm_path)}


@pytest.mark.parametrize("drafter", ["model", "model-cheap", "model-lookup", "model-tree", "ngram", "none"])
def test_greedy_matches_transformers_smollm(smollm, drafter):
    tok = smollm["tokenizer"]
    texts = ["def fibonacci(n):", "The capital of France is", "1, 2, 3, 4, 5,"]
    prompts = [tok.encode(t) for t in texts]
    refs = [_hf_greedy(smollm["target"], p, 24) for p in prompts]
    ref_texts = [tok.decode(r, skip_special_tokens=True) for r in refs]
    # A stop string from inside the second reference, spanning whatever tokens it spans.
    stop = ref_texts[1][5:9]
    params = [SamplingParams(max_tokens=24), SamplingParams(max_tokens=24, stop=(stop,)), SamplingParams(max_tokens=13)]
    engine = _engine(smollm["target"], tok, drafter, smollm["draft"], k=4)
    results = engine.generate(prompts, params)
    assert results[0].token_ids == refs[0]
    assert results[1].finish_reason == "stop"
    assert results[1].text == ref_texts[1][: ref_texts[1].index(stop)]
    assert results[1].token_ids == refs[1][: len(results[1].token_ids)]
    assert results[2].token_ids == refs[2][:13] and results[2].finish_reason == "length"
    if drafter.startswith("model"):
        assert sum(r.stats.accepted for r in results) > 0
