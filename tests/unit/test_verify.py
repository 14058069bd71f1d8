"""Lossless verification (specdec/core/verify.py): greedy, rejection sampling, drafter-invariant sampling."""

from __future__ import annotations

import functools
import logging
import random
from collections.abc import Callable

import numpy as np
import pytest
import torch

from specdec.core import verify as verify_mod
from specdec.core.params import InvalidParams, SamplingParams, VerifyMode, choose_mode
from specdec.core.round_types import Draft
from specdec.core.sampling import gumbel_noise, make_generator, process_logits, sample_sparse
from specdec.core.verify import verify
from tests.conftest import chi2_pvalue
from tests.reference_sampling import sample_token

CHI2_ALPHA = 1e-3


# ------------------------------------------------------------------------------------------
# Greedy
# ------------------------------------------------------------------------------------------


def one_hot_logits(argmaxes: list[int], v: int = 8) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(len(argmaxes), v, generator=g)
    for i, a in enumerate(argmaxes):
        x[i, a] = 10.0
    return x


GREEDY = SamplingParams()


@pytest.mark.parametrize(
    "draft, tokens, accepted",
    [
        ([3, 1, 5], [3, 1, 4], 2),  # accepted prefix, then the target's correction
        ([3, 1, 4], [3, 1, 4, 2], 3),  # all accepted, then the bonus token
        ([0, 1, 4], [3], 0),  # first mismatch stops everything after it
        ([], [3], 0),  # k = 0 is plain decoding
    ],
)
def test_greedy(draft: list[int], tokens: list[int], accepted: int) -> None:
    logits = one_hot_logits([3, 1, 4, 2][: len(draft) + 1])
    r = verify(logits, Draft(draft), GREEDY, VerifyMode.GREEDY, start_pos=0, generator=None)
    assert r.tokens == tokens and r.num_accepted == accepted
    assert len(r.tokens) == r.num_accepted + 1
    # bf16 logits give the same answer (argmax of the raw logits)
    r16 = verify(logits.bfloat16(), Draft(draft), GREEDY, VerifyMode.GREEDY, start_pos=0, generator=None)
    assert r16.tokens == tokens


def test_greedy_matches_target_only_argmax_on_near_ties() -> None:
    # A near-tie that log_softmax could merge: greedy verification uses the raw logits' argmax.
    x = torch.tensor([[1e4, 1e4 + 0.001, 0.0]])
    r = verify(x, Draft([]), GREEDY, VerifyMode.GREEDY, start_pos=0, generator=None)
    assert r.tokens == [int(torch.argmax(x[0]))] == [1]


# ------------------------------------------------------------------------------------------
# Mode selection and input checks
# ------------------------------------------------------------------------------------------


def test_choose_mode() -> None:
    seeded = SamplingParams(temperature=0.8, seed=1)
    unseeded = SamplingParams(temperature=0.8)
    assert choose_mode(SamplingParams()) is VerifyMode.GREEDY
    assert choose_mode(SamplingParams(seed=3), "rejection") is VerifyMode.GREEDY
    assert choose_mode(seeded) is VerifyMode.INVARIANT
    assert choose_mode(seeded, "rejection") is VerifyMode.REJECTION
    assert choose_mode(unseeded) is VerifyMode.REJECTION
    assert choose_mode(unseeded, VerifyMode.REJECTION) is VerifyMode.REJECTION
    for bad, params in [("invariant", unseeded), ("greedy", unseeded), ("typical", seeded)]:
        with pytest.raises(InvalidParams) as err:
            choose_mode(params, bad)
        assert err.value.field == "verify_mode"


def test_input_checks() -> None:
    x = torch.randn(3, 8)
    with pytest.raises(ValueError, match=r"\[k\+1, V\]"):
        verify(x, Draft([1]), GREEDY, VerifyMode.GREEDY, start_pos=0, generator=None)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        verify(x, Draft([1, 8]), GREEDY, VerifyMode.GREEDY, start_pos=0, generator=None)
    with pytest.raises(ValueError, match="distributions"):
        verify(x, Draft([1, 2], [([1], [1.0])]), GREEDY, VerifyMode.GREEDY, start_pos=0, generator=None)
    with pytest.raises(InvalidParams):
        verify(x[:1], Draft([]), SamplingParams(temperature=1.0), VerifyMode.INVARIANT, start_pos=0, generator=None)
    # a 1-D row is accepted for k = 0
    assert len(verify(x[0], Draft([]), GREEDY, VerifyMode.GREEDY, start_pos=0, generator=None).tokens) == 1


