"""Chunked prefill under one token budget per round (specdec/core/prefill_plan.py)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.core.prefill_plan import PrefillNeed, chunk_end, plan_prefill, round_budget


def test_chunk_boundaries_are_multiples_of_the_chunk_size():
    assert chunk_end(0, 1000, 256) == 256
    assert chunk_end(256, 1000, 256) == 512
    assert chunk_end(768, 1000, 256) == 1000
    assert chunk_end(0, 100, 256) == 100
    assert chunk_end(0, 100, 0) == 100  # no chunking: the whole prompt


def test_verify_rows_first_then_chunks_in_arrival_order():
    needs = [PrefillNeed("a", 0, 3000), PrefillNeed("b", 0, 3000)]
    # 40 tokens of verify rows leave 216 of a 256 budget: one 128-token chunk fits, not two.
    assert plan_prefill(needs, verify_tokens=40, budget=256, chunk=128) == {"a": 128}
    # An empty batch leaves room for both, round robin: a, then b.
    assert plan_prefill(needs, verify_tokens=0, budget=256, chunk=128) == {"a": 128, "b": 128}
    # More room: a second pass.
    assert plan_prefill(needs, verify_tokens=0, budget=512, chunk=128) == {"a": 256, "b": 256}


def test_a_short_prompt_is_not_stuck_behind_long_ones():
    needs = [PrefillNeed("long1", 0, 4000), PrefillNeed("long2", 128, 4000), PrefillNeed("short", 0, 20)]
    plan = plan_prefill(needs, verify_tokens=10, budget=250, chunk=128)
    assert plan == {"long1": 128, "short": 20}  # long2's chunk does not fit after long1's; short's does


def test_no_starvation_when_the_verify_rows_fill_the_budget():
    needs = [PrefillNeed("a", 128, 3000), PrefillNeed("b", 0, 3000)]
    assert plan_prefill(needs, verify_tokens=400, budget=256, chunk=128) == {"a": 256}


def test_budget_off_caches_every_prompt_whole():
    needs = [PrefillNeed("a", 0, 3000), PrefillNeed("b", 256, 300), PrefillNeed("c", 50, 50)]
    assert plan_prefill(needs, verify_tokens=100, budget=0, chunk=128) == {"a": 3000, "b": 300}


def test_a_round_committing_more_tokens_per_row_gets_a_larger_budget():
    assert round_budget(256, 1.0) == 256
    assert round_budget(256, 0.4) == 256  # never below a plain round's
    assert round_budget(256, 4.5) == 1152
    assert round_budget(0, 4.5) == 0  # off stays off
    # a speculative round with tau 4.5 caches four more chunks of a waiting prompt than a plain one
    needs = [PrefillNeed("a", 0, 3000)]
    plain = plan_prefill(needs, verify_tokens=8, budget=round_budget(256, 1.0), chunk=128)
    spec = plan_prefill(needs, verify_tokens=48, budget=round_budget(256, 4.5), chunk=128)
    assert (plain, spec) == ({"a": 128}, {"a": 1024})


@settings(max_examples=200, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 5000), min_size=1, max_size=8),
    verify_tokens=st.integers(0, 600),
    budget=st.integers(1, 2048),
    chunk=st.sampled_from([16, 64, 128, 256, 512]),
)
def test_plans_respect_boundaries_budget_and_progress(lengths, verify_tokens, budget, chunk):
    needs = [PrefillNeed(str(i), 0, n) for i, n in enumerate(lengths)]
    done = {n.key: 0 for n in needs}
    for _ in range(10_000):
        pending = [PrefillNeed(n.key, done[n.key], n.total) for n in needs if done[n.key] < n.total]
        if not pending:
            break
        plan = plan_prefill(pending, verify_tokens, budget, chunk)
        assert plan, "a round with prompts to prefill always advances one"
        spent = sum(plan[k] - done[k] for k in plan)
        assert spent <= max(budget - verify_tokens, 0) or len(plan) == 1
        for key, end in plan.items():
            total = lengths[int(key)]
            assert done[key] < end <= total
            assert end == total or end % chunk == 0  # boundaries never depend on load
            done[key] = end
    assert all(done[n.key] == n.total for n in needs)


def test_a_short_request_behind_a_queue_of_long_prompts_gets_the_first_pass():
    needs = [PrefillNeed(f"long{i}", 0, 3000) for i in range(4)] + [PrefillNeed("short", 0, 9)]
    # room for two chunks: the oldest prompt's, then the short one's (its only chunk), not long1's
    assert plan_prefill(needs, verify_tokens=4, budget=40, chunk=16) == {"long0": 16, "short": 9}
