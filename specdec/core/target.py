"""The target side of a round: batched verification over the runner, keyed by request id.

Used by the single-process engine and by the target worker alike. The cache of a request is a
cache: each call carries the request's committed tokens, and the verifier rolls its slot back to
the longest prefix it still holds and feeds the rest, so a missing or stale cache (a restarted
worker, a replaced router) is rebuilt from the tokens alone (docs/design.md, invariant 1).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from specdec.core.params import SamplingParams, VerifyMode
from specdec.core.round_types import Draft, VerifyResult
from specdec.core.runner import ModelRunner, SlotsExhausted
from specdec.core.sampling import make_generator
from specdec.core.slots import SlotTable
from specdec.core.token_tree import chain_parents
from specdec.core.tree_forward import keep_path, tree_forward
from specdec.core.verify import verify, verify_tree


@dataclass
class VerifyItem:
    request_id: str
    tokens: list[int]  # committed tokens: prompt + generated
    params: SamplingParams
    mode: VerifyMode
    draft: Draft


def needs_invariance(params: SamplingParams) -> bool:
    """Greedy and seeded requests promise the target-alone tokens exactly: their forwards must give
    a row the same numbers in a decode and in a verify (ModelRunner's invariant forward)."""
    return params.greedy or params.seed is not None


class TargetVerifier:
    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.generators: dict[str, torch.Generator] = {}  # per request: lives and dies with its slot
        self.slots = SlotTable(runner, on_free=lambda rid: self.generators.pop(rid, None))

    @property
    def free_slots(self) -> int:
        return self.runner.free_slots

    def has(self, request_id: str) -> bool:
        return request_id in self.slots

    def capacity_for(self, request_ids: Sequence[str]) -> tuple[int, int]:
        """(new requests among `request_ids`, how many new ones fit: free + evictable idle slots)."""
        new = sum(1 for rid in request_ids if rid not in self.slots)
        return new, self.slots.evictable(set(request_ids))

    def _slot(self, request_id: str, params: SamplingParams, busy: set[str]) -> int:
        slot, fresh = self.slots.get(request_id, busy)
        if fresh or request_id not in self.generators:
            self.generators[request_id] = make_generator(params.seed)
        return slot

    def _sync(self, items: Sequence[tuple[str, list[int], SamplingParams]], upto: Sequence[int]) -> list[int]:
        """Roll each request's slot back to what it shares with its tokens; return the kept lengths.

        Checks capacity first, so a batch that cannot be placed changes nothing."""
        busy = {rid for rid, _, _ in items}
        new, fits = self.capacity_for([rid for rid, _, _ in items])
        if new > fits:
            raise SlotsExhausted(f"{new} new sequences but only {fits} of {self.runner.num_slots} KV slots can be used")
        kept = []
        for (rid, tokens, params), n in zip(items, upto):
            slot = self._slot(rid, params, busy)
            keep = min(self.runner.common_prefix(slot, tokens), n)
            self.runner.rollback(slot, keep)
            kept.append(keep)
        return kept

    def prefill(self, items: Sequence[tuple[str, list[int], SamplingParams]]) -> None:
        """Cache all but the last token of each sequence (its logits come with the first verify)."""
        self.verify([], items)

    def verify(
        self, items: Sequence[VerifyItem], prefill: Sequence[tuple[str, list[int], SamplingParams]] = ()
    ) -> list[VerifyResult]:
        """One batched forward of [uncached committed tokens] + draft per item, then verification.

        ``prefill``: prompt chunks (other requests) cached in the same forward, all but the last
        token of each, so the items' rows ride along with them instead of waiting for a forward of
        their own (docs/design.md, Scheduling). A row's numbers do not depend on the rest of the
        forward (invariant 2), so this changes no token."""
        every = [*prefill, *((i.request_id, i.tokens, i.params) for i in items)]
        if not every:
            return []
        kept = self._sync(every, [len(toks) - 1 for _, toks, _ in every])
        chunks = [(self.slots[rid], toks[k:-1]) for (rid, toks, _), k in zip(prefill, kept) if k < len(toks) - 1]
        kept = kept[len(prefill) :]
        invariant = self._invariant(p for _, _, p in every)
        if any(i.draft.parents is not None for i in items):
            if chunks:
                self.runner.forward([s for s, _ in chunks], [f for _, f in chunks], num_logits=0, invariant=invariant)
            return self._verify_trees(items, kept)
        feeds = [f for _, f in chunks] + [i.tokens[k:] + i.draft.tokens for i, k in zip(items, kept)]
        if not feeds:  # chunks already cached, nothing to verify
            return []
        logits = self.runner.forward(
            [s for s, _ in chunks] + [self.slots[i.request_id] for i in items],
            feeds,
            num_logits=[0] * len(chunks) + [len(i.draft.tokens) + 1 for i in items],
            invariant=invariant,
        )[len(chunks) :]
        results = []
        for item, row_logits in zip(items, logits):
            result, _ = self._verdict(item, row_logits)
            # Keep the committed tokens and the accepted drafts; the target's own token is fed next round.
            self.runner.rollback(self.slots[item.request_id], len(item.tokens) + result.num_accepted)
            results.append(result)
        return results

    def _verify_trees(self, items: Sequence[VerifyItem], kept: list[int]) -> list[VerifyResult]:
        """A batch holding token trees: one tree forward of every row (a chain is a tree), the
        uncached committed tokens as a chain above each draft's root (specdec/core/tree_forward.py)."""
        rows, parents = [], []
        for item, k in zip(items, kept):
            feed = item.tokens[k:]
            room = self.runner.max_len - len(item.tokens)  # nodes are stored one after another
            if item.draft.k > room:
                item.draft.keep(range(room))
            own = item.draft.parents if item.draft.parents is not None else chain_parents(item.draft.k)
            rows.append(feed + item.draft.tokens)
            parents.append(chain_parents(len(feed)) + [len(feed) - 1 if p < 0 else p + len(feed) for p in own])
        logits = tree_forward(
            self.runner,
            [self.slots[i.request_id] for i in items],
            rows,
            parents,
            invariant=self._invariant(i.params for i in items),
        )
        results = []
        for item, k, row_logits in zip(items, kept, logits):
            fed = len(item.tokens) - k
            result, path = self._verdict(item, row_logits[fed - 1 :])
            keep_path(self.runner, self.slots[item.request_id], list(range(fed)) + [fed + i for i in path])
            results.append(result)
        return results

    def _verdict(self, item: VerifyItem, logits: torch.Tensor) -> tuple[VerifyResult, list[int]]:
        """The verdict on an item's draft from the logits after its last committed token, and the
        accepted draft nodes (of a chain, its first ones)."""
        args = (logits, item.draft, item.params, item.mode)
        at = {"start_pos": len(item.tokens), "generator": self.generators[item.request_id]}
        if item.draft.parents is not None:
            return verify_tree(*args, **at)
        result = verify(*args, **at)
        return result, list(range(result.num_accepted))

    def _invariant(self, params: Iterable[SamplingParams]) -> bool:
        # The fast forward costs less (float32 CPU decode above all: docs/results.md, "Lossless output
        # and the invariant forward"); a batch of
        # only unseeded sampling requests, whose promise is a distribution, may take it.
        return self.runner.invariant_numerics and any(needs_invariance(p) for p in params)

    def release(self, request_id: str) -> None:
        self.slots.release(request_id)


__all__ = ["TargetVerifier", "VerifyItem", "SlotsExhausted", "needs_invariance"]
