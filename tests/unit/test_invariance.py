"""A row's logits do not depend on the rest of the forward (docs/design.md, invariant 2).

Property: a token sequence fed in random chunks (a prefill, 1-token decodes, k+1-token verifies
with k up to 12), each chunk in one forward beside 0..7 other rows (prefill, decode or verify at
random cache lengths, the row at a random place in the batch), gets logits bitwise equal to those
of the same sequence decoded one token per forward; in bf16 and float32, on tiny Llama and Qwen2
models and SmolLM2-135M. End to end (bf16, SmolLM2): speculative greedy and seeded output is
token-for-token the output of the same engine without speculation (k = 0).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, AutoTokenizer

import specdec.core.attention as attention
from specdec.core import cpu_gemm
from specdec.core.attention import CPU_GEMM_BLOCK, gemm_rows, padding_rule_holds
from specdec.core.drafters import ModelDrafter, NgramProposer, NoDrafter
from specdec.core.engine import KPolicy, SpecEngine
from specdec.core.packed import pack, packing_supported
from specdec.core.params import SamplingParams
from specdec.core.prompts import load_jsonl
from specdec.core.runner import ModelRunner
from tests.conftest import load_hf, skip_for_environment

SLOTS = 9  # the row under test + up to 8 others
MAX_LEN = 64


@dataclass
class Case:
    name: str
    model: torch.nn.Module
    sequence: list[int]
    reference: torch.Tensor  # [len(sequence), vocab]: one token per forward, batch of one
    examples: int


def _decode_one_by_one(model, sequence: list[int], invariant: bool = True) -> torch.Tensor:
    runner = ModelRunner(model, num_slots=1, max_len=MAX_LEN, invariant_numerics=invariant)
    slot = runner.alloc_slot()
    return torch.cat([runner.forward([slot], [[t]])[0] for t in sequence])


@pytest.fixture(
    scope="module",
    params=[(arch, dtype) for arch in ("llama", "qwen2", "smollm2") for dtype in (torch.bfloat16, torch.float32)],
    ids=lambda p: f"{p[0]}-{str(p[1]).removeprefix('torch.')}",
)
def case(request, tiny_paths) -> Case:
    arch, dtype = request.param
    path = request.getfixturevalue("smollm_path") if arch == "smollm2" else tiny_paths[arch]
    model = load_hf(path, dtype=dtype)
    small = arch != "smollm2"
    gen = random.Random(0)
    sequence = [gen.randrange(model.config.vocab_size) for _ in range(32 if small else 20)]
    return Case(arch, model, sequence, _decode_one_by_one(model, sequence), examples=10 if small else 2)


def _feed_in_chunks(case: Case, draw: Callable, invariant: bool = True) -> None:
    """Feed the case's sequence in drawn chunks beside drawn other rows; compare with the reference."""
    runner = ModelRunner(case.model, num_slots=SLOTS, max_len=MAX_LEN, invariant_numerics=invariant)
    me, *others = [runner.alloc_slot() for _ in range(SLOTS)]
    rng = draw(st.randoms(use_true_random=False))
    vocab, seq, at = case.model.config.vocab_size, case.sequence, 0
    while at < len(seq):
        # The first chunk may be a prefill of most of the sequence; then decodes and verifies.
        n = draw(st.integers(1, len(seq) - 1 if at == 0 else min(13, len(seq) - at)))
        rows = [(me, seq[at : at + n], n)]
        for slot in draw(st.permutations(others))[: draw(st.integers(0, len(others)))]:
            runner.rollback(slot, rng.randint(0, min(runner.lengths[slot], MAX_LEN - 16)))
            size = rng.choice([1, rng.randint(2, 13), rng.randint(2, 16)])
            rows.append((slot, [rng.randrange(vocab) for _ in range(size)], rng.randint(0, size)))
        rng.shuffle(rows)
        out = runner.forward([r[0] for r in rows], [r[1] for r in rows], num_logits=[r[2] for r in rows])
        got, want = out[[r[0] for r in rows].index(me)], case.reference[at : at + n]
        assert torch.equal(got, want), (
            f"{case.name}: positions {at}..{at + n - 1} in a batch of {len(rows)} rows (lengths "
            f"{[len(r[1]) for r in rows]}): max |diff| {(got - want).abs().max().item():.3g}"
        )
        at += n


