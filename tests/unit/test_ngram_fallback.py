"""When AUTO requests draft by the router's n-gram (router/ngram_fallback.py) on scripted rounds:
their shadow guesses are scored as the target would have judged them, the n-gram takes over where
its drafts, free of drafter time, raise the round's goodput and only there, and it switches as the
goodput switch does (margins, cooldown, evidence first). Plain functions: no router, no I/O."""

from __future__ import annotations

import dataclasses

from router.ngram_fallback import MEMORY, plan_fallback, remember, score_guess
from router.speculation_off import SpecJob, SpeculationOffConfig, VerifyCost

CFG = SpeculationOffConfig()
STEEP = VerifyCost(t1=0.2, slope=0.007)  # the 2-core CPU at 8 clients: about 7 ms a verified row
ENOUGH = (30.0, 10.0)  # evidence of one request: 30 accepted, 10 rejections (a = 0.75)


def test_a_guess_is_scored_against_what_the_target_verified():
    assert score_guess([5, 6, 7], [5, 6, 9]) == (2, 1)  # rejected at its third token
    assert score_guess([5, 6, 7], [4]) == (0, 1)  # a plain round still judges its first token
    assert score_guess([5, 6], [5, 6, 7, 8]) == (2, 0)  # all of it accepted: no rejection seen
    assert score_guess([5, 6, 7, 8], [5, 6]) == (2, 0)  # past what was verified: neither
    assert score_guess([], [5]) == (0, 1)  # nothing to draft: the round would gain nothing
    assert score_guess([5], []) == (0, 0)  # nothing verified (a request that ended)


def test_evidence_fades_so_a_request_can_move_between_copying_and_writing():
    ev = (0.0, 0.0)
    for _ in range(40):
        ev = remember(ev, 4, 0)
    for _ in range(30):
        ev = remember(ev, 0, 1)
    acc, rej = ev
    assert acc / (acc + rej) < 0.2  # thirty rejections in a row outweigh forty good rounds before them
    assert remember((10.0, 2.0), 1, 1) == (MEMORY * 10 + 1, MEMORY * 2 + 1)


def _round(n: int, draft_a: float, draft_s: float, off: bool = False) -> list[SpecJob]:
    """n AUTO requests drafting k = 4 with their draft model at ``draft_a``, a draft costing
    ``draft_s`` (the round waits for it), as the switch left them (``off``)."""
    return [SpecJob(a=draft_a, k=4, draft_fixed_s=draft_s, off=off, left=64) for _ in range(n)]


def _plan(jobs, evidence, on=None, changed=None, k=4, now=10.0, cfg=CFG):
    n = len(jobs)
    return plan_fallback(
        jobs, [j.off for j in jobs], evidence, [k] * n, on or [False] * n, changed or [-1e9] * n, STEEP, now, cfg
    )


def test_ngram_takes_over_where_its_free_drafts_beat_dear_ones():
    """Eight requests whose draft model costs a round 450 ms (the drafter on the target's cores):
    n-gram drafts accepted as often win; accepted rarely, they do not."""
    jobs = _round(8, draft_a=0.8, draft_s=0.45)
    assert _plan(jobs, [ENOUGH] * 8) == [True] * 8
    assert _plan(jobs, [(2.0, 30.0)] * 8) == [False] * 8  # a = 0.06: the draft model still pays more
    # a cheap draft model of the same acceptance keeps its requests: their drafts are better
    cheap = _round(8, draft_a=0.85, draft_s=0.01)
    assert _plan(cheap, [ENOUGH] * 8) == [False] * 8