# ------------------------------------------------------------------------------------------
# Rejection sampling: the first two generated tokens follow the target's exact joint distribution
# ------------------------------------------------------------------------------------------

V = 6
ALL = list(range(V))
SAMPLING = SamplingParams(temperature=1.0)


@functools.cache
def rejection_setup() -> dict:
    """Fixed target and draft distributions.  The target's 2nd-token distribution is conditioned on
    the 1st token (P2[y1]), as a real model's would be; so is the drafter's (Q2[x1])."""
    g = torch.Generator().manual_seed(2024)
    p1 = torch.softmax(torch.randn(V, generator=g), -1)
    p2 = torch.softmax(torch.randn(V, V, generator=g), -1)
    p3 = torch.softmax(torch.randn(V, generator=g), -1)
    # Draft: position 1 is a top-4 sparse distribution (zero outside its ids), position 2 dense.
    q1_ids = [4, 0, 2, 5]
    q1 = torch.softmax(torch.randn(4, generator=g) * 1.5, -1).tolist()
    q2 = torch.softmax(torch.randn(V, V, generator=g) * 1.5, -1).tolist()
    lp1, lp2, lp3 = p1.log(), p2.log(), p3.log()
    return {
        "joint": (p1[:, None] * p2).flatten().double().numpy(),
        "q1": (q1_ids, q1),
        "q2": [(ALL, q2[x]) for x in range(V)],
        "round1": [torch.stack([lp1, lp2[x], lp3]) for x in range(V)],  # rows given draft x1
        "round2": [torch.stack([lp2[y], lp3]) for y in range(V)],  # next round after y1 alone
    }


def sample_first_two_tokens(n: int, seed: int) -> np.ndarray:
    """n independent generations of two tokens through speculative rounds, as the engine runs them:
    round 1 drafts k=2; if it ends after one token, round 2 (k=1) produces the second."""
    s = rejection_setup()
    g = make_generator(seed)
    out = np.empty(n, dtype=np.int64)
    for i in range(n):
        x1 = sample_sparse(*s["q1"], g)
        x2 = sample_sparse(*s["q2"][x1], g)
        draft = Draft([x1, x2], [s["q1"], s["q2"][x1]])
        r = verify(s["round1"][x1], draft, SAMPLING, VerifyMode.REJECTION, start_pos=5, generator=g)
        assert len(r.tokens) == r.num_accepted + 1
        y1 = r.tokens[0]
        if len(r.tokens) >= 2:
            y2 = r.tokens[1]
        else:
            x = sample_sparse(*s["q2"][y1], g)
            r2 = verify(
                s["round2"][y1], Draft([x], [s["q2"][y1]]), SAMPLING, VerifyMode.REJECTION, start_pos=6, generator=g
            )
            y2 = r2.tokens[0]
        out[i] = y1 * V + y2
    return out


def test_rejection_sampling_is_lossless_and_catches_a_skipped_correction(monkeypatch) -> None:
    n = 20_000
    joint = rejection_setup()["joint"]
    p_ok = chi2_pvalue(sample_first_two_tokens(n, seed=1), joint)
    assert p_ok > CHI2_ALPHA, f"rejection sampling output differs from the target (p={p_ok:.2e})"

    # Broken verifier: on rejection, draw the correction from p instead of norm(max(0, p - q)).
    monkeypatch.setattr(verify_mod, "_residual", lambda p, q_ids, q_probs: p)
    p_broken = chi2_pvalue(sample_first_two_tokens(n, seed=1), joint)
    assert p_broken < CHI2_ALPHA, f"the chi-square test missed a broken verifier (p={p_broken:.2e})"


