"""When speculation switches off under load (docs/design.md "Rebalancing and scaling").

Reads: a round's requests as :class:`SpecJob` (acceptance, draft length, AUTO or not, switched
off now and when, what their drafts cost: router/drafter_choice.py prices them), the target's
measured verify line (:class:`VerifyCost`), its pooled acceptance, the running batch size and the
time.
Decides: which AUTO requests speculate this round. Two rules, one per load signal, and a
measurement for the second (:func:`plain_probe_due`):

* the batch-size gate (:func:`auto_off`): AUTO requests never speculate while more than
  ``auto_off_batch`` requests run on their target (batched verification turns compute-bound);
* the goodput switch (:func:`plan_speculation`): AUTO requests stop speculating, lowest
  acceptance first, where the round's goodput B tau / T(B (k + 1)), draft wait included, says
  plain decoding is faster, and start again when speculation is faster again. A draft priced by a
  guess (its drafter not measured lately) switches at most one request on: a probe, whose
  Proposes measure the drafter for the rest. Nothing switches before the target's pooled
  acceptance (:func:`pooled_acceptance`) rests on ``min_evidence`` tested draft tokens.

Plain functions: no I/O, no asyncio, the time is an argument. router/target_balance.py applies
them; the longest draft a round carries is router/draft_depth.py's (``round_k_cap``, priced by
:func:`round_goodput` here).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pydantic import NonNegativeFloat, NonNegativeInt

from specdec.core.speedup import expected_tokens
from specdec.rpc.config_model import check_fields
from specdec.rpc.worker_config import strict_from_dict

__all__ = [
    "SpeculationOffConfig",
    "plain_probe_due",
    "auto_off",
    "VerifyCost",
    "SpecJob",
    "pooled_acceptance",
    "round_goodput",
    "plan_speculation",
    "switch_in_order",
]


@dataclass(frozen=True)
class SpeculationOffConfig:
    """The router config's ``speculation_off`` section.

    auto_off_batch: AUTO requests stop speculating while more than this many requests run on
      their target (batched verification turns compute-bound; 0 = never).
    off_margin / on_margin / cooldown_s: AUTO requests switch speculation off when that raises
      the round's goodput by more than ``off_margin`` (small: speculation must not stay where it
      loses), back on only for more than ``on_margin`` (the wide band keeps noise from flipping
      them), each request at most once per cooldown.
    min_evidence: nothing switches by goodput before the target's pooled acceptance rests on this
      many tested draft tokens.
    plain_probe_rounds: while two or more AUTO requests speculate and no round this many rounds back
      was (nearly) plain decoding, the next round decodes them plainly: one measurement of plain
      decoding's width for the verify line (:func:`plain_probe_due`; 0 = never).
    ngram_fallback: AUTO requests draft with the router's n-gram drafter, in place of their draft
      model or of plain decoding, where that raises the round's goodput (router/ngram_fallback.py);
      false: never.
    """

    auto_off_batch: NonNegativeInt = 0
    off_margin: NonNegativeFloat = 0.02
    on_margin: NonNegativeFloat = 0.15
    min_evidence: NonNegativeFloat = 20.0
    cooldown_s: NonNegativeFloat = 2.0
    plain_probe_rounds: NonNegativeInt = 50
    ngram_fallback: bool = True

    def __post_init__(self) -> None:
        check_fields(self, "router.speculation_off")

    @classmethod
    def from_dict(cls, d: dict | SpeculationOffConfig | None) -> SpeculationOffConfig:
        return d if isinstance(d, cls) else strict_from_dict(cls, d, "router.speculation_off")


def plain_probe_due(rounds_since_plain: int, speculating_auto: int, cfg: SpeculationOffConfig) -> bool:
    """Whether this round's AUTO requests decode plainly, once, to measure plain decoding's width.

    The verify line is fitted through the widths rounds had. While a batch speculates they are all
    several times plain decoding's, and the line's value there is a guess: on the 2-core CPU, rounds
    of 30-40 tokens at 8 clients gave 486 ms + 0.85 ms/token, so 492 ms for plain decoding's 8
    tokens, which take about 200 ms, and the switch compared speculation with that guess
    (docs/results.md, "AUTO against OFF under load"). One plain round every
    ``plain_probe_rounds`` anchors the line where the switch compares; a single request has no
    batch to probe (its plain round would cost a whole round's draft)."""
    return cfg.plain_probe_rounds > 0 and speculating_auto >= 2 and rounds_since_plain >= cfg.plain_probe_rounds


def auto_off(auto: bool, running: int, auto_off_batch: int) -> bool:
    """The batch-size gate: an AUTO request does not speculate while more than ``auto_off_batch``
    requests run on its target (0: never gated); explicit modes are never gated."""
    return auto and auto_off_batch > 0 and running > auto_off_batch


@dataclass(frozen=True)
class VerifyCost:
    """Measured verify time as a line in tokens verified: t(n) = t1 + slope (n - 1) seconds (flat
    while memory-bound, growing once compute-bound)."""

    t1: float
    slope: float

    def time(self, rows: int) -> float:
        return max(self.t1, self.t1 + self.slope * (rows - 1))


@dataclass(frozen=True)
class SpecJob:
    """One request of a round.

    a: its acceptance estimate; k: the draft length it would use if speculating (also while
    switched off; 0 = nothing to decide); auto: AUTO mode (the policy may switch it); off: switched
    off now; changed_at: when it was last switched; draft_step_s / draft_fixed_s: what a draft of
    k steps costs on its drafter, draft_fixed_s + k x draft_step_s, queueing included (0 = drafted
    locally, e.g. n-gram): the round waits for the slowest of its drafts. guessed: the draft
    cost is a guess (router.drafter_choice.is_guess), not a fresh measurement. owed_s: the seconds of
    the target's device its drafter needs, once, to catch up on tokens it lacks (a new request's
    prompt, or what it decoded switched off) where the drafter shares the target's device (0:
    nothing owed, or the drafter has its own); left: tokens it may still generate (its one-time
    cost is spread over the rounds it has left).
    """

    a: float
    k: int
    auto: bool = True
    off: bool = False
    changed_at: float = -math.inf
    draft_step_s: float = 0.0
    draft_fixed_s: float = 0.0
    guessed: bool = False
    owed_s: float = 0.0
    left: int = 0


def pooled_acceptance(
    evidence: Sequence[tuple[float, float]],
    pool: tuple[float, float] | None = None,
    weight: float = 8.0,
    prior: float = 0.6,
) -> list[float]:
    """Each request's acceptance from its (accepted, rejections) counts, shrunk toward the pooled
    estimate by ``weight`` pseudo-observations: a few unlucky rounds of one request do not switch
    it off, and a request switched off (its own counts frozen) follows the pool. ``pool``: the
    target's (accepted, rejections) over a longer memory; None = the batch's own counts."""
    acc, rej = pool if pool is not None else (sum(a for a, _ in evidence), sum(r for _, r in evidence))
    pooled = acc / (acc + rej) if acc + rej > 0 else prior
    return [(a + weight * pooled) / (a + r + weight) for a, r in evidence]


def round_goodput(jobs: Sequence[SpecJob], off: Sequence[bool], cost: VerifyCost, cap: int | None = None) -> float:
    """Tokens per second of one round: B tau / T(B (k + 1)) with per-request a and k (at most
    ``cap``), T = the verify time of all rows plus the wait for the slowest draft (draft_fixed_s +
    draft_step_s x k) plus each speculating request's share of what its drafter owes the shared
    device (owed_s over the rounds it has left)."""
    tokens, rows, wait, owed = 0.0, 0, 0.0, 0.0
    for j, o in zip(jobs, off):
        k = 0 if o else j.k if cap is None else min(j.k, cap)
        tau = expected_tokens(min(max(j.a, 0.0), 1.0), k)
        tokens += tau
        rows += k + 1
        if k > 0:
            wait = max(wait, j.draft_fixed_s + j.draft_step_s * k)
            if j.owed_s > 0:
                owed += j.owed_s / max(1.0, j.left / tau)
    return tokens / (cost.time(rows) + wait + owed)


def plan_speculation(
    jobs: Sequence[SpecJob], cost: VerifyCost | None, now: float, cfg: SpeculationOffConfig
) -> list[bool]:
    """New off flags for a round's requests: AUTO requests switch off, those whose drafter would
    have to catch up first, then lowest acceptance first, as long as that raises the round's
    goodput. A plan with more requests off than now needs a gain of ``off_margin``, one with
    fewer ``on_margin``; a request switched less than ``cooldown_s`` ago keeps its state."""
    current = [j.off for j in jobs]
    if cost is None or not jobs:
        return current
    free = [i for i, j in enumerate(jobs) if j.auto and j.k > 0 and now - j.changed_at >= cfg.cooldown_s]
    if not free:
        return current
    order = sorted(free, key=lambda i: (jobs[i].owed_s == 0, jobs[i].a, i))  # off first: owing a catch-up
    best = switch_in_order(current, order, lambda flags: round_goodput(jobs, flags, cost), cfg)
    return _one_probe(jobs, current, best)


def switch_in_order(
    current: Sequence[bool], order: Sequence[int], goodput: Callable[[Sequence[bool]], float], cfg: SpeculationOffConfig
) -> list[bool]:
    """``current`` with the first m requests of ``order`` flagged and the rest of it not, m chosen
    for the highest ``goodput``; a plan flagging more requests than now needs a gain of
    ``off_margin``, one flagging fewer ``on_margin``; else ``current`` as it is. The goodput
    switch flags requests off by it, router/ngram_fallback.py flags them onto n-gram drafts."""
    best, best_g = list(current), goodput(current)
    g_now = best_g
    for m in range(len(order) + 1):
        flags = list(current)
        for n, i in enumerate(order):
            flags[i] = n < m
        g = goodput(flags)
        if g > best_g:
            best, best_g = flags, g
    margin = cfg.off_margin if sum(best) > sum(current) else cfg.on_margin
    return best if best_g > g_now * (1.0 + margin) else list(current)


def _one_probe(jobs: Sequence[SpecJob], current: Sequence[bool], flags: list[bool]) -> list[bool]:
    """``flags`` with at most one request switched on by a guessed draft price (the one with the
    highest acceptance), none while one already speculates by a guess: switching many on by a
    guess would make them all pay (a drafter catching up on their tokens) for what one Propose
    tells. The plan is judged as a whole: one request alone may not pay where all of them would."""
    probing = any(j.guessed and j.k > 0 and not f for j, f in zip(jobs, current))  # k 0 measures nothing
    rising = [i for i, (j, c, f) in enumerate(zip(jobs, current, flags)) if j.guessed and c and not f]
    keep = None if probing else max(rising, key=lambda i: (jobs[i].a, -i), default=None)
    return [True if i in rising and i != keep else f for i, f in enumerate(flags)]
