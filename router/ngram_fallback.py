"""When an AUTO request drafts with the router's n-gram drafter (docs/design.md, "Speed").

Reads: each AUTO request's n-gram evidence (how its n-gram guesses fared against the tokens the
target verified, :func:`score_guess`), the round's requests as the goodput switch sees them
(:class:`router.speculation_off.SpecJob`) with the switch's off flags, the verify line and the
time.
Decides: which AUTO requests draft with the router's own n-gram drafter this round instead of as the
switch left them, by their draft model or plainly (:func:`plan_fallback`).

Why: a draft from the router's n-gram costs no drafter time, only its rows in the verify. Where
the draft model's drafts cost more than they bring (a batch of requests on a drafter that shares
the target's cores, as on the 2-core CPU at eight clients) and text repeats (code), n-gram drafts
still pay: there, requests drafting by n-gram ran at 1.43x plain decoding and those drafting by the
draft model at 0.80-0.96x, and AUTO with this choice at 1.31x (docs/results.md, "AUTO against OFF
under load"). Whether they pay is the goodput switch's rule, with each request's n-gram acceptance
and no draft cost. That acceptance is measured on every round of every AUTO request, drafting or
not: the n-gram's guess from the request's tokens before the round is scored against the tokens the
target verified (a shadow guess: it costs a lookup, never a verify row). For sampled requests this
is still the acceptance: an n-gram guess is a point mass, accepted with probability p(guess), the
chance that the target's token equals it.

Plain functions: no I/O, no asyncio; router/target_balance.py applies them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from router.speculation_off import (
    SpecJob,
    SpeculationOffConfig,
    VerifyCost,
    pooled_acceptance,
    round_goodput,
    switch_in_order,
)

__all__ = ["MEMORY", "POOL_MEMORY", "score_guess", "remember", "plan_fallback"]

# Each round keeps this share of a request's earlier n-gram evidence: about ten rounds of memory, as
# a request moves between text the n-gram can copy and text it cannot.
MEMORY = 0.9
# A target's pooled n-gram evidence over its requests: about 300 request-rounds, as the draft
# model's pooled acceptance (router/target_balance.py). A new request is judged by it until its own
# guesses have been scored: where the target's requests copy, a new one starts on n-gram drafts
# without first paying its draft model's prompt prefill.
POOL_MEMORY = 0.997


def score_guess(guess: Sequence[int], verified: Sequence[int]) -> tuple[int, int]:
    """(accepted, rejections) of an n-gram guess against the tokens the target verified after the
    same tokens (its accepted draft and its own next token). A guess longer than what was verified
    is scored as far as it can be (its tail is neither accepted nor rejected); an empty guess is a
    rejection, since the round would have verified nothing from it."""
    if not verified:
        return 0, 0
    n = 0
    for g, v in zip(guess, verified):
        if g != v:
            return n, 1
        n += 1
    return n, 1 if n == 0 else 0


def remember(
    evidence: tuple[float, float], accepted: int, rejections: int, memory: float = MEMORY
) -> tuple[float, float]:
    """N-gram evidence after one more scored guess, the earlier evidence kept at ``memory`` (a
    request's: :data:`MEMORY`; a target's pool over its requests: :data:`POOL_MEMORY`)."""
    acc, rej = evidence
    return memory * acc + accepted, memory * rej + rejections


def plan_fallback(
    jobs: Sequence[SpecJob],
    off: Sequence[bool],
    evidence: Sequence[tuple[float, float]],
    ngram_k: Sequence[int],
    ngram_on: Sequence[bool],
    changed_at: Sequence[float],
    cost: VerifyCost | None,
    now: float,
    cfg: SpeculationOffConfig,
    pool: tuple[float, float] | None = None,
) -> list[bool]:
    """Which AUTO requests draft by n-gram this round, in place of what the goodput switch left them
    (``off``: decoding plainly, else drafting by their draft model): those whose n-gram drafts
    (acceptance from ``evidence``, ``ngram_k`` tokens, no drafter cost) raise the round's goodput,
    highest n-gram acceptance first. A plan with more n-gram drafts than now needs a gain of
    ``off_margin`` (drafts that cost no drafter time should not wait), one with fewer ``on_margin``;
    a request switched less than ``cooldown_s`` ago keeps its state. Each request's acceptance is
    shrunk toward ``pool``, the target's n-gram evidence over its requests (None: the batch's
    own), and nothing switches before that rests on ``min_evidence`` scored tokens."""
    current = list(ngram_on)
    pooled = pool if pool is not None else (sum(a for a, _ in evidence), sum(r for _, r in evidence))
    if cost is None or sum(pooled) < cfg.min_evidence:
        return current
    acceptance = pooled_acceptance(evidence, pooled)
    as_ngram = [SpecJob(a=a, k=k, left=j.left) for j, a, k in zip(jobs, acceptance, ngram_k)]
    as_left = [dataclasses.replace(j, off=o) for j, o in zip(jobs, off)]
    free = [i for i, j in enumerate(jobs) if j.auto and ngram_k[i] > 0 and now - changed_at[i] >= cfg.cooldown_s]

    def goodput(choice: Sequence[bool]) -> float:
        round_jobs = [n if c else left for n, left, c in zip(as_ngram, as_left, choice)]
        return round_goodput(round_jobs, [j.off for j in round_jobs], cost)

    return switch_in_order(current, sorted(free, key=lambda i: (-acceptance[i], i)), goodput, cfg)