@pytest.mark.parametrize("probs_kind", ["none", "point_mass"])
def test_rejection_lossless_for_point_mass_drafts_with_top_k(probs_kind: str) -> None:
    """n-gram style drafts (no q, or q = delta) stay lossless against the *processed* target
    distribution (temperature + top_k), including drafts of tokens that top_k masks out."""
    params = SamplingParams(temperature=0.7, top_k=5)
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(2, 8, generator=g) * 1.5
    target = process_logits(logits[0], params).exp().double().numpy()
    assert (target == 0).sum() == 3
    gen = make_generator(11)
    rng = random.Random(5)
    samples = []
    for _ in range(12_000):
        x = rng.randrange(8)  # any rule for choosing the draft token, including masked tokens
        probs = None if probs_kind == "none" else [([x], [1.0])]
        r = verify(logits, Draft([x], probs), params, VerifyMode.REJECTION, start_pos=0, generator=gen)
        if target[x] == 0:
            assert r.num_accepted == 0 and r.tokens[0] != x
        samples.append(r.tokens[0])
    assert chi2_pvalue(samples, target) > CHI2_ALPHA


def test_residual_edge_cases(caplog) -> None:
    p = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    # p == q: no residual mass, fall back to p
    assert torch.equal(verify_mod._residual(p, [0, 1, 2], [0.5, 0.3, 0.2]), p)
    r = verify_mod._residual(p, [0], [0.9])  # q zero outside its ids
    assert torch.allclose(r, torch.tensor([0.0, 0.3, 0.2], dtype=torch.float64))
    # a peaked target and a matching point-mass draft: always accepted, bonus drawn from p
    logits = torch.tensor([[0.0, 50.0, 0.0], [50.0, 0.0, 0.0]])
    gen = make_generator(0)
    for _ in range(20):
        r = verify(logits, Draft([1], [([1], [1.0])]), SAMPLING, VerifyMode.REJECTION, start_pos=0, generator=gen)
        assert r.tokens == [1, 0] and r.num_accepted == 1
    # a draft token missing from its own q is verified as a point mass (and logged)
    with caplog.at_level(logging.WARNING, logger="specdec.core.verify"):
        r = verify(
            logits, Draft([1], [([0, 2], [0.5, 0.5])]), SAMPLING, VerifyMode.REJECTION, start_pos=0, generator=gen
        )
    assert r.tokens == [1, 0]
    assert "point mass" in caplog.text


def test_rejection_seeded_generator_is_reproducible() -> None:
    g = torch.Generator().manual_seed(3)
    rows = []
    for i in range(5):
        k = i % 4
        logits = torch.randn(k + 1, 16, generator=g)
        draft = Draft([int(t) for t in torch.randint(0, 16, (k,), generator=g)], None)
        rows.append((logits, draft, 10 * i))
    runs = [
        [
            verify(lg, d, SAMPLING, VerifyMode.REJECTION, start_pos=sp, generator=make_generator(i)).tokens
            for i, (lg, d, sp) in enumerate(rows)
        ]
        for _ in range(2)
    ]
    assert runs[0] == runs[1]


# ------------------------------------------------------------------------------------------
# Invariant mode: identical to target-only seeded sampling for any drafter, k and split
# ------------------------------------------------------------------------------------------

VI = 40


@functools.cache
def model_row(ctx: tuple[int, ...], salt: int = 0) -> torch.Tensor:
    """A deterministic 'language model': logits as a function of the whole context."""
    g = torch.Generator().manual_seed(hash((salt, *ctx)) % 2**63)
    return torch.randn(VI, generator=g) * 2.5


def target_only(prompt: list[int], params: SamplingParams, n: int) -> list[int]:
    ctx = list(prompt)
    for _ in range(n):
        logp = process_logits(model_row(tuple(ctx)), params)
        ctx.append(sample_token(logp, params, generator=None, position=len(ctx)))
    return ctx[len(prompt) :]


Drafter = Callable[[list[int], int, SamplingParams], list[int]]


def random_drafter(rng: random.Random) -> Drafter:
    return lambda ctx, k, params: [rng.randrange(VI) for _ in range(k)]


