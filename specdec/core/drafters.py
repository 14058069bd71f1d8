"""Drafters: propose up to k tokens per sequence behind one small interface.

A drafter sees each sequence as the full list of committed tokens (prompt + generated). It keeps
whatever cache it likes keyed by request id, and must rebuild it from those tokens when it is
missing or stale (a restarted worker, a rollback): the committed tokens are the truth.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from specdec.core.ngram import NgramDrafter
from specdec.core.params import SamplingParams, VerifyMode
from specdec.core.round_types import Draft
from specdec.core.runner import ModelRunner, RunnerError, SlotsExhausted
from specdec.core.sampling import make_generator, process_logits, sample_sparse, sparse_topk
from specdec.core.slots import SlotTable
from specdec.core.static_greedy import can_draft_greedily, greedy_steps
from specdec.core.token_tree import depths, merge_branches, within_depth
from specdec.core.tree_drafting import TreeRow, TreeShape, branch_chain, grow_trees, pick_scores, ranked

log = logging.getLogger(__name__)

_LOOKUP_LOGP = math.log(0.5)
_LONG_FEED = 32  # tokens: a row feeding more is a prompt catching up, forwarded apart from one-token rows


@dataclass
class DraftInput:
    request_id: str
    tokens: list[int]  # committed tokens: prompt + generated; the draft continues them
    params: SamplingParams
    mode: VerifyMode
    k: int


class Drafter(Protocol):
    def propose(self, inputs: Sequence[DraftInput]) -> list[Draft]: ...

    def prefill(self, inputs: Sequence[DraftInput]) -> None:
        """Cache all but the last of each input's tokens ahead of its first propose (a prompt chunk)."""

    def release(self, request_id: str) -> None: ...


def propose_within_k(drafter: Drafter, inputs: Sequence[DraftInput]) -> list[Draft]:
    """`drafter.propose`, each draft cut to its input's k: a drafter may return fewer, never more."""
    drafts = drafter.propose(inputs)
    for inp, draft in zip(inputs, drafts):
        draft.keep(range(min(inp.k, draft.k)) if draft.parents is None else within_depth(draft.parents, inp.k))
    return drafts


class NoDrafter:
    """Target-only decoding through the same loop (k = 0)."""

    def propose(self, inputs: Sequence[DraftInput]) -> list[Draft]:
        return [Draft(tokens=[]) for _ in inputs]

    def prefill(self, inputs: Sequence[DraftInput]) -> None:
        pass

    def release(self, request_id: str) -> None:
        pass


