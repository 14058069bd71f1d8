"""Static-shape steps (specdec/core/static_step.py) change no number and no token.

A decode or verify batch run at its bucket (padding rows, padding columns, a larger key span, the
scratch slot) gets logits bitwise equal to the runner's eager forward at the batch's own shapes, in
bf16 and float32, on tiny Llama and Qwen2 models and SmolLM2-135M, with rollbacks between steps, also
with weight GEMMs in row blocks as on CUDA (tests/unit/test_tp.py runs them sharded); the
engine's greedy and seeded tokens are the same with static shapes on and off (draft model drafter,
chunked prefill). Padding written into a real slot instead of the scratch slot is caught. Greedy
drafting with the argmax fed back on the device (specdec/core/static_greedy.py) picks what one
forward per token picks.
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoTokenizer

from specdec.core.drafters import DraftInput, ModelDrafter
from specdec.core.engine import KPolicy, SpecEngine
from specdec.core.params import SamplingParams, VerifyMode
from specdec.core.runner import ModelRunner, SlotsExhausted
from specdec.core.static_greedy import greedy_steps
from specdec.core.static_step import Bucket, StaticSteps, ladder, span_buckets
from tests.conftest import load_hf

SLOTS, MAX_LEN = 6, 300
MIN_SPAN = 64  # small span buckets, so these short sequences land in several (64, 128, 256, 320)


def _pair(
    model, slots: int = SLOTS, max_len: int = MAX_LEN, gemm_block: int | None = None
) -> tuple[ModelRunner, ModelRunner]:
    """The eager runner (the unpadded forward) and one taking the static path for what fits.
    `gemm_block`: both run their weight GEMMs in blocks of that many rows, as on CUDA."""
    eager = ModelRunner(model, num_slots=slots, max_len=max_len, static_shapes=False)
    static = ModelRunner(model, num_slots=slots, max_len=max_len, static_shapes=True)
    static.static = StaticSteps(static, max_width=16, min_span=MIN_SPAN)
    if gemm_block is not None:
        eager.gemm_block = static.gemm_block = gemm_block
    return eager, static


def _both(eager: ModelRunner, static: ModelRunner, slots, rows, n_logits, what: str) -> None:
    want = eager.forward(slots, rows, n_logits)
    got = static.forward(slots, rows, n_logits)
    for slot, g, w in zip(slots, got, want):
        assert g.shape == w.shape and torch.equal(g, w), (
            f"{what}: slot {slot}, row lengths {[len(r) for r in rows]}, "
            f"max |diff| {(g - w).abs().max().item() if g.shape == w.shape else 'shape'}"
        )
    assert static.lengths == eager.lengths and static.slot_tokens == eager.slot_tokens


def _random_steps(model, steps: int, seed: int, gemm_block: int | None = None) -> set[Bucket]:
    """Prefill the slots to mixed lengths, then random decode and verify batches (random rows, widths
    1-16, logit counts) with random rollbacks between them, on both runners; returns the buckets hit."""
    eager, static = _pair(model, gemm_block=gemm_block)
    slots = [eager.alloc_slot() for _ in range(SLOTS)]
    assert [static.alloc_slot() for _ in range(SLOTS)] == slots
    rng, vocab = random.Random(seed), model.config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in (3, 40, 70, 9, 130, 200)[:SLOTS]]
    _both(eager, static, slots, prompts, [1] * SLOTS, "prefill")
    for step in range(steps):
        rows = rng.sample(slots, rng.randint(1, SLOTS))
        feeds = [[rng.randrange(vocab) for _ in range(rng.choice([1, 1, 2, 4, 5, 9, 16]))] for _ in rows]
        feeds = [f[: MAX_LEN - eager.lengths[s]] or None for s, f in zip(rows, feeds)]
        rows, feeds = [s for s, f in zip(rows, feeds) if f], [f for f in feeds if f]
        n_logits = [rng.choice([len(f), len(f), 1, 0]) for f in feeds]
        _both(eager, static, rows, feeds, n_logits, f"step {step}")
        for slot, feed in zip(rows, feeds):  # a verify keeps an accepted prefix of what it fed
            keep = eager.lengths[slot] - rng.randint(0, len(feed) - 1)
            eager.rollback(slot, keep)
            static.rollback(slot, keep)
    assert sum(static.static.runs.values()) == steps  # every step took the static path
    return set(static.static.runs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_static_steps_give_the_eager_logits_on_tiny_models(tiny_paths, arch, dtype):
    used = _random_steps(load_hf(tiny_paths[arch], dtype=dtype), steps=40, seed=1)
    # The draws reach several buckets of each kind: rows land in different buckets.
    assert len({b.batch for b in used}) >= 3 and len({b.width for b in used}) >= 4
    assert len({b.span for b in used}) >= 2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_static_steps_give_the_eager_logits_in_gemm_blocks(tiny_paths, dtype):
    """With every weight GEMM in blocks of 8 rows (the CUDA rule, runner.gemm_block), a bucket of
    64 rows is 8 blocks where the eager forward of the same rows has fewer: the same logits."""
    _random_steps(load_hf(tiny_paths["qwen2"], dtype=dtype), steps=20, seed=3, gemm_block=8)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_static_steps_give_the_eager_logits_on_smollm(smollm_path, dtype):
    used = _random_steps(load_hf(smollm_path, dtype=dtype), steps=8, seed=2)
    assert len(used) >= 4


def test_rollback_after_a_static_verify(tiny_paths):
    """A static verify, a rollback to its accepted prefix, then other tokens: as in the eager runner,
    whose slot then holds the same tokens and gives the same logits."""
    model = load_hf(tiny_paths["qwen2"], dtype=torch.bfloat16)
    eager, static = _pair(model, slots=2)
    slots = [eager.alloc_slot(), eager.alloc_slot()]
    static.alloc_slot(), static.alloc_slot()
    _both(eager, static, slots, [list(range(10, 30)), list(range(40, 47))], [0, 0], "prefill")
    _both(eager, static, slots, [[5, 6, 7, 8, 9], [11]], [5, 1], "verify")
    for runner in (eager, static):
        runner.rollback(slots[0], 22)  # two of four drafts accepted
    _both(eager, static, slots, [[99, 98], [12, 13, 14]], [2, 3], "after the rollback")
    assert static.slot_tokens[slots[0]] == list(range(10, 30)) + [5, 6, 99, 98]


def test_buckets_scratch_slot_and_routing(tiny_paths):
    assert ladder(1) == [1] and ladder(8) == [1, 2, 4, 8] and ladder(12) == [1, 2, 4, 8, 12]
    assert span_buckets(2048) == [256, 512, 1024, 2048] and span_buckets(100) == [128]
    assert span_buckets(300, 64) == [64, 128, 256, 320]
    model = load_hf(tiny_paths["llama"])
    runner = ModelRunner(model, num_slots=3, max_len=64, static_shapes=True)
    # One KV slot more than the slots handed out: the scratch slot, never allocated.
    assert runner.k_cache.shape[1] == 4 and runner.static.scratch == 3
    assert sorted(runner.alloc_slot() for _ in range(3)) == [0, 1, 2]
    with pytest.raises(SlotsExhausted):
        runner.alloc_slot()
    assert runner.static.fits([1, 16, 3]) and not runner.static.fits([17])  # a prefill runs eagerly
    assert ModelRunner(model, num_slots=3, max_len=64).static is None  # off by default on a CPU
    # On a CPU nothing is captured: the static steps run eagerly.
    assert runner.capture() == runner.captured == {"buckets": [], "seconds": 0.0, "bytes": 0}
    assert not runner.static.graphs


def test_padding_written_into_a_real_slot_is_caught(tiny_paths):
    """Proof the comparison above can fail: a static step whose padding writes its keys into a real
    slot (slot 0, where its scratch slot should be) changes slot 0's cache, and its logits part from
    the eager runner's."""
    model = load_hf(tiny_paths["llama"], dtype=torch.bfloat16)
    eager, static = _pair(model, slots=3)
    static.static.scratch = 0
    slots = [eager.alloc_slot() for _ in range(3)]
    [static.alloc_slot() for _ in range(3)]
    _both(eager, static, slots, [[1] * 20, [2] * 20, [3] * 20], [0, 0, 0], "prefill (eager: wider than 16)")
    with pytest.raises(AssertionError, match="max"):
        for step in range(4):  # three rows in a bucket of four, 1-token rows in width 2
            _both(eager, static, slots, [[7], [8, 9], [10]], [1, 2, 1], f"step {step}")


