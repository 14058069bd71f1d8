"""How a target's requests are admitted and batched, and the draft deadline (router/batching.py)."""

from __future__ import annotations

import pytest

from router import batching
from router.config import RouterConfig
from specdec.core.request_state import KPolicy


def test_capacity_is_the_smallest_of_slots_max_batch_and_draft_slots():
    assert batching.batch_capacity(8, 0) == 8
    assert batching.batch_capacity(8, 4) == 4
    assert batching.batch_capacity(8, 0, draft_slots=6) == 6
    assert batching.batch_capacity(8, 16, draft_slots=None) == 8


def test_auto_resolves_to_the_default_mode_and_ngram_without_a_draft_worker():
    assert batching.resolve_spec("auto", "draft", True) == ("draft", True)
    assert batching.resolve_spec("auto", "draft", False) == ("ngram", True)
    assert batching.resolve_spec("auto", "off", True) == ("off", True)
    assert batching.resolve_spec("ngram", "draft", True) == ("ngram", False)


def test_request_k_policy():
    base = KPolicy(k=4, adaptive=True, k_max=6)
    assert batching.request_k_policy("off", None, base).k == 0
    fixed = batching.request_k_policy("draft", 9, base)
    assert (fixed.k, fixed.adaptive) == (6, False)  # capped at k_max
    assert batching.request_k_policy("draft", None, base) is base


@pytest.mark.parametrize(
    "running,lane,lanes,split,share",
    [(3, 0, 2, 4, 3), (3, 1, 2, 4, 0), (4, 0, 2, 4, 2), (5, 1, 2, 4, 3), (1, 0, 1, 4, 1), (6, 2, 3, 2, 2)],
)
def test_lane_share_splits_only_from_split_min_batch(running, lane, lanes, split, share):
    assert batching.lane_share(running, lane, lanes, split) == share


def test_draft_deadline_follows_the_verify_time_within_bounds():
    cfg = RouterConfig(draft_deadline_s=1.0, draft_deadline_factor=2.0, draft_deadline_min_s=0.05)
    assert batching.draft_deadline(cfg, None, 4) == 1.0
    assert batching.draft_deadline(cfg, 0.01, 4) == pytest.approx(0.1)
    assert batching.draft_deadline(cfg, 0.001, 1) == 0.05
    assert batching.draft_deadline(cfg, 0.5, 4) == 1.0


def test_the_scheduler_and_the_drafting_module_call_these_functions():
    """One policy per decision: the scheduler, its admission and the drafting module use
    router.batching and router.draft_depth, not copies."""
    import router.admission as admission
    import router.draft_depth as draft_depth
    import router.drafting as drafting
    import router.scheduler as scheduler
    import router.target_balance as target_balance

    for name in ("batch_capacity", "lane_share", "request_k_policy", "resolve_spec"):
        assert getattr(scheduler, name) is getattr(batching, name), name
    for name in ("can_admit", "next_admission"):
        assert getattr(admission, name) is getattr(batching, name), name
    assert drafting.draft_deadline is batching.draft_deadline
    assert scheduler.policy_k is draft_depth.policy_k
    assert target_balance.draft_depth is draft_depth  # want_k, through the module (a test may patch it)
    for name in ("predraft_k", "predraft_room", "is_catch_up"):
        assert getattr(drafting, name) is getattr(draft_depth, name), name