def test_ngram_takes_over_from_plain_decoding_where_it_pays():
    """Requests the switch holds off (plain decoding): n-gram drafts worth their verify rows start;
    ones that the target mostly rejects would only add rows to a compute-bound verify."""
    off = _round(8, draft_a=0.8, draft_s=0.45, off=True)
    assert _plan(off, [ENOUGH] * 8) == [True] * 8
    assert _plan(off, [(2.0, 30.0)] * 8) == [False] * 8
    # the requests with the best guesses first: a mixed batch takes them and leaves the rest
    mixed = [ENOUGH] * 4 + [(0.0, 40.0)] * 4
    assert _plan(off, mixed) == [True] * 4 + [False] * 4


def test_only_auto_requests_with_room_to_draft_switch():
    jobs = _round(4, draft_a=0.8, draft_s=0.45)
    # asked for the draft model by name (and its drafts are cheap: the round does not wait on them)
    jobs[0] = dataclasses.replace(jobs[0], auto=False, draft_fixed_s=0.0)
    n = len(jobs)
    off = [False, False, True, False]  # the third held off by the switch, with no room left to draft
    on = plan_fallback(jobs, off, [ENOUGH] * n, [4, 4, 0, 4], [False] * n, [-1e9] * n, STEEP, 10.0, CFG)
    assert on == [False, True, False, True]


def test_nothing_switches_before_the_evidence_or_a_verify_line():
    jobs = _round(4, draft_a=0.8, draft_s=0.45)
    few = [(3.0, 1.0)] * 4  # 16 scored tokens, under min_evidence (20)
    assert _plan(jobs, few) == [False] * 4
    assert _plan(jobs, few, on=[True] * 4) == [True] * 4  # nor back
    n = len(jobs)
    assert (
        plan_fallback(jobs, [False] * n, [ENOUGH] * n, [4] * n, [False] * n, [-1e9] * n, None, 10.0, CFG) == [False] * n
    )


def test_switching_back_needs_the_wide_margin_and_waits_out_the_cooldown():
    jobs = _round(8, draft_a=0.8, draft_s=0.45)
    # on n-gram at a = 0.75 while the draft model would be a little better: stays (within on_margin)
    near = [dataclasses.replace(j, draft_fixed_s=0.25) for j in jobs]
    assert _plan(near, [ENOUGH] * 8, on=[True] * 8) == [True] * 8
    # n-gram guesses gone bad: back to the draft model, but not within cooldown_s of the last switch
    bad = [(1.0, 40.0)] * 8
    assert _plan(jobs, bad, on=[True] * 8) == [False] * 8
    assert _plan(jobs, bad, on=[True] * 8, changed=[9.5] * 8) == [True] * 8


def test_a_broken_rule_that_ignores_the_draft_cost_is_caught():
    """The check above fails for a rule that prices the draft model as free: its requests would
    never move to n-gram, however dear their drafts."""
    jobs = _round(8, draft_a=0.8, draft_s=0.45)
    free = [dataclasses.replace(j, draft_fixed_s=0.0) for j in jobs]
    assert _plan(free, [ENOUGH] * 8) != _plan(jobs, [ENOUGH] * 8)


def test_a_new_request_is_judged_by_the_targets_pool_until_its_own_guesses_count():
    """A request with nothing scored yet follows the target's n-gram evidence over its requests:
    it starts on n-gram drafts where the target's requests copy (and never pays its draft model's
    prompt prefill), not where they do not; its own guesses then outweigh the pool."""
    jobs = _round(8, draft_a=0.8, draft_s=0.45)
    n = len(jobs)

    def plan(evidence, pool):
        return plan_fallback(jobs, [False] * n, evidence, [4] * n, [False] * n, [-1e9] * n, STEEP, 10.0, CFG, pool)

    new = [(0.0, 0.0)] * n
    assert plan(new, None) == [False] * n  # no evidence at all: nothing moves
    assert plan(new, (300.0, 60.0)) == [True] * n
    assert plan(new, (20.0, 300.0)) == [False] * n
    own_bad = [(0.0, 30.0)] * n  # their own guesses all rejected, against a good pool
    assert plan(own_bad, (300.0, 60.0)) == [False] * n