def _engine(model, draft, static: bool, budget: int, chunk: int, tokenizer, eos) -> SpecEngine:
    target = ModelRunner(model, num_slots=3, max_len=256, static_shapes=static)
    drafter = ModelDrafter(ModelRunner(draft, num_slots=3, max_len=256, invariant_numerics=False, static_shapes=static))
    return SpecEngine(
        target, tokenizer, drafter, KPolicy(k=4), eos_token_ids=eos, max_batched_tokens=budget, prefill_chunk=chunk
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_engine_tokens_are_the_same_with_static_shapes(tiny_paths, dtype):
    """Greedy and seeded output of SpecEngine (a draft model drafting, prompts cached in chunks of 8
    and 16 tokens beside the verifies, so chunks too take the static path) is the same with static
    shapes on and off, for the target and the drafter."""
    model, draft = load_hf(tiny_paths["llama"], dtype), load_hf(tiny_paths["llama-draft"], dtype)
    tokenizer = AutoTokenizer.from_pretrained(tiny_paths["llama"])
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 250) for _ in range(n)] for n in (21, 50, 6)]
    for params in (SamplingParams(max_tokens=24), SamplingParams(max_tokens=24, temperature=0.8, seed=3)):
        for budget, chunk in ((24, 8), (40, 16)):
            out = {}
            for static in (False, True):
                engine = _engine(model, draft, static, budget, chunk, tokenizer, eos=set())
                out[static] = [r.token_ids for r in engine.generate(prompts, params)]
                if static:  # verifies, drafts and chunks of 8 or 16 tokens took the static path
                    assert sum(r.stats.drafted for r in engine.finished.values()) > 0
                    assert {b.width for b in engine.target.static.runs} >= {8, chunk}
                    assert engine.drafter.runner.static.runs
            assert out[True] == out[False], f"temperature {params.temperature}, chunks of {chunk}"
            assert all(len(t) == 24 for t in out[True])


