"""A drafter whose acceptance is set, for benchmarks of the speculative loop on random-weight
models (whose own drafts the target would almost never accept).

It runs the draft model's real forwards, so a round's drafting costs what a real drafter's does,
and proposes the target's greedy continuation, known from a k = 0 run of the same prompts, with
each position replaced (by another id) where a seeded coin of probability 1 - rate says so. Under
lossless verification the verifier then accepts exactly the proposal's prefix of kept positions:
the per-token acceptance is a Bernoulli(rate) per position, independent, as the speed model of
specdec/core/speedup.py assumes.

``planned_accepted`` counts what the plan says the verifier must accept (per proposal, the kept
positions before the first replaced one): a run whose measured acceptance differs from it did not
apply the plan, or did not verify losslessly.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence

import torch
from gpu_costs import sync

from specdec.core.drafters import DraftInput, ModelDrafter
from specdec.core.params import VerifyMode
from specdec.core.round_types import Draft


def keep_mask(n: int, rate: float, seed: int) -> list[bool]:
    """Which of ``n`` positions keep the true token: independent coins of probability ``rate``."""
    rng = random.Random(seed)
    return [rng.random() < rate for _ in range(n)]


class FixedAcceptanceDrafter(ModelDrafter):
    """``continuations``: (prompt ids, the target's greedy continuation) per prompt; ``rate``: the
    per-token acceptance to hold. Greedy requests only (the continuation is the greedy one)."""

    def __init__(self, runner, continuations: Sequence[tuple[list[int], list[int]]], rate: float, seed: int = 0):
        super().__init__(runner, lookup=None)  # one token per forward: no prompt-lookup guesses
        self.rate = rate
        self.plans = [
            (list(p), list(c), keep_mask(len(c), rate, seed * 1_000_003 + i)) for i, (p, c) in enumerate(continuations)
        ]
        self._plan_of: dict[str, int] = {}
        self.draft_seconds: list[float] = []  # per propose call
        self.draft_steps: list[int] = []  # its longest draft: the forwards it ran one after another
        self.planned_accepted = 0

    def _plan(self, inp: DraftInput) -> int | None:
        if inp.request_id not in self._plan_of:
            # by prompt, not by id: the service's router names its requests itself
            match = [i for i, (p, _, _) in enumerate(self.plans) if inp.tokens[: len(p)] == p]
            if not match:
                return None
            self._plan_of[inp.request_id] = max(match, key=lambda i: len(self.plans[i][0]))
        return self._plan_of[inp.request_id]

    def planned_token(self, continuation: list[int], keep: list[bool], j: int) -> int:
        """The token proposed at generated position ``j``: the true one, or another where replaced."""
        return continuation[j] if keep[j] else (continuation[j] + 1) % self.runner.vocab_size

    def _pick(self, logits: torch.Tensor, inp: DraftInput, position: int) -> tuple[int, None]:
        # ModelDrafter's choice of each token from its logits, replaced: the draft model is then fed
        # the planned tokens, so its cache holds what a drafter proposing them would hold, and a
        # round's forwards are the real drafter's (the CPU test fails if ModelDrafter stops calling it)
        if inp.mode is not VerifyMode.GREEDY:
            raise ValueError("a fixed-acceptance drafter proposes a greedy continuation: greedy requests only")
        own = int(torch.argmax(logits))  # what a real drafter pays per token: its pick and the wait for it
        planned = self._planned(inp, position)
        return (own if planned is None else planned), None

    def _planned(self, inp: DraftInput, position: int) -> int | None:
        """The plan's token at sequence position ``position`` of ``inp``'s request; None where it has
        none (not a planned prompt, or past the known continuation)."""
        index = self._plan(inp)
        if index is None:
            return None
        prompt, continuation, keep = self.plans[index]
        j = position - len(prompt)
        return self.planned_token(continuation, keep, j) if 0 <= j < len(continuation) else None

    def _draft_on_device(self, inputs, drafts, rows, guesses, limits) -> bool:
        # Where ModelDrafter drafts several greedy steps in one call on the device (static shapes,
        # specdec/core/static_greedy.py), its argmaxes never pass through _pick: the call still runs
        # (its cost is the real drafter's), and its picks are replaced by the plan's here. The draft
        # model's cache then holds its own picks; the next round feeds it again from where the
        # request's tokens differ, a little more than a real drafter pays.
        before = {b: len(drafts[b].tokens) for b in rows}
        if not super()._draft_on_device(inputs, drafts, rows, guesses, limits):
            return False
        for b in rows:
            tokens = drafts[b].tokens
            for i in range(before[b], len(tokens)):
                planned = self._planned(inputs[b], len(inputs[b].tokens) + i)
                if planned is not None:
                    tokens[i] = planned
        return True

    def propose(self, inputs: Sequence[DraftInput]) -> list[Draft]:
        sync()
        t0 = time.perf_counter()
        drafts = super().propose(inputs)
        sync()
        self.draft_seconds.append(time.perf_counter() - t0)
        self.draft_steps.append(max((len(d.tokens) for d in drafts), default=0))
        for inp, draft in zip(inputs, drafts):
            index = self._plan(inp)
            if index is None or not draft.tokens:
                continue
            prompt, _, keep = self.plans[index]
            start = len(inp.tokens) - len(prompt)
            kept = 0
            while kept < len(draft.tokens) and start + kept < len(keep) and keep[start + kept]:
                kept += 1
            self.planned_accepted += kept
        return drafts
