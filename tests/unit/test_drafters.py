"""ModelDrafter with prompt lookup: the same draft tokens as drafting one token per forward, in fewer forwards."""

from __future__ import annotations

import pytest
import torch

from specdec.core.drafters import DraftInput, ModelDrafter
from specdec.core.params import SamplingParams, VerifyMode
from specdec.core.round_types import Draft
from specdec.core.runner import ModelRunner
from tests.conftest import load_hf


class CountingRunner(ModelRunner):
    """A real runner that counts its forwards."""

    forwards = 0

    def forward(self, *args, **kwargs):
        self.forwards += 1
        return super().forward(*args, **kwargs)


class OracleLookup:
    """Guesses given by the test instead of found in the text: the draft's own continuation of each
    sequence, with a wrong token at draft position `wrong_at` if given."""

    def __init__(self, full: list[list[int]], prompt_lens: list[int], wrong_at: int | None = None):
        self.full, self.prompt_lens, self.wrong_at = full, prompt_lens, wrong_at

    def propose_one(self, tokens, k: int) -> Draft:
        ((seq, start),) = [(f, n) for f, n in zip(self.full, self.prompt_lens) if f[: len(tokens)] == list(tokens)]
        guess = seq[len(tokens) : len(tokens) + k]
        if self.wrong_at is not None and len(tokens) <= start + self.wrong_at < len(tokens) + len(guess):
            guess[start + self.wrong_at - len(tokens)] = (seq[start + self.wrong_at] + 1) % 256
        return Draft(tokens=guess)


@pytest.fixture(scope="module")
def draft_model(tiny_paths):
    return load_hf(tiny_paths["llama-draft"])


def _inputs(mode: VerifyMode, k: int) -> list[DraftInput]:
    params = (
        SamplingParams(max_tokens=64)
        if mode is VerifyMode.GREEDY
        else SamplingParams(max_tokens=64, temperature=0.8, seed=3)
    )
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (7, 19)]
    return [DraftInput(f"r{i}", p, params, mode, k) for i, p in enumerate(prompts)]


def _propose(model, inputs, lookup=None, max_guesses: int = 3) -> tuple[list[list[int]], int]:
    runner = CountingRunner(model, num_slots=4, max_len=128)
    drafts = ModelDrafter(runner, lookup=lookup, max_guesses=max_guesses).propose(inputs)
    return [d.tokens for d in drafts], runner.forwards


def _oracle(inputs, drafts, wrong_at=None) -> OracleLookup:
    return OracleLookup([i.tokens + d for i, d in zip(inputs, drafts)], [len(i.tokens) for i in inputs], wrong_at)


@pytest.mark.parametrize("mode", [VerifyMode.GREEDY, VerifyMode.INVARIANT])
def test_lookup_drafts_the_same_tokens_in_fewer_forwards(draft_model, mode):
    k = 6
    inputs = _inputs(mode, k)
    plain, plain_forwards = _propose(draft_model, inputs)
    assert plain_forwards == k and all(len(t) == k for t in plain)

    # All guesses right: k - 1 guesses checked in one forward give all k tokens.
    right, forwards = _propose(draft_model, inputs, _oracle(inputs, plain), max_guesses=k - 1)
    assert right == plain and forwards == 1
    # Three guesses per forward: 4 tokens, then 1 guess for the last 2.
    right, forwards = _propose(draft_model, inputs, _oracle(inputs, plain), max_guesses=3)
    assert right == plain and forwards == 2

    # Guess 2 wrong: the model keeps guesses 0-1 and drafts its own token 2; the next forward
    # checks the (right) guesses for the rest.
    wrong, forwards = _propose(draft_model, inputs, _oracle(inputs, plain, wrong_at=2), max_guesses=k - 1)
    assert wrong == plain and forwards == 2


def test_lookup_is_not_used_in_rejection_mode(draft_model):
    inputs = _inputs(VerifyMode.REJECTION, 4)
    always = OracleLookup([i.tokens + [0] * 8 for i in inputs], [len(i.tokens) for i in inputs])
    _, forwards = _propose(draft_model, inputs, always)
    assert forwards == 4  # sampled tokens are not a function of the logits: no guess can be checked


def test_lookup_cache_state_carries_over_rounds(draft_model):
    """After a round with rejected guesses, the next round drafts from a correct cache."""
    inputs = _inputs(VerifyMode.GREEDY, 5)
    plain, _ = _propose(draft_model, inputs)
    runner = ModelRunner(draft_model, num_slots=4, max_len=128)
    drafter = ModelDrafter(runner, lookup=_oracle(inputs, plain, wrong_at=1), max_guesses=4)
    assert [d.tokens for d in drafter.propose(inputs)] == plain
    # Next round: the target accepted two draft tokens and added one of its own.
    nxt = [DraftInput(i.request_id, i.tokens + toks[:2] + [7], i.params, i.mode, 5) for i, toks in zip(inputs, plain)]
    drafter.lookup = None
    again = [d.tokens for d in drafter.propose(nxt)]
    fresh, _ = _propose(draft_model, nxt)
    assert again == fresh


