"""Torch-free request state: k bounds, the measured cost ratio, committing through stops."""

from __future__ import annotations

from specdec.core.params import SamplingParams, VerifyMode
from specdec.core.request_state import CostMeter, KPolicy, new_request


def _request(max_tokens=10, policy=None, prompt=(1, 2, 3)):
    policy = policy or KPolicy(k=4)
    return new_request(
        "r",
        list(prompt),
        SamplingParams(max_tokens=max_tokens),
        VerifyMode.GREEDY,
        policy,
        eos_token_ids={0},
        decode=lambda ids: "".join(chr(97 + i % 26) for i in ids),
    )


def test_cost_meter_moves_towards_measured_ratio():
    meter = CostMeter(c=0.4, weight=0.5)
    for _ in range(10):
        meter.update(draft_seconds=0.4, draft_steps=4, verify_seconds=1.0)  # 0.1 s a step vs 1 s
    assert abs(meter.c - 0.1) < 1e-3
    assert meter.update(0.0, 0, 1.0) == meter.c  # a round without drafting teaches nothing


def test_cost_meter_fits_the_verify_cost_per_token():
    meter = CostMeter(c=0.1)
    for _ in range(20):  # all rounds verify 5 tokens: no slope to see
        meter.update(0.04, 4, 0.25, verified_tokens=5)
    assert meter.r == 0.0 and meter.per_token == meter.c
    for _ in range(100):  # a verify of n tokens takes 0.2 + 0.01 n seconds
        for n in (1, 3, 5, 9, 13):
            meter.update(0.04, 4, 0.2 + 0.01 * n, verified_tokens=n)
    assert abs(meter.r - 0.01 / 0.21) < 1e-3
    assert abs(meter.per_token - (meter.c + meter.r)) < 1e-12


def test_next_k_is_bounded_by_remaining_tokens_and_context():
    req = _request(max_tokens=3)
    assert req.next_k(max_context=100) == 2  # the target adds one token itself
    req.commit([5, 6], num_accepted=1, drafted=2, max_context=100)
    assert req.next_k(max_context=100) == 0
    assert _request(max_tokens=50).next_k(max_context=5) == 2  # 3 prompt tokens, 5 of context


def test_adaptive_k_grows_when_drafting_is_cheap():
    policy = KPolicy(k=2, adaptive=True, k_max=8)
    cheap, dear = _request(max_tokens=100, policy=policy), _request(max_tokens=100, policy=policy)
    for req in (cheap, dear):
        for _ in range(5):
            req.commit([7, 8, 9, 10, 11], num_accepted=4, drafted=4, max_context=1000)
    assert cheap.next_k(1000, cost_ratio=0.05) > dear.next_k(1000, cost_ratio=0.9)


def test_commit_applies_stops_and_counts_only_emitted():
    req = _request(max_tokens=10)
    committed = req.commit([5, 0, 6], num_accepted=2, drafted=2, max_context=100)
    assert committed == [5, 0] and req.finish_reason == "stop"
    assert req.stats.accepted == 2 and req.stats.drafted == 2 and req.generated == [5, 0]