def _check_property(case: Case, examples: int) -> None:
    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(st.data())
    def check(data):
        _feed_in_chunks(case, data.draw)

    check()


def test_row_logits_do_not_depend_on_the_rest_of_the_forward(case):
    _check_property(case, case.examples)


@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_weight_gemms_round_a_row_one_way_with_two_threads(dtype, packed):
    """The invariant forward's weight GEMM gives a row the rounding it gets in any other such GEMM,
    also when threads split the rows: `gemm_rows`' padding where this machine's BLAS keeps it
    (`padding_rule_holds`), else blocks of CPU_GEMM_BLOCK rows (the forward tests above run with one
    thread, the service with more). 1 to 40 rows: past 32, where a bf16 row changed on AMX. With
    plain weights and with packed ones (specdec/core/packed.py: oneDNN's layout, or the compiled
    loop's panels where the CPU has no bf16 instructions), as the runner has them."""
    gen = torch.Generator().manual_seed(0)
    # Qwen2.5-1.5B's up_proj shape: bf16 rounds a lone row differently in a few of its outputs.
    w = (torch.randn(8960, 1536, generator=gen) * 0.05).to(dtype)
    x = torch.randn(40, 1536, generator=gen).to(dtype)
    torch.set_num_threads(2)
    # A CPU without bf16 instructions (AVX2 only): bf16 weights are packed for the compiled loop
    # (cpu_gemm.c), not for oneDNN; the runner keeps plain weights only where neither can pack.
    assert not packed or packing_supported(w.device, dtype), f"{dtype} weights neither packed nor on the loop"
    runner = SimpleNamespace(gemm_block=None if padding_rule_holds([w], dtype, packed) else CPU_GEMM_BLOCK)
    w = pack(w) if packed else w

    def invariant_linear(rows: torch.Tensor) -> torch.Tensor:  # as a forward of len(rows) tokens runs it
        padded = F.pad(rows, (0, 0, 0, gemm_rows(len(rows), dtype) - len(rows)))
        return ModelRunner._linear(runner, padded, w, None, True)[: len(rows)]

    want = torch.cat([invariant_linear(x[i : i + 1]) for i in range(40)])  # each row alone
    for m in range(1, 41):
        assert torch.equal(invariant_linear(x[:m]), want[:m]), f"{m} rows, blocks {runner.gemm_block}"


def test_the_padding_probe_tells_a_blas_that_breaks_the_rule(monkeypatch, tiny_paths):
    """`padding_rule_holds` against two stand-ins for a BLAS (this machine's is whatever it is): one
    that rounds a row by itself passes; one that rounds rows another way past 32 (as bf16 did on an
    AMX Xeon) fails, and a runner built there runs its weight GEMMs in blocks."""
    real = F.linear

    def row_by_row(x, w, bias=None):
        return torch.cat([real(r[None], w, bias) for r in x])

    def other_past_32(x, w, bias=None):
        out = real(x, w, bias)
        return out * (1 + 2**-6) if x.shape[0] > 32 else out

    for blas, holds in ((row_by_row, True), (other_past_32, False)):
        monkeypatch.setattr(attention, "_RULE_HOLDS", {})
        monkeypatch.setattr(F, "linear", blas)
        assert padding_rule_holds([], torch.float32) is holds, blas.__name__
    # Plain weights: the stand-in replaces F.linear, which packed weights do not go through.
    runner = ModelRunner(load_hf(tiny_paths["llama"]), num_slots=1, max_len=MAX_LEN, pack_weights=False)
    assert runner.gemm_block == CPU_GEMM_BLOCK