def test_a_missed_guess_shrinks_the_next_forward_to_one_guess(draft_model):
    k = 6
    inputs = _inputs(VerifyMode.GREEDY, k)
    plain, _ = _propose(draft_model, inputs)
    runner = CountingRunner(draft_model, num_slots=4, max_len=128)
    rows = []
    forward = runner.forward
    runner.forward = lambda slots, feeds, n: rows.append([len(f) for f in feeds]) or forward(slots, feeds, n)
    drafter = ModelDrafter(runner, lookup=_oracle(inputs, plain, wrong_at=0), max_guesses=k - 1)
    assert [d.tokens for d in drafter.propose(inputs)] == plain
    # Forward 1: catch-up + 5 guesses, the first wrong. Forward 2: the drafted token + 1 guess
    # (right). Forward 3: back to the full budget, 2 guesses for the last 3 tokens.
    assert [r[1] for r in rows] == [len(inputs[1].tokens) + 5, 2, 3]
    assert drafter.guess_budget == {"r0": k - 1, "r1": k - 1}
    drafter.release("r0")
    assert "r0" not in drafter.guess_budget


def test_guesses_keep_a_decode_forward_within_the_cheap_rows(draft_model):
    inputs = _inputs(VerifyMode.GREEDY, 1)
    runner = CountingRunner(draft_model, num_slots=4, max_len=128)
    drafter = ModelDrafter(runner, max_guesses=3, cheap_rows=4)
    first = [d.tokens for d in drafter.propose(inputs)]  # prefill; the draft token is not cached
    # Next round: the draft token was accepted and the target added one: 2 tokens to catch up.
    nxt = [DraftInput(i.request_id, i.tokens + d + [7], i.params, i.mode, 6) for i, d in zip(inputs, first)]
    plain, _ = _propose(draft_model, nxt)
    drafter.lookup = _oracle(nxt, plain)
    rows = []
    forward = runner.forward
    runner.forward = lambda slots, feeds, n: rows.append([len(f) for f in feeds]) or forward(slots, feeds, n)
    assert [d.tokens for d in drafter.propose(nxt)] == plain
    assert rows[0] == [4, 4]  # 2 to catch up + 2 guesses, not 3


def test_the_draft_vocabulary_keeps_markup_past_its_size(smollm_path):
    """The draft's lm_head subset: the first n ids, and past them every id that is only whitespace
    and punctuation (a code fence ranked late by merge order, as Qwen2.5's "```" at 73594 is)."""
    from transformers import AutoTokenizer

    from specdec.core.build import frequency_ranked_vocab

    tok = AutoTokenizer.from_pretrained(str(smollm_path))
    fence = tok.encode("```python\n")[0]
    assert tok.decode([fence]) == "```"
    vocab = set(frequency_ranked_vocab(tok, fence))  # the fence is the first id past the n kept
    assert set(range(fence)) <= vocab and fence in vocab
    later = range(fence + 1, len(tok))
    words = [i for i in later if tok.decode([i]).strip().isalpha()]
    marks = [i for i in later if tok.decode([i]).strip() in ("))", "]]", "}}", ");", "\n\n\n")]
    assert words and not vocab & set(words)  # words past n stay out
    assert marks and set(marks) <= vocab
    assert len(vocab) < 0.5 * len(tok)


def test_a_prompt_catching_up_is_forwarded_apart_from_one_token_rows(draft_model):
    """A new request's prompt (longer than _LONG_FEED) riding with decoding rows runs in its own
    forward: one forward would pad every row's attention to the prompt's width. The drafts are
    what each row drafts on its own."""
    params = SamplingParams(max_tokens=64)
    gen = torch.Generator().manual_seed(2)
    old = [DraftInput(f"r{i}", torch.randint(0, 256, (19,), generator=gen).tolist(), params, VerifyMode.GREEDY, 1)
           for i in range(2)]  # fmt: skip
    runner = CountingRunner(draft_model, num_slots=4, max_len=128)
    drafter = ModelDrafter(runner)
    first = [d.tokens for d in drafter.propose(old)]
    decoding = [DraftInput(i.request_id, i.tokens + d, params, VerifyMode.GREEDY, 3) for i, d in zip(old, first)]
    new = DraftInput("new", torch.randint(0, 256, (60,), generator=gen).tolist(), params, VerifyMode.GREEDY, 3)
    alone = [_propose(draft_model, [i])[0][0] for i in (*decoding, new)]
    rows = []
    forward = runner.forward
    runner.forward = lambda slots, feeds, n: rows.append([len(f) for f in feeds]) or forward(slots, feeds, n)
    assert [d.tokens for d in drafter.propose([*decoding, new])] == alone
    assert rows[:2] == [[60], [1, 1]]  # the prompt apart, then the decoding rows' first step
    assert all(len(r) == 3 for r in rows[2:])  # then all three draft together