@pytest.mark.parametrize("subset", [False, True], ids=["vocab", "vocab-subset"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_greedy_steps_pick_what_one_forward_per_token_picks(tiny_paths, dtype, subset):
    """Rows at mixed cache lengths (one crossing from the 64-key span bucket into the 128 one), six
    steps with the argmax fed back on the device: the picks, the slots' tokens and the next logits
    are those of one eager forward per token."""
    model = load_hf(tiny_paths["qwen2"], dtype=dtype)
    vocab = list(range(0, model.config.vocab_size, 2)) if subset else None
    eager = ModelRunner(model, num_slots=4, max_len=MAX_LEN, vocab_subset=vocab, static_shapes=False)
    static = ModelRunner(model, num_slots=4, max_len=MAX_LEN, vocab_subset=vocab, static_shapes=True)
    static.static = StaticSteps(static, max_width=16, min_span=MIN_SPAN)
    rng = random.Random(4)
    prompts = [[rng.randrange(model.config.vocab_size) for _ in range(n)] for n in (60, 7, 33)]
    slots = [eager.alloc_slot() for _ in prompts]
    [static.alloc_slot() for _ in prompts]
    _both(eager, static, slots, prompts, [0, 0, 0], "prefill")
    first = [5, 6, 7]
    picks = greedy_steps(static, slots, first, 6)
    want, feed = [[] for _ in slots], first
    for _ in range(6):
        logits = eager.forward(slots, [[t] for t in feed])
        feed = [int(row[0].argmax()) for row in logits]
        for w, t in zip(want, feed):
            w.append(t)
    assert picks == want
    assert static.lengths == eager.lengths and static.slot_tokens == eager.slot_tokens
    _both(eager, static, slots, [[t[-1]] for t in want], [1, 1, 1], "the step after")
    assert static.static.loops == {Bucket(4, 1, 128): 1}


def test_a_greedy_drafter_drafts_the_same_on_the_device(tiny_paths):
    """ModelDrafter on an invariant draft runner: the same greedy drafts with static shapes (its steps
    after the first in one call) as without, for rows that start from different cache states."""
    model = load_hf(tiny_paths["llama-draft"], dtype=torch.bfloat16)
    rng = random.Random(6)
    prompts = [[rng.randrange(3, 250) for _ in range(n)] for n in (12, 30, 5)]
    drafts = {}
    for static in (False, True):
        runner = ModelRunner(model, num_slots=3, max_len=128, static_shapes=static)
        drafter = ModelDrafter(runner)
        rounds = []
        for extra in range(3):  # three rounds, a token committed between them
            inputs = [
                DraftInput(f"r{i}", p + list(range(9, 9 + extra)), SamplingParams(max_tokens=8), VerifyMode.GREEDY, 5)
                for i, p in enumerate(prompts)
            ]
            rounds.append([d.tokens for d in drafter.propose(inputs)])
        drafts[static] = rounds
        if static:  # four of each round's five tokens came from one call of four steps
            assert runner.static.loops == {Bucket(3, 1, 128): 3}
    assert drafts[True] == drafts[False]
    assert all(len(t) == 5 for rounds in drafts.values() for r in rounds for t in r)


def test_a_workers_info_reports_what_its_runner_captured(tiny_paths):
    """WorkerInfo.captured: the graphs, seconds and bytes of the start-up capture. On a CPU nothing
    is captured; a GPU's capture is stood in for by setting what StaticSteps.capture would keep."""
    from specdec.core.target import TargetVerifier
    from specdec.rpc import worker_pb2
    from target_worker.servicer import TargetServicer

    model = load_hf(tiny_paths["llama"])
    tokenizer = AutoTokenizer.from_pretrained(tiny_paths["llama"])
    runner = ModelRunner(model, num_slots=2, max_len=64, static_shapes=True)
    servicer = TargetServicer(TargetVerifier(runner), tokenizer, model_name="tiny", dtype="float32", device="cpu")
    info = servicer.Info(worker_pb2.InfoRequest(), None)
    assert info.HasField("captured") and (info.captured.graphs, info.captured.bytes) == (0, 0)
    buckets = [{"batch": b, "width": 1, "span": 64, "invariant": True} for b in (1, 2)]
    runner.static.captured = {"buckets": buckets, "seconds": 1.25, "bytes": 3 << 20}  # as on a GPU
    info = servicer.Info(worker_pb2.InfoRequest(), None)
    assert (info.captured.graphs, info.captured.seconds, info.captured.bytes) == (2, 1.25, 3 << 20)