def test_the_fast_forward_is_not_invariant(smollm_path, monkeypatch):
    """Why the invariant forward exists, and proof the comparison above can fail: with SDPA and
    torch's unpadded GEMMs, the same positions get other bf16 logits in a verify than in decodes.
    (A CPU's compiled loops, which keep a row's numbers its own by construction, are off here.)"""
    monkeypatch.setattr(attention.cpu_attention, "kernel", lambda: None)
    monkeypatch.setattr(cpu_gemm, "kernel", lambda: None)
    model = load_hf(smollm_path, dtype=torch.bfloat16)
    seq = random.Random(1).sample(range(model.config.vocab_size), 20)
    decoded = _decode_one_by_one(model, seq, invariant=False)
    runner = ModelRunner(model, num_slots=1, max_len=MAX_LEN, invariant_numerics=False)
    slot = runner.alloc_slot()
    verified = torch.cat(
        [runner.forward([slot], [seq[:7]], num_logits=7)[0], runner.forward([slot], [seq[7:]], num_logits=13)[0]]
    )
    assert not torch.equal(verified, decoded)


# ---- end to end: speculation changes nothing ------------------------------------------------------

CHAT = [
    "Give me three tips for sleeping better.",
    "Explain what a binary search does.",
    "Name two planets and say one fact about each.",
]


def chat_prompts(tokenizer, texts: list[str]) -> list[list[int]]:
    out = []
    for text in texts:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


def assert_speculation_changes_nothing(
    target,
    tokenizer,
    drafters: dict[str, Callable[[], object]],
    prompts: list[list[int]],
    max_tokens: int,
    eos: set[int],
) -> None:
    """Greedy output with a draft model (fixed and adaptive k) and the n-gram drafter, and seeded
    (invariant) output with both drafters, is the output of the target alone (k = 0), token for token."""

    def engine(drafter, policy: KPolicy) -> SpecEngine:
        runner = ModelRunner(target, num_slots=len(prompts), max_len=max(map(len, prompts)) + max_tokens + 16)
        return SpecEngine(runner, tokenizer, drafter, policy, eos_token_ids=eos)

    configs = [
        ("model k=4", "model", KPolicy(k=4)),
        ("ngram k=3", "ngram", KPolicy(k=3)),
        ("model adaptive k", "model", KPolicy(k=3, adaptive=True)),
    ]
    greedy, seeded = (
        SamplingParams(max_tokens=max_tokens),
        SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=7),
    )
    for params, runs in ((greedy, configs), (seeded, configs[:2])):
        alone = [r.token_ids for r in engine(NoDrafter(), KPolicy(k=0)).generate(prompts, params)]
        for name, drafter, policy in runs:
            results = engine(drafters[drafter](), policy).generate(prompts, params)
            for i, (res, want) in enumerate(zip(results, alone)):
                parts = next((j for j, (a, b) in enumerate(zip(res.token_ids, want)) if a != b), None)
                assert res.token_ids == want, (
                    f"{name}, temperature {params.temperature}: prompt {i} parts at token {parts}"
                )
            assert sum(r.stats.drafted for r in results) > 0


def test_speculation_is_lossless_in_bf16_smollm(smollm_path):
    target = load_hf(smollm_path, dtype=torch.bfloat16)
    tokenizer = AutoTokenizer.from_pretrained(smollm_path)
    # A real, cheaper draft with the same vocabulary: SmolLM2's first 8 of 30 layers.
    draft = AutoModelForCausalLM.from_pretrained(smollm_path, dtype=torch.bfloat16, num_hidden_layers=8).eval()
    drafters = {
        "model": lambda: ModelDrafter(ModelRunner(draft, num_slots=4, max_len=256, invariant_numerics=False)),
        "ngram": NgramProposer,
    }
    assert_speculation_changes_nothing(
        target, tokenizer, drafters, chat_prompts(tokenizer, CHAT), 20, {tokenizer.eos_token_id}
    )


QWEN_TARGET, QWEN_DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"
# The chat prompts `specdec bench generate --prompts bench/prompts/chat.jsonl` runs (the first 3 are CHAT).
MORE_CHAT = [p.text for p in load_jsonl(Path(__file__).resolve().parents[2] / "bench" / "prompts" / "chat.jsonl")]