class NgramProposer:
    """Prompt lookup (no model). Its drafts are point masses, so rejection sampling stays exact."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        self.ngram = NgramDrafter(max_ngram=max_ngram, min_ngram=min_ngram)

    def propose(self, inputs: Sequence[DraftInput]) -> list[Draft]:
        drafts = self.ngram.propose([i.tokens for i in inputs], [i.k for i in inputs])
        for draft, inp in zip(drafts, inputs):
            if inp.mode is not VerifyMode.REJECTION:
                draft.probs = None
        return drafts

    def prefill(self, inputs: Sequence[DraftInput]) -> None:
        pass

    def release(self, request_id: str) -> None:
        pass


class ModelDrafter:
    """A draft model on the runner: batched, KV-cached; tokens plus sparse probabilities.

    In rejection mode each token is sampled from the draft's top-K truncated, renormalised
    distribution, which is sent along (K ids + K probs) so the verifier uses exactly it.
    In invariant mode the draft uses the same Gumbel noise as the target: argmax(log q + g).

    With `lookup` (greedy and invariant modes, where a draft token is a function of the logits),
    each forward also feeds up to `max_guesses` prompt-lookup guesses for the next tokens: the
    draft model checks them at once and keeps the prefix it would have drafted itself, plus its
    own token where they part. Where the text is a copy, one forward drafts several tokens;
    elsewhere the round goes on one token per forward.
    """

    def __init__(
        self,
        runner: ModelRunner,
        top_k_sent: int = 16,
        lookup: NgramDrafter | None = None,
        max_guesses: int = 3,
        cheap_rows: int = 4,
        tree: TreeShape | None = None,
    ):
        self.runner = runner
        # Greedy and seeded requests draft a token tree of this shape (specdec/core/tree_drafting.py);
        # None: chains.
        self.tree = tree
        # Per request drafting a chain with its runners-up, this round: each position's ranking.
        self._ranked: dict[str, list[list[tuple[int, float]]]] = {}
        self.top_k_sent = top_k_sent
        self.lookup = lookup
        self.max_guesses = max_guesses  # per forward: a few more rows cost little in a memory-bound step
        # ...up to a point: the int8 CPU kernel works in blocks of 4 rows, a fifth row costs a second
        # block (`specdec bench runner --as-draft --tokens-sweep`; docs/results.md, "Small costs behind rules
        # in the code").
        self.cheap_rows = cheap_rows
        # Per request, living and dying with its slot (SlotTable.on_free):
        self.guess_budget: dict[str, int] = {}  # 1 after a miss, max_guesses after a hit
        self.generators: dict[str, torch.Generator] = {}
        self.slots = SlotTable(runner, on_free=self._forget)

    def _forget(self, request_id: str) -> None:
        self.generators.pop(request_id, None)
        self.guess_budget.pop(request_id, None)

    def release(self, request_id: str) -> None:
        self.slots.release(request_id)

    def _slot(self, inp: DraftInput, busy: set[str]) -> int | None:
        try:
            slot, fresh = self.slots.get(inp.request_id, busy)
        except SlotsExhausted:
            return None
        if fresh or inp.request_id not in self.generators:
            seed = inp.params.seed
            # Draft randomness must not replay the verifier's stream; offset the seed.
            self.generators[inp.request_id] = make_generator(None if seed is None else seed + 1)
        return slot

    def _pick(
        self, logits: torch.Tensor, inp: DraftInput, position: int
    ) -> tuple[int, tuple[list[int], list[float]] | None]:
        if inp.mode is VerifyMode.REJECTION:
            logq = process_logits(logits, inp.params)
            ids, probs = sparse_topk(logq, self.top_k_sent)
            return sample_sparse(ids, probs, self.generators[inp.request_id]), (ids, probs)
        scores = pick_scores(logits, inp.params, inp.mode, position)
        token = int(torch.argmax(scores))
        if inp.request_id in self._ranked:  # a chain that becomes a tree: its runners-up too
            self._ranked[inp.request_id].append(ranked(scores, token, self.tree.width))
        return token, None

    def _guesses(self, inp: DraftInput, draft: Draft, limit: int, fed: int) -> list[int]:
        """Prompt-lookup tokens to feed after the `fed` tokens; all right gives one token more."""
        n = min(self.guess_budget.get(inp.request_id, self.max_guesses), limit - len(draft.tokens) - 1)
        if fed <= self.cheap_rows:  # a prefill is dear anyway; a decode-sized forward stays cheap
            n = min(n, self.cheap_rows - fed)
        if self.lookup is None or inp.mode is VerifyMode.REJECTION or n <= 0:
            return []
        return self.lookup.propose_one(inp.tokens + draft.tokens, n).tokens

    def prefill(self, inputs: Sequence[DraftInput]) -> None:
        busy = {i.request_id for i in inputs}
        rows, feeds = [], []
        for inp in inputs:
            slot = self._slot(inp, busy)
            if slot is None:  # no slot: the first propose will cache the prompt itself
                continue
            keep = min(self.runner.common_prefix(slot, inp.tokens), len(inp.tokens) - 1)
            self.runner.rollback(slot, keep)
            if keep < len(inp.tokens) - 1:
                rows.append(slot)
                feeds.append(inp.tokens[keep:-1])
        if rows:
            self.runner.forward(rows, feeds, num_logits=0)

    def propose(self, inputs: Sequence[DraftInput]) -> list[Draft]:
        if self.tree is None:
            return self._chains(inputs)
        if self.tree.expand == 0:  # the chain's own forwards, its runners-up as leaves (not sampled)
            trees = [b for b, i in enumerate(inputs) if i.mode is not VerifyMode.REJECTION]
            self._ranked = {inputs[b].request_id: [] for b in trees}
            try:
                drafts = self._chains(inputs)
            finally:
                ranked_by_id, self._ranked = self._ranked, {}
            for b in trees:
                ranks = ranked_by_id[inputs[b].request_id]
                if drafts[b].tokens and len(ranks) == len(drafts[b].tokens):
                    drafts[b] = branch_chain(drafts[b].tokens, ranks, self.tree.nodes)
            return drafts
        return self._trees(inputs)

    def _trees(self, inputs: Sequence[DraftInput]) -> list[Draft]:
        """Token trees: one forward of each row's uncached committed tokens, then a level per forward
        (specdec/core/tree_drafting.py); a sampling request's drawn without replacement."""
        drafts = [Draft(tokens=[], probs=[] if i.mode is VerifyMode.REJECTION else None) for i in inputs]
        busy = {i.request_id for i in inputs}
        rows, feeds, where = [], [], []
        for b, inp in enumerate(inputs):
            # The grown nodes are stored one after another past the committed tokens.
            depth = min(inp.k, (self.runner.max_len - len(inp.tokens)) // self.tree.expand)
            slot = self._slot(inp, busy) if depth > 0 else None
            if slot is None:  # nothing to draft, or no slot free: fail open with an empty draft
                continue
            keep = min(self.runner.common_prefix(slot, inp.tokens), len(inp.tokens) - 1)
            self.runner.rollback(slot, keep)
            generator = self.generators[inp.request_id]
            rows.append(TreeRow(slot, inp.tokens, inp.params, inp.mode, depth, generator, self.top_k_sent))
            feeds.append(inp.tokens[keep:])
            where.append(b)
        if not rows:
            return drafts
        try:
            roots = self._forward([r.slot for r in rows], feeds, [1] * len(rows))
            grown = grow_trees(self.runner, rows, [logits[0] for logits in roots], self.tree)
        except RunnerError as exc:  # a drafter problem never fails the request
            log.warning("draft tree failed, proposing nothing this round: %s", exc)
            for row in rows:
                self.runner.rollback(row.slot, min(self.runner.lengths[row.slot], len(row.tokens) - 1))
            return drafts
        for b, row, draft in zip(where, rows, grown):
            if self.lookup is not None and row.mode is not VerifyMode.REJECTION:
                # The prompt lookup's guess as one more branch, where it differs (greedy and seeded
                # trees: a sampled tree's children must be the draws, tree_sampling.py).
                guess = self.lookup.propose_one(row.tokens, row.depth).tokens
                draft.tokens, draft.parents = merge_branches(draft.tokens, draft.parents, [(-1, guess)])
                # A prompt-lookup guess the model did not draft: even odds per token.
                draft.scores += [d * _LOOKUP_LOGP for d in depths(draft.parents)[len(draft.scores) :]]
            drafts[b] = draft
        return drafts

    def _chains(self, inputs: Sequence[DraftInput]) -> list[Draft]:
        drafts = [Draft(tokens=[], probs=[] if i.mode is VerifyMode.REJECTION else None) for i in inputs]
        rows, feeds, guesses, limits = [], [], {}, {}
        busy = {i.request_id for i in inputs}
        for b, inp in enumerate(inputs):
            limits[b] = min(inp.k, self.runner.max_len - len(inp.tokens))
            if limits[b] <= 0:
                continue
            slot = self._slot(inp, busy)
            if slot is None:  # no slot free: fail open with an empty draft
                continue
            keep = min(self.runner.common_prefix(slot, inp.tokens), len(inp.tokens) - 1)
            self.runner.rollback(slot, keep)
            guesses[b] = self._guesses(inp, drafts[b], limits[b], fed=len(inp.tokens) - keep)
            rows.append(b)
            feeds.append(inp.tokens[keep:] + guesses[b])
        while rows:
            slots = [self.slots[inputs[b].request_id] for b in rows]
            try:
                logits = self._forward(slots, feeds, [1 + len(guesses[b]) for b in rows])
            except RunnerError as exc:  # a drafter problem never fails the request
                log.warning("draft forward failed, proposing nothing more this round: %s", exc)
                break
            next_rows, next_feeds = [], []
            for b, slot, row_logits in zip(rows, slots, logits):
                inp, draft = inputs[b], drafts[b]
                kept = self._take(row_logits, inp, draft, guesses[b])
                if guesses[b]:  # where guesses keep missing, probe with one (a row costs little)
                    self.guess_budget[inp.request_id] = self.max_guesses if kept else 1
                # The cache holds the committed tokens and the guesses fed; keep those drafted.
                self.runner.rollback(slot, len(inp.tokens) + len(draft.tokens) - 1)
                if len(draft.tokens) < limits[b]:
                    guesses[b] = self._guesses(inp, draft, limits[b], fed=1)
                    next_rows.append(b)
                    next_feeds.append([draft.tokens[-1]] + guesses[b])
            if self._draft_on_device(inputs, drafts, next_rows, guesses, limits):
                next_rows = [b for b in next_rows if len(drafts[b].tokens) < limits[b]]
                for b in next_rows:
                    guesses[b] = self._guesses(inputs[b], drafts[b], limits[b], fed=1)
                next_feeds = [[drafts[b].tokens[-1]] + guesses[b] for b in next_rows]
            rows, feeds = next_rows, next_feeds
        return drafts

    def _draft_on_device(
        self, inputs: Sequence[DraftInput], drafts: list[Draft], rows: list[int], guesses: dict, limits: dict
    ) -> bool:
        """Where every row drafts greedily with no guesses to check, their next tokens, as many as
        every row still drafts, in one call that feeds each argmax back on the device
        (specdec/core/static_greedy.py) instead of one forward and one host round trip per token."""
        if not rows or not can_draft_greedily(self.runner):
            return False
        if any(inputs[b].mode is not VerifyMode.GREEDY or guesses[b] for b in rows):
            return False
        steps = min(limits[b] - len(drafts[b].tokens) for b in rows)
        if steps < 2:  # one forward either way
            return False
        slots = [self.slots[inputs[b].request_id] for b in rows]
        try:
            picks = greedy_steps(self.runner, slots, [drafts[b].tokens[-1] for b in rows], steps)
        except RunnerError as exc:  # a drafter problem never fails the request
            log.warning("greedy draft steps failed, drafting one forward per token: %s", exc)
            return False
        for b, row in zip(rows, picks):
            drafts[b].tokens.extend(row)
        return True

    def _forward(self, slots: list[int], feeds: list[list[int]], num_logits: list[int]) -> list[torch.Tensor]:
        """One forward of the rows; two where some feed a prompt (longer than :data:`_LONG_FEED`)
        beside one-token rows, whose attention the runner would pad to the prompt's width: a
        prompt of 180 tokens beside 3 decoding rows took 342 ms in one forward, 214-240 + 36 in
        two (docs/results.md, "Small costs behind rules in the code")."""
        long = [i for i, f in enumerate(feeds) if len(f) > _LONG_FEED]
        short = [i for i, f in enumerate(feeds) if len(f) <= _LONG_FEED]
        if not long or not short:
            return self.runner.forward(slots, feeds, num_logits)
        out: dict[int, torch.Tensor] = {}
        for group in (long, short):
            rows = self.runner.forward(
                [slots[i] for i in group], [feeds[i] for i in group], [num_logits[i] for i in group]
            )
            out.update(zip(group, rows))
        return [out[i] for i in range(len(feeds))]

    def _take(self, row_logits: torch.Tensor, inp: DraftInput, draft: Draft, guessed: list[int]) -> int:
        """Draft from logits [1 + len(guessed), vocab] while the model's picks equal the guesses;
        return how many guesses were kept."""
        for j, logits in enumerate(row_logits):
            token, sparse = self._pick(logits, inp, len(inp.tokens) + len(draft.tokens))
            draft.tokens.append(token)
            if sparse is not None:
                draft.probs.append(sparse)
            if j >= len(guessed) or token != guessed[j]:
                return j
        return len(guessed)
