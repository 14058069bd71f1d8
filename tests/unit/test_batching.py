"""The router's scheduling decisions as plain functions (router/policy.py), shared with the capacity simulator."""

from __future__ import annotations

import pytest

from router import policy, rebalance
from router.config import RouterConfig
from specdec.core.params import SamplingParams, VerifyMode
from specdec.core.request_state import CostMeter, KPolicy, new_request


def _state(k_policy: KPolicy, max_tokens: int = 64, prompt: int = 10):
    params = SamplingParams(max_tokens=max_tokens)
    return new_request("r", [1] * prompt, params, VerifyMode.GREEDY, k_policy, set(), str)


def test_capacity_is_the_smallest_of_slots_max_batch_and_draft_slots():
    assert policy.batch_capacity(8, 0) == 8
    assert policy.batch_capacity(8, 4) == 4
    assert policy.batch_capacity(8, 0, draft_slots=6) == 6
    assert policy.batch_capacity(8, 16, draft_slots=None) == 8


def test_auto_resolves_to_the_default_mode_and_ngram_without_a_draft_worker():
    assert policy.resolve_spec("auto", "draft", True) == ("draft", True)
    assert policy.resolve_spec("auto", "draft", False) == ("ngram", True)
    assert policy.resolve_spec("auto", "off", True) == ("off", True)
    assert policy.resolve_spec("ngram", "draft", True) == ("ngram", False)


def test_request_k_policy():
    base = KPolicy(k=4, adaptive=True, k_max=6)
    assert policy.request_k_policy("off", None, base).k == 0
    fixed = policy.request_k_policy("draft", 9, base)
    assert (fixed.k, fixed.adaptive) == (6, False)  # capped at k_max
    assert policy.request_k_policy("draft", None, base) is base


@pytest.mark.parametrize(
    "running,lane,lanes,split,share",
    [(3, 0, 2, 4, 3), (3, 1, 2, 4, 0), (4, 0, 2, 4, 2), (5, 1, 2, 4, 3), (1, 0, 1, 4, 1), (6, 2, 3, 2, 2)],
)
def test_lane_share_splits_only_from_split_min_batch(running, lane, lanes, split, share):
    assert policy.lane_share(running, lane, lanes, split) == share


def test_want_k_off_gate_and_policy():
    cost = CostMeter(c=0.2)
    st = _state(KPolicy(k=5))
    assert policy.want_k("off", False, 1, 0, st, 4096, cost) == 0
    assert policy.want_k("draft", True, 9, 8, st, 4096, cost) == 0  # the goodput gate
    assert policy.want_k("draft", False, 9, 8, st, 4096, cost) == 5  # explicit modes are not gated
    assert policy.want_k("draft", True, 8, 8, st, 4096, cost) == 5
    assert policy.want_k("ngram", True, 1, 0, _state(KPolicy(k=5), max_tokens=3), 4096, cost) == 2  # bounded


def test_draft_deadline_follows_the_verify_time_within_bounds():
    cfg = RouterConfig(draft_deadline_s=1.0, draft_deadline_factor=2.0, draft_deadline_min_s=0.05)
    assert policy.draft_deadline(cfg, None, 4) == 1.0
    assert policy.draft_deadline(cfg, 0.01, 4) == pytest.approx(0.1)
    assert policy.draft_deadline(cfg, 0.001, 1) == 0.05
    assert policy.draft_deadline(cfg, 0.5, 4) == 1.0


def test_predraft_k_and_least_loaded():
    assert policy.predraft_k(4, generated=0, k=4, max_tokens=64, tokens=10, max_context=4096) == 4
    assert policy.predraft_k(4, generated=55, k=4, max_tokens=64, tokens=10, max_context=4096) == 3
    assert policy.predraft_k(4, generated=0, k=4, max_tokens=64, tokens=4090, max_context=4096) == 1
    # a pre-draft runs its length + 1 steps (it drafts the bonus token's guess too): room 4 -> 3 tokens
    assert policy.predraft_k(4, generated=0, k=4, max_tokens=64, tokens=10, max_context=4096, room=4) == 3
    assert policy.predraft_k(4, generated=0, k=4, max_tokens=64, tokens=10, max_context=4096, room=1) == 0
    assert policy.predraft_k(4, generated=0, k=4, max_tokens=64, tokens=10, max_context=4096, room=0) == 0
    assert policy.least_loaded([(False, 3), (False, 1), (True, 0), (False, 1)]) == 1


def test_the_scheduler_calls_these_functions():
    """One policy: the scheduler and the drafting module use router.policy, not copies."""
    import router.drafting as drafting
    import router.scheduler as scheduler
    import router.target_balance as target_balance

    for name in ("batch_capacity", "can_admit", "lane_share", "policy_k", "request_k_policy", "resolve_spec"):
        assert getattr(scheduler, name) is getattr(policy, name), name
    assert target_balance.policy is policy  # want_k, through the module (the simulator's test patches it)
    for name in ("draft_deadline", "predraft_k"):
        assert getattr(drafting, name) is getattr(policy, name), name
    assert drafting.predraft_room is rebalance.predraft_room
