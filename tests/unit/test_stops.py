"""Stops inside accepted chunks (specdec/core/stops.py, docs/design.md, invariant 5)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.core.params import SamplingParams
from specdec.core.stops import StopChecker

# A toy byte-level vocabulary: id -> bytes.  "é" is split over two tokens (ids 20, 21).
PIECES: dict[int, bytes] = {
    0: b"<eos>",
    1: b"Hel",
    2: b"lo",
    3: b" wor",
    4: b"ld",
    5: b"!",
    6: b" ",
    7: b"a",
    8: b"b",
    9: b"\n",
    10: b"END",
    11: b"<stop>",
    20: b"\xc3",
    21: b"\xa9",
}
EOS = 0


class Decoder:
    """decode(ids) -> str that records how many ids it was asked to decode."""

    def __init__(self) -> None:
        self.max_len = 0
        self.calls = 0

    def __call__(self, ids: list[int]) -> str:
        self.calls += 1
        self.max_len = max(self.max_len, len(ids))
        return b"".join(PIECES[i] for i in ids).decode("utf-8", errors="replace")


def checker(**kw) -> tuple[StopChecker, Decoder]:
    dec = Decoder()
    return StopChecker(SamplingParams(**kw), {EOS}, dec), dec


def test_stop_string_spanning_tokens() -> None:
    c, _ = checker(stop=("o wo",))
    assert c.accept([1]) == ([1], None)
    assert c.accept([2]) == ([2], None)
    # " wor" completes "o wo" across the token boundary: committed, text cut before the stop string
    assert c.accept([3, 4, 5]) == ([3], "stop")
    assert c.text == "Hell"
    assert c.tokens == [1, 2, 3] and c.num_generated == 3


def test_stop_inside_accepted_chunk_commits_nothing_after_it() -> None:
    c, _ = checker(stop=("lo w",), max_tokens=50)
    committed, reason = c.accept([1, 2, 3, 4, 5, 6])
    assert committed == [1, 2, 3] and reason == "stop"
    assert c.text == "Hel"
    assert c.num_generated == 3
    # finished: further rounds commit nothing and keep the reason
    assert c.accept([7, 8]) == ([], "stop")
    assert c.tokens == [1, 2, 3]


def test_earliest_stop_string_wins() -> None:
    c, _ = checker(stop=("world", "lo"))
    assert c.accept([1, 2, 3, 4]) == ([1, 2], "stop")
    assert c.text == "Hel"


def test_max_tokens_inside_chunk() -> None:
    c, _ = checker(max_tokens=3)
    assert c.accept([1, 2]) == ([1, 2], None)
    assert c.accept([3, 4, 5, 6]) == ([3], "length")
    assert c.text == "Hello wor"
    assert c.num_generated == 3


def test_eos_as_bonus_token() -> None:
    c, _ = checker()
    assert c.accept([1, 2, EOS]) == ([1, 2, EOS], "stop")  # EOS is committed ...
    assert c.text == "Hello"  # ... but not part of the text


def test_eos_mid_chunk_and_stop_beats_length() -> None:
    c, _ = checker(max_tokens=3)
    assert c.accept([1, 2, EOS, 3]) == ([1, 2, EOS], "stop")
    c, _ = checker()
    assert c.accept([EOS, 1]) == ([EOS], "stop") and c.text == ""


def test_ignore_eos_and_stop_token_ids() -> None:
    c, _ = checker(ignore_eos=True, stop_token_ids=(11,))
    assert c.accept([1, EOS, 2]) == ([1, EOS, 2], None)
    assert c.text == "Hel<eos>lo"
    assert c.accept([5, 11, 3]) == ([5, 11], "stop")  # stop ids still apply with ignore_eos
    assert c.text == "Hel<eos>lo!"


def test_empty_round_and_single_token_rounds() -> None:
    c, _ = checker(max_tokens=2)
    assert c.accept([]) == ([], None)  # a draft-less round that produced nothing
    assert c.accept([7]) == ([7], None)
    assert c.accept([]) == ([], None)
    assert c.accept([8]) == ([8], "length")
    assert c.text == "ab"


def test_multibyte_character_split_across_tokens() -> None:
    c, _ = checker(stop=("é!",))
    c.accept([7, 20])
    assert c.text == "a"  # half a character is held back, never emitted as U+FFFD
    c.accept([21])
    assert c.text == "aé"
    assert c.accept([5, 7]) == ([5], "stop")
    assert c.text == "a"
    # a finish flushes a held-back partial character
    c, _ = checker(max_tokens=2)
    assert c.accept([7, 20]) == ([7, 20], "length")
    assert c.text == "a\ufffd"


def test_stable_text_holds_back_a_possible_stop_prefix() -> None:
    c, _ = checker(stop=("END!",))
    c.accept([7, 10])
    assert c.text == "aEND" and c.stable_text == "a"
    c.accept([8])
    assert c.stable_text == c.text == "aENDb"


def test_prompt_context_and_no_match_in_prompt() -> None:
    dec = Decoder()
    c = StopChecker(SamplingParams(stop=("Hel",)), {EOS}, dec, prompt_tokens=[1, 2, 1])
    assert c.accept([6, 7]) == ([6, 7], None)  # "Hel" in the prompt does not stop generation
    assert c.text == " a"


def test_decodes_only_a_tail_window() -> None:
    c, dec = checker(max_tokens=5000, stop=("zzz",))
    rng = random.Random(0)
    toks = [rng.choice([1, 2, 3, 4, 5, 6, 7, 8, 9]) for _ in range(3000)]
    for i in range(0, 3000, 7):
        c.accept(toks[i : i + 7])
    assert c.num_generated == 3000
    assert dec.max_len <= 4, "decode must see a short window, not the whole text"
    assert c.text == "".join(PIECES[t].decode() for t in toks)


def reference(tokens: list[int], params: SamplingParams) -> tuple[list[int], str, str | None]:
    """Naive reference: decode everything after every token."""
    out: list[int] = []
    text_toks: list[int] = []
    for t in tokens:
        out.append(t)
        if t == EOS and not params.ignore_eos or t in params.stop_token_ids:
            return out, Decoder()(text_toks), "stop"
        text_toks.append(t)
        text = Decoder()(text_toks)
        if not text.endswith("\ufffd"):
            hits = [text.find(s) for s in params.stop if s in text]
            if hits:
                return out, text[: min(hits)], "stop"
        if len(out) >= params.max_tokens:
            return out, text, "length"
    text = Decoder()(text_toks)
    return out, text, None


@settings(max_examples=150, deadline=None)
@given(
    tokens=st.lists(st.sampled_from(sorted(PIECES)), max_size=30),
    cuts=st.lists(st.integers(0, 30), max_size=8),
    stop=st.lists(st.sampled_from(["lo", "o w", "ab", "é", "ld!", "\nEND", "b b"]), max_size=3),
    max_tokens=st.integers(1, 40),
    ignore_eos=st.booleans(),
)
def test_matches_naive_reference_for_any_chunking(tokens, cuts, stop, max_tokens, ignore_eos) -> None:
    params = SamplingParams(stop=tuple(stop), max_tokens=max_tokens, ignore_eos=ignore_eos, stop_token_ids=(11,))
    c = StopChecker(params, {EOS}, Decoder())
    bounds = sorted({0, len(tokens), *[min(x, len(tokens)) for x in cuts]})
    committed: list[int] = []
    reason = None
    for a, b in zip(bounds, bounds[1:]):
        got, reason = c.accept(tokens[a:b])
        committed += got
    ref_tokens, ref_text, ref_reason = reference(tokens, params)
    assert committed == ref_tokens == c.tokens
    assert reason == ref_reason == c.finish_reason
    if ref_reason is not None:
        assert c.text == ref_text
    else:  # unfinished: trailing bytes that do not form a character yet may be held back
        held = ref_text[len(c.text) :]
        assert ref_text.startswith(c.text) and (held == "" or held.endswith("\ufffd"))


@pytest.mark.parametrize(
    "params, reason", [(SamplingParams(max_tokens=1), "length"), (SamplingParams(stop=("Hel",)), "stop")]
)
def test_first_token_can_finish(params: SamplingParams, reason: str) -> None:
    c = StopChecker(params, {EOS}, Decoder())
    assert c.accept([1, 2]) == ([1], reason)
    assert c.finished and c.num_generated == 1
