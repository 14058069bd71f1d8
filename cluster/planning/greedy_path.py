"""A greedy request's drafts replayed from where it stands, not drawn.

Under greedy decoding the target's output is fixed, and a greedy draft model's proposal from
output position p, while it agrees with that output, is its own next token given the target's
prefix. So one number per position says how every round from there goes, whatever k the router
asks: ``agree[p]``, how many of the output's tokens from p on the drafter drafts in a row. A round
at p asking k drafts k tokens and has min(agree[p], k) accepted; the request moves on to
p + accepted + 1. The acceptance model's draws do not keep this: a draw that accepts little early
keeps the adaptive k low and costs more rounds than the service, which repeats the same path
whenever its router asks the same k (for one prompt: 11 simulated rounds against the service's 7).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from cluster.planning.workload import AcceptanceModel

__all__ = ["GreedyPath", "draft_agreement"]


@dataclass
class GreedyPath:
    """A request's rounds from ``agree`` (see the module); past its end, drawn from ``rest``."""

    agree: list[int]
    rest: AcceptanceModel
    first: None = None  # the path holds the first round too

    def sample(self, k: int, rng: random.Random, position: int = 0) -> tuple[int, int, bool]:
        """As :meth:`AcceptanceModel.sample`, at output position ``position``; a model drafter
        always drafts the k asked. The bonus matches where the agreement runs past the draft."""
        if position >= len(self.agree):
            return self.rest.sample(k, rng)
        run = self.agree[position]
        return k, min(run, k), run > k


def draft_agreement(drafter, prompt: list[int], output: list[int]) -> list[int]:
    """``agree`` for a greedy ``output`` of ``prompt``: one proposal of one token per position
    (a KV-cached step each), then the runs of agreeing positions counted from the end."""
    from specdec.core.drafters import DraftInput
    from specdec.core.params import SamplingParams, VerifyMode

    params = SamplingParams(max_tokens=len(output) + 1)
    hits = []
    try:
        for p, token in enumerate(output):
            draft = drafter.propose([DraftInput("agreement", prompt + output[:p], params, VerifyMode.GREEDY, 1)])[0]
            hits.append(draft.tokens[:1] == [token])
    finally:
        drafter.release("agreement")
    agree, run = [], 0
    for hit in reversed(hits):
        run = run + 1 if hit else 0
        agree.append(run)
    return agree[::-1]
