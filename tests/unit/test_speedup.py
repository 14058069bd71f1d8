"""Speed model (specdec/core/speedup.py) and adaptive k (specdec/core/adaptive_k.py)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.core.adaptive_k import AdaptiveK
from specdec.core.speedup import (
    best_k,
    estimate_acceptance,
    expected_tokens,
    goodput,
    pipelined_speedup,
    predraft_speedup,
    speedup,
)

acc = st.floats(0.0, 1.0)
cost = st.floats(0.0, 2.0)
ks = st.integers(0, 16)


@settings(max_examples=200, deadline=None)
@given(a=acc, k=ks)
def test_expected_tokens_is_the_geometric_sum(a: float, k: int) -> None:
    assert expected_tokens(a, k) == pytest.approx(sum(a**i for i in range(k + 1)), rel=1e-9)


def test_expected_tokens_and_speedup_values() -> None:
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    assert speedup(0.5, 0.1, 2) == pytest.approx(1.75 / 1.2)
    assert speedup(0.9, 0.4, 0) == 1.0  # k = 0 is plain decoding
    # a ~ 0.6 with a draft step 0.4 of the target's -> modest gains, best at small k
    assert 1.0 < speedup(0.6, 0.4, 2) < 1.2
    with pytest.raises(ValueError):
        expected_tokens(1.5, 2)
    with pytest.raises(ValueError):
        speedup(0.5, -0.1, 2)


def simulate_tau(a: float, k: int, rounds: int, rng: random.Random) -> float:
    total = 0
    for _ in range(rounds):
        n = 0
        while n < k and rng.random() < a:
            n += 1
        total += n + 1
    return total / rounds


def test_expected_tokens_matches_simulation() -> None:
    rng = random.Random(0)
    for a, k in [(0.3, 3), (0.8, 5), (0.95, 8)]:
        assert simulate_tau(a, k, 20_000, rng) == pytest.approx(expected_tokens(a, k), rel=0.02)


@settings(max_examples=200, deadline=None)
@given(a=acc, c=cost, k_max=st.integers(0, 12))
def test_best_k_is_the_argmax(a: float, c: float, k_max: int) -> None:
    k = best_k(a, c, k_max)
    assert 0 <= k <= k_max
    assert speedup(a, c, k) >= max(speedup(a, c, j) for j in range(k_max + 1)) * (1 - 1e-9)


def test_best_k_edges() -> None:
    assert best_k(0.0, 0.4, 8) == 0  # nothing is ever accepted: do not speculate
    assert best_k(1.0, 0.4, 8) == 8  # everything accepted and drafting is cheaper than verifying
    assert best_k(0.8, 0.05, 10) > best_k(0.8, 0.5, 10)  # cheaper drafts -> longer drafts
    assert best_k(0.0, 0.4, 8, k_min=1) == 1


@settings(max_examples=200, deadline=None)
@given(a=acc, c=cost, k=ks)
def test_pipelined_formulas(a: float, c: float, k: int) -> None:
    ideal = pipelined_speedup(a, c, k)
    assert ideal == pytest.approx(expected_tokens(a, k) / max(1.0, k * c))
    assert pipelined_speedup(a, c, k, hit_rate=0.0) == pytest.approx(speedup(a, c, k))
    pre = predraft_speedup(a, c, k)
    assert speedup(a, c, k) * (1 - 1e-12) <= pre <= ideal * (1 + 1e-12)


def test_goodput_shrinks_k_when_compute_bound() -> None:
    # step time flat up to 64 tokens (memory-bound), then linear (compute-bound)
    def step_time(n_tokens: int) -> float:
        return 0.02 * max(1.0, n_tokens / 64)

    a = 0.7
    best_small = max(range(9), key=lambda k: goodput(a, k, 2, step_time))
    best_large = max(range(9), key=lambda k: goodput(a, k, 128, step_time))
    assert best_small > 0 and best_large == 0
    assert goodput(a, 0, 1, step_time) == pytest.approx(1 / 0.02)


def simulate_rounds(a: float, k_list: list[int], rng: random.Random) -> list[int]:
    out = []
    for k in k_list:
        n = 0
        while n < k and rng.random() < a:
            n += 1
        out.append(n)
    return out


def test_estimate_acceptance_is_the_unbiased_mle() -> None:
    rng = random.Random(1)
    for a in [0.2, 0.6, 0.9]:
        k_list = [rng.randint(0, 6) for _ in range(20_000)]
        n_list = simulate_rounds(a, k_list, rng)
        assert estimate_acceptance(n_list, k_list) == pytest.approx(a, abs=0.01)
        # the naive ratio accepted / drafted is biased low (untested tokens after a rejection)
        naive = sum(n_list) / sum(k_list)
        assert naive < a - 0.03
    assert estimate_acceptance([3, 3], [3, 3]) == 1.0
    assert estimate_acceptance([0, 0], [2, 1]) == 0.0
    assert estimate_acceptance([], [], default=0.5) == 0.5
    assert estimate_acceptance([0], [0], default=0.25) == 0.25  # k = 0 rounds carry no information
    with pytest.raises(ValueError):
        estimate_acceptance([4], [3])
    with pytest.raises(ValueError):
        estimate_acceptance([1], [1, 2])


# ------------------------------------------------------------------------------------------
# AdaptiveK
# ------------------------------------------------------------------------------------------


def drive(ak: AdaptiveK, a: float, rounds: int, rng: random.Random) -> list[int]:
    chosen = []
    for _ in range(rounds):
        k = ak.next_k()
        chosen.append(k)
        (n,) = simulate_rounds(a, [k], rng)
        ak.update(k, n)
    return chosen


def test_adaptive_k_moves_up_with_high_acceptance_and_down_with_low() -> None:
    rng = random.Random(2)
    ak = AdaptiveK(k_max=8, k_init=3, c=0.2)
    assert ak.next_k() == 3
    high = drive(ak, 0.95, 60, rng)
    assert high[-1] >= 6 and ak.acceptance > 0.8
    low = drive(ak, 0.05, 60, rng)
    assert low[-1] == 1, "k_min defaults to 1: speculation never stops entirely"
    assert min(low) >= 1 and ak.acceptance < 0.3
    # ... and recovers when acceptance comes back (still learning at k = 1)
    again = drive(ak, 0.95, 60, rng)
    assert again[-1] >= 6


def test_adaptive_k_bounds_and_updates() -> None:
    ak = AdaptiveK(k_max=4, k_min=0, c=0.5)
    for _ in range(30):
        ak.update(4, 0)
    assert ak.next_k() == 0  # k_min=0 allows switching speculation off
    before = ak.acceptance
    ak.update(0, 0)  # a k=0 round (fail open) tests nothing
    assert ak.acceptance == before
    with pytest.raises(ValueError):
        ak.update(2, 3)
    with pytest.raises(ValueError):
        AdaptiveK(k_max=2, k_min=3)
    assert AdaptiveK(k_max=5, k_init=9).next_k() == 5
    # with the prior alone, k is best_k at the prior acceptance
    prior = AdaptiveK(k_max=8, c=0.4, prior_acceptance=0.6)
    assert prior.next_k() == max(1, best_k(0.6, 0.4, 8))
