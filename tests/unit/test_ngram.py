"""Prompt-lookup drafter (specdec/core/ngram.py)."""

from __future__ import annotations

import random
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.core.ngram import NgramDrafter
from specdec.core.round_types import Draft


def naive_propose(seq: list[int], k: int, max_n: int, min_n: int) -> list[int]:
    """Reference: longest suffix n-gram, earliest occurrence, LZ77-style copy."""
    if k <= 0:
        return []
    L = len(seq)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        suffix = seq[L - n :]
        for i in range(L - n):
            if seq[i : i + n] == suffix:
                ext = list(seq)
                for _ in range(k):
                    ext.append(ext[len(ext) - (L - n - i)])
                return ext[L:]
    return []


def test_basic_proposal_and_point_mass_probs() -> None:
    d = NgramDrafter(max_ngram=3).propose([[10, 11, 12, 13, 14, 99, 10, 11, 12]], [2])[0]
    assert isinstance(d, Draft)
    assert d.tokens == [13, 14]
    assert d.probs == [([13], [1.0]), ([14], [1.0])]  # point masses keep rejection mode lossless


def test_prefers_longest_ngram_then_earliest() -> None:
    seq = [7, 2, 3, 70, 1, 2, 3, 50, 9, 3, 60, 1, 2, 3]
    # the 3-gram (1, 2, 3) occurs at 4 -> 50; the 2-gram (2, 3) earlier at 1 -> 70
    assert NgramDrafter(3, 1).propose_one(seq, 1).tokens == [50]
    assert NgramDrafter(2, 1).propose_one(seq, 1).tokens == [70]
    # 1-gram (3): the earliest occurrence is at 2 -> 70, not the later ones (-> 50, -> 60)
    assert NgramDrafter(1, 1).propose_one(seq, 1).tokens == [70]


def test_no_match_k0_and_short_sequences() -> None:
    d = NgramDrafter()
    assert d.propose([[1, 2, 3, 4], [5], [], [1, 1]], [3, 3, 3, 0]) == [Draft([], []) for _ in range(4)]
    assert NgramDrafter(3, 2).propose_one([1, 2, 3, 1], 2).tokens == []  # min_ngram respected


def test_continuation_copies_past_the_end() -> None:
    d = NgramDrafter()
    assert d.propose_one([7, 7, 7, 7], 5).tokens == [7] * 5  # runs keep going
    assert d.propose_one([4, 1, 2, 3, 1, 2], 6).tokens == [3, 1, 2, 3, 1, 2]  # periodic patterns too
    assert d.propose_one([1, 2, 3, 1, 2], 2).tokens == [3, 1]


def test_large_ids_and_misaligned_byte_patterns() -> None:
    # ids whose 4-byte encodings overlap at unaligned offsets must not create false matches:
    # 256 = 00 01 00 00 and 1 = 01 00 00 00; the bytes of [256, 0] contain those of [1] at offset 1.
    seq = [256, 0, 5, 1]
    assert NgramDrafter(1, 1).propose_one(seq, 2).tokens == []
    seq = [151_935, 42, 151_935]
    assert NgramDrafter().propose_one(seq, 1).tokens == [42]


@settings(max_examples=300, deadline=None)
@given(
    seq=st.lists(st.sampled_from([0, 1, 2, 256, 65536, 16777216, 151935]), max_size=40),
    k=st.integers(0, 6),
    max_n=st.integers(1, 4),
    data=st.data(),
)
def test_matches_naive_reference(seq: list[int], k: int, max_n: int, data: st.DataObject) -> None:
    min_n = data.draw(st.integers(1, max_n))
    d = NgramDrafter(max_n, min_n).propose_one(seq, k)
    assert d.tokens == naive_propose(seq, k, max_n, min_n)
    assert len(d.tokens) in (0, k)


@pytest.mark.slow  # a timing bound: opt-in (pyproject.toml, markers)
def test_fast_on_long_sequences() -> None:
    rng = random.Random(0)
    seqs = [[rng.randrange(32_000) for _ in range(4000)] for _ in range(32)]  # mostly no long match
    d = NgramDrafter(max_ngram=3)
    d.propose(seqs, [5] * 32)
    t0 = time.perf_counter()
    for _ in range(5):
        d.propose(seqs, [5] * 32)
    per_seq = (time.perf_counter() - t0) / (5 * 32)
    assert per_seq < 2e-3, f"{per_seq * 1e3:.2f} ms per 4000-token sequence"


def test_validation() -> None:
    with pytest.raises(ValueError):
        NgramDrafter(max_ngram=1, min_ngram=2)
    with pytest.raises(ValueError):
        NgramDrafter().propose([[1, 2]], [1, 2])