@pytest.mark.slow  # `make test-slow` prepares the packs
def test_speculation_is_lossless_in_bf16_qwen_pair():
    from specdec.core import packs
    from specdec.core.build import make_model_drafter
    from specdec.core.models import load_model

    if not (packs.is_ready(QWEN_TARGET) and packs.is_ready(QWEN_DRAFT)):
        skip_for_environment(f"prepare the packs first: specdec models prepare {QWEN_TARGET} {QWEN_DRAFT}")
    target = load_model(QWEN_TARGET, dtype="bfloat16")
    draft = load_model(QWEN_DRAFT, dtype="bfloat16")
    prompts = chat_prompts(target.tokenizer, MORE_CHAT)
    # The production draft: int8 weights, a vocabulary subset, prompt-lookup guesses.
    drafters = {"model": lambda: make_model_drafter(draft, len(prompts), 512), "ngram": NgramProposer}
    assert_speculation_changes_nothing(target.model, target.tokenizer, drafters, prompts, 64, target.eos_token_ids)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_weight_gemms_in_row_blocks_give_the_same_logits(tiny_paths, dtype):
    """The CUDA rule (runner.gemm_block, attention.py CUDA_GEMM_BLOCK: every weight GEMM over blocks
    of exactly N rows) only regroups rows: on the CPU, whose rule it keeps, logits stay bitwise the
    same. Blocks of 8 rows split this 19-token batch into 3, the last one padded; 32 is one padded block."""
    model = load_hf(tiny_paths["qwen2"], dtype=dtype)
    gen = random.Random(3)
    rows = [[gen.randrange(model.config.vocab_size) for _ in range(n)] for n in (1, 5, 13)]
    out = {}
    for block in (None, 8, 32):
        runner = ModelRunner(model, num_slots=3, max_len=MAX_LEN)
        runner.gemm_block = block
        slots = [runner.alloc_slot() for _ in rows]
        runner.forward(slots, [[7, 8, 9]] * 3, num_logits=0)
        out[block] = runner.forward(slots, rows, num_logits=[1, 5, 13])
    for block in (8, 32):
        for got, want in zip(out[block], out[None]):
            assert torch.equal(got, want), f"blocks of {block}"


def test_the_cuda_numerics_keep_a_row_independent_of_the_forward(tiny_paths, monkeypatch):
    """On CUDA the invariant forward computes its attention and RMS norms in float64
    (attention.invariant_dtype: a CUDA float32 batched GEMM rounds a row by the batch's size). The
    same code in float64 on this CPU keeps the property above; the GPU's own run of it is
    ``scripts/gpu_check.py --parts engine`` (every speculative output against k = 0)."""
    import specdec.core.layer_ops as layer_ops

    asked = []

    def float64(device):
        asked.append(device)
        return torch.float64

    monkeypatch.setattr(attention, "invariant_dtype", float64)
    monkeypatch.setattr(layer_ops, "invariant_dtype", float64)
    monkeypatch.setattr(attention.cpu_attention, "kernel", lambda: None)  # the GPU's attention path
    monkeypatch.setattr(layer_ops.cpu_rows, "kernel", lambda: None)  # and its norms
    model = load_hf(tiny_paths["llama"], dtype=torch.bfloat16)
    sequence = [random.Random(5).randrange(model.config.vocab_size) for _ in range(32)]
    case = Case("llama-bf16, float64 attention and norms", model, sequence, _decode_one_by_one(model, sequence), 6)
    assert asked, "the forward never asked for its invariant dtype"
    _check_property(case, case.examples)


def test_the_torch_attention_keeps_the_property_on_a_cpu_without_a_compiler(tiny_paths, monkeypatch):
    """Above, a CPU's forward runs the compiled attention (specdec/core/cpu_attention.c); where no C
    compiler builds it, `invariant_attention_torch` keeps the property too."""
    monkeypatch.setattr(attention.cpu_attention, "kernel", lambda: None)
    model = load_hf(tiny_paths["llama"], dtype=torch.bfloat16)
    sequence = [random.Random(6).randrange(model.config.vocab_size) for _ in range(32)]
    case = Case("llama-bf16, torch's attention ops", model, sequence, _decode_one_by_one(model, sequence), 6)
    _check_property(case, case.examples)
