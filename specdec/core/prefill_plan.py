"""Chunked prefill under one token budget per round: which prompt chunks a round runs.

A round spends its token budget on the running requests' verify rows (k + 1 tokens each) first,
then on prefill chunks. A prompt is cached in chunks whose boundaries are multiples of a fixed
``chunk`` size, never chosen by load, so a prompt's KV cache comes from the same forwards whatever
else runs (in bf16 its output too). Chunks are handed out one per prefilling request per pass, in
arrival order, for as long as they fit: long prompts are served first come first served, and a
prompt that needs only one more chunk (a short new request) gets it in the first pass, right after
the oldest prompt's chunk, so it is not stuck behind a queue of chunks.

Across clients the budget is shared, not handed out by request: clients take turns, the one given
the fewest tokens so far this round first, each turn one chunk of that client's next prompt in the
order above. One client's wall of long prompts then takes at most its share of a round while
another client's prompt waits, and a client alone still gets the whole budget. The router passes
each request's client (docs/design.md, Scheduling); the engine serves one client.

A plain function of queue state and budget, shared by the router, the engine and the capacity
simulator (docs/design.md, Scheduling).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = [
    "PrefillNeed",
    "plan_prefill",
    "round_budget",
    "chunk_end",
    "chunks_between",
    "DEFAULT_CHUNK",
    "DEFAULT_BUDGET",
]

# Defaults sized on the 2-core CPU machine, where a round of one or two chunks stays near a second
# on the default models (docs/results.md, "Chunked prefill"); configs/cluster.yaml sets GPU values.
DEFAULT_CHUNK = 128
DEFAULT_BUDGET = 256


@dataclass(frozen=True)
class PrefillNeed:
    key: str
    done: int  # prompt tokens already cached (0, a multiple of the chunk size, or total)
    total: int  # prompt tokens to cache before decoding starts (the prompt less its last token)
    client: str = ""  # who sent it: the budget is shared across clients (one client: by request only)


def round_budget(budget: int, tokens_per_row: float) -> int:
    """A round's token budget where its decoding rows commit ``tokens_per_row`` tokens each (tau
    under speculation, 1 for plain decoding): ``budget`` is what a plain round may spend, and a
    round that commits more tokens per row may spend as many times more. Prompts then get the same
    prefill tokens per committed token, and running requests the same stall per token, whatever
    the speculation. With a fixed budget a speculative round (several times longer) prefilled
    several times slower, and bursts of prompts reached decoding late."""
    return budget if budget <= 0 else int(budget * max(1.0, tokens_per_row))


def chunk_end(done: int, total: int, chunk: int) -> int:
    """Where the chunk starting at ``done`` ends: the next multiple of ``chunk``, or ``total``."""
    if chunk <= 0:
        return total
    return min(total, (done // chunk + 1) * chunk)


def chunks_between(done: int, end: int, chunk: int) -> int:
    """How many fixed-size chunks cache the tokens [done, end) (done on a boundary)."""
    if end <= done:
        return 0
    return 1 if chunk <= 0 else -(-(end - done) // chunk)


class _Turns:
    """One client's prompts in the order a lone client's are served: a first pass of its oldest
    prompt, then those that finish in one more chunk, then the rest; then passes in arrival order
    while a pass still gives a chunk."""

    def __init__(self, needs: list[PrefillNeed], chunk: int):
        self.head = needs[0]
        rest = needs[1:]
        finishing = [n for n in rest if chunk_end(n.done, n.total, chunk) == n.total]
        self.keys = [self.head.key] + [n.key for n in finishing] + [n.key for n in rest if n not in finishing]
        self.arrival = [n.key for n in needs]
        self.at = 0  # the next prompt in this pass
        self.gave = False  # whether this pass gave a chunk yet
        self.given = 0  # tokens given this round

    def take(self, give: Callable[[str], int]) -> bool:
        """Give the next prompt in turn whose chunk fits; False once a whole pass fits none (the
        budget only shrinks, so none will later in the round)."""
        while True:
            if self.at == len(self.keys):
                if not self.gave:
                    return False
                self.keys, self.at, self.gave = self.arrival, 0, False
            key = self.keys[self.at]
            self.at += 1
            tokens = give(key)
            if tokens:
                self.gave = True
                self.given += tokens
                return True


def plan_prefill(needs: Sequence[PrefillNeed], verify_tokens: int, budget: int, chunk: int) -> dict[str, int]:
    """How far each prefilling request gets cached this round: ``{key: new done}`` for those that advance.

    ``needs`` come in arrival order. Within a client, the first pass gives one chunk each to its
    oldest prompt, then to every prompt whose rest fits in one chunk (a short new request is never
    stuck behind a queue of long prompts' chunks), then to the others in arrival order; later passes
    go round in arrival order while chunks fit. Clients take turns at this, one chunk a turn, the
    client given the fewest tokens this round first; among equals, the one whose oldest prompt has
    the fewest tokens cached (a newcomer, or the client that came second last round: with room for
    one chunk a round, clients alternate rather than the first one taking every round), then the
    one that came first. ``budget`` <= 0 turns the budget off: every prompt is cached whole (in
    fixed chunks) at once. When the verify rows leave no room, the first client's oldest prompt
    still gets one chunk, so a prompt is never starved by a full batch of decoding requests (the
    round then runs at most one chunk over).
    """
    order = [n for n in needs if n.done < n.total]
    if not order:
        return {}
    if budget <= 0:
        return {n.key: n.total for n in order}
    done = {n.key: n.done for n in order}
    total = {n.key: n.total for n in order}
    planned: dict[str, int] = {}
    left = budget - verify_tokens

    def give(key: str) -> int:
        nonlocal left
        end = chunk_end(done[key], total[key], chunk)
        if done[key] >= total[key] or end - done[key] > left:
            return 0
        left -= end - done[key]
        tokens, done[key] = end - done[key], end
        planned[key] = end
        return tokens

    by_client: dict[str, list[PrefillNeed]] = {}
    for n in order:
        by_client.setdefault(n.client, []).append(n)
    # sorted is stable: among heads with as many tokens cached, the client that came first
    turns = sorted((_Turns(ns, chunk) for ns in by_client.values()), key=lambda t: t.head.done)
    first = turns[0].head
    while turns:
        turn = min(turns, key=lambda t: t.given)  # the first of the least served
        if not turn.take(give):
            turns.remove(turn)
    if not planned:
        planned[first.key] = chunk_end(first.done, first.total, chunk)
    return planned
