"""Chunked prefill in the single-process engine: fixed chunk boundaries, the budget, and outputs
that do not depend on what else is being prefilled (fp32 and bf16)."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoTokenizer

import specdec.core.target as target_module
from specdec.core.drafters import ModelDrafter, NoDrafter
from specdec.core.engine import KPolicy, SpecEngine
from specdec.core.params import SamplingParams
from specdec.core.runner import ModelRunner
from tests.conftest import load_hf

CHUNK, BUDGET = 32, 80


def _long_prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 250) for _ in range(n)]


def _engine(paths, dtype, budget=BUDGET, chunk=CHUNK, draft=True, slots=6, target="llama") -> SpecEngine:
    """The engine on a tiny Llama (its noisy copy drafts), or on SmolLM2 drafting for itself."""
    target_model = load_hf(paths[target], dtype)
    runner = ModelRunner(target_model, num_slots=slots, max_len=1024)
    drafter = NoDrafter()
    if draft:
        draft_path = paths["llama-draft"] if target == "llama" else paths[target]
        drafter = ModelDrafter(ModelRunner(load_hf(draft_path, dtype), num_slots=slots, max_len=1024))
    tok = AutoTokenizer.from_pretrained(paths[target])
    eos = {target_model.generation_config.eos_token_id}
    return SpecEngine(
        runner, tok, drafter, KPolicy(k=3), eos_token_ids=eos, max_batched_tokens=budget, prefill_chunk=chunk
    )


def _record_prefills(engine: SpecEngine) -> list[list[tuple[int, int]]]:
    """Per target forward that caches prompt tokens: (tokens already cached, tokens cached after)
    for each chunk in it, those it caches for later rounds and a prompt's last in its first verify."""
    calls: list[list[tuple[int, int]]] = []
    inner = engine.verifier.verify

    def cached(rid: str) -> int:
        return engine.target.lengths[engine.verifier.slots[rid]] if rid in engine.verifier.slots else 0

    def verify(items, prefill=()):
        rows = [(cached(rid), len(toks) - 1) for rid, toks, _ in prefill]
        rows += [(cached(i.request_id), len(i.tokens) - 1) for i in items if cached(i.request_id) < len(i.tokens) - 1]
        if rows:
            calls.append(rows)
        return inner(items, prefill)

    engine.verifier.verify = verify
    return calls


def _first_logits(monkeypatch, prompt_len: int) -> list[torch.Tensor]:
    """Record the target's logits for the first verified position of the prompt under test."""
    seen: list[torch.Tensor] = []
    inner = target_module.verify

    def verify(logits, draft, params, mode, *, start_pos, generator=None):
        if start_pos == prompt_len:
            seen.append(logits[0].clone())
        return inner(logits, draft, params, mode, start_pos=start_pos, generator=generator)

    monkeypatch.setattr(target_module, "verify", verify)
    return seen


# bf16 on SmolLM2: a tiny model's bf16 sums are too short to show a difference.
@pytest.mark.parametrize(
    ("target", "dtype"), [("llama", torch.float32), ("smollm2", torch.bfloat16)], ids=["fp32", "bf16"]
)
@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_a_prompt_alone_and_beside_a_burst_of_long_prompts_gives_the_same_tokens(
    tiny_paths, smollm_path, monkeypatch, target, dtype, seeded
):
    paths = {**tiny_paths, "smollm2": smollm_path}
    params = SamplingParams(max_tokens=24, temperature=0.8 if seeded else 0.0, seed=7 if seeded else None)
    prompt = _long_prompt(1, 150)
    logits = _first_logits(monkeypatch, len(prompt))
    alone = _engine(paths, dtype, target=target).generate([prompt], params)[0].token_ids
    engine = _engine(paths, dtype, target=target)
    burst = [_long_prompt(10 + i, 300 + 37 * i) for i in range(4)]
    ids = [engine.add_request(p, SamplingParams(max_tokens=8)) for p in burst[:2]]
    ids.append(engine.add_request(prompt, params))
    ids += [engine.add_request(p, SamplingParams(max_tokens=8)) for p in burst[2:]]
    while engine.has_work:
        engine.step()
    assert engine.result(ids[2]).token_ids == alone
    # Bitwise, not only the argmax: the prompt's KV came from the same forwards.
    assert len(logits) == 2 and torch.equal(logits[0], logits[1])


def test_chunks_end_on_fixed_boundaries_and_rounds_keep_the_budget(tiny_paths):
    engine = _engine(tiny_paths, torch.float32, draft=False)
    calls = _record_prefills(engine)
    prompts = [_long_prompt(20 + i, n) for i, n in enumerate((200, 130, 20, 75))]
    results = engine.generate(prompts, SamplingParams(max_tokens=6))
    assert all(r.finish_reason == "length" for r in results)
    totals = {len(p) - 1 for p in prompts}
    for call in calls:
        assert sum(after - before for before, after in call) <= BUDGET or len(call) == 1
        for before, after in call:
            assert before % CHUNK == 0 and (after % CHUNK == 0 or after in totals)
    assert len(calls) > 3  # the long prompts took several rounds


def test_chunked_and_whole_prefill_agree_with_transformers_in_fp32(tiny_paths):
    prompt = _long_prompt(3, 260)
    chunked = _engine(tiny_paths, torch.float32).generate([prompt], SamplingParams(max_tokens=20))[0]
    whole = _engine(tiny_paths, torch.float32, budget=0).generate([prompt], SamplingParams(max_tokens=20))[0]
    model = load_hf(tiny_paths["llama"])
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=20, pad_token_id=0)
    hf = out[0, len(prompt) :].tolist()
    eos = model.generation_config.eos_token_id
    hf = hf[: hf.index(eos) + 1] if eos in hf else hf
    assert chunked.token_ids == whole.token_ids == hf[: len(chunked.token_ids)]


def test_cancel_mid_prefill_frees_the_slot_and_runs_no_more_chunks(tiny_paths):
    engine = _engine(tiny_paths, torch.float32, draft=False, slots=2)
    calls = _record_prefills(engine)
    rid = engine.add_request(_long_prompt(5, 400), SamplingParams(max_tokens=4))
    engine.step()
    assert engine.verifier.has(rid) and engine.target.free_slots == 1
    n = len(calls)
    assert engine.cancel(rid)
    assert engine.target.free_slots == 2 and not engine.has_work
    engine.step()
    assert len(calls) == n