def same_noise_drafter(weight: float) -> Drafter:
    """A different model (target + weight * other) sampling with the same (seed, position) noise."""

    def draft(ctx: list[int], k: int, params: SamplingParams) -> list[int]:
        out: list[int] = []
        for j in range(k):
            c = tuple(ctx + out)
            logits = model_row(c) + weight * model_row(c, salt=1)
            logp = process_logits(logits, params)
            out.append(int(torch.argmax(logp + gumbel_noise(params.seed, len(ctx) + j, VI))))
        return out

    return draft


def speculative(
    prompt: list[int], params: SamplingParams, n: int, drafter: Drafter, ks: Callable[[], int]
) -> tuple[list[int], int, int]:
    """Engine-like loop; returns (first n tokens, draft tokens accepted, draft tokens proposed)."""
    ctx = list(prompt)
    accepted = drafted = 0
    while len(ctx) - len(prompt) < n:
        d = drafter(ctx, ks(), params)
        rows = torch.stack([model_row(tuple(ctx + d[:j])) for j in range(len(d) + 1)])
        r = verify(rows, Draft(d), params, VerifyMode.INVARIANT, start_pos=len(ctx), generator=None)
        assert len(r.tokens) == r.num_accepted + 1 and r.tokens[: r.num_accepted] == d[: r.num_accepted]
        accepted += r.num_accepted
        drafted += len(d)
        ctx += r.tokens
    return ctx[len(prompt) :][:n], accepted, drafted


INVARIANT_PARAMS = [
    SamplingParams(temperature=1.0, seed=0),
    SamplingParams(temperature=0.7, top_k=8, seed=123456789),
    SamplingParams(temperature=1.3, top_p=0.8, seed=2**64 - 1),
]


@pytest.mark.parametrize("params", INVARIANT_PARAMS)
def test_invariant_output_identical_to_target_only(params: SamplingParams) -> None:
    n = 24
    prompt = [1, 2, 3]
    ref = target_only(prompt, params, n)
    rng = random.Random(params.seed)
    drafters: dict[str, Drafter] = {
        "random": random_drafter(rng),
        "same-noise, other model": same_noise_drafter(0.7),
        "same-noise, target itself": same_noise_drafter(0.0),
    }
    stats_seen: list[tuple[int, int]] = []
    for name, drafter in drafters.items():
        for ks in [lambda: 0, lambda: 1, lambda: 5, lambda: rng.randint(0, 6)]:
            out, accepted, drafted = speculative(prompt, params, n, drafter, ks)
            assert out == ref, f"{name}: speculative output differs from target-only sampling"
            if name == "same-noise, target itself":
                assert accepted == drafted, "the target's own proposals must all be accepted"
            elif name == "same-noise, other model" and drafted:
                stats_seen.append((accepted, drafted))
    # the test must exercise both acceptances and rejections
    assert sum(a for a, _ in stats_seen) > 0 and any(a < d for a, d in stats_seen)


def test_invariant_check_catches_misaligned_noise(monkeypatch) -> None:
    """The comparison above fails for a verifier whose noise is not keyed by absolute position."""
    params = INVARIANT_PARAMS[0]
    ref = target_only([1, 2, 3], params, 16)
    real = gumbel_noise
    monkeypatch.setattr(verify_mod, "gumbel_noise", lambda s, pos, v, device=None: real(s, pos + 1, v))
    out, _, _ = speculative([1, 2, 3], params, 16, same_noise_drafter(0.7), lambda: 3)
    assert out != ref


def test_k0_in_every_mode() -> None:
    logits = torch.randn(1, 10)
    for mode, params in [
        (VerifyMode.GREEDY, GREEDY),
        (VerifyMode.REJECTION, SAMPLING),
        (VerifyMode.INVARIANT, SamplingParams(temperature=1.0, seed=4)),
    ]:
        r = verify(logits, Draft([]), params, mode, start_pos=3, generator=make_generator(0))
        assert r.num_accepted == 0 and len(r.tokens) == 1 and 0 <= r.tokens[0] < 10
