"""SpecEngine: the single-process speculative loop over a batch with continuous admission.

Each round: new prompts are cached in fixed-size chunks within the round's token budget
(:mod:`specdec.core.prefill_plan`, the same policy as the router's), the drafter proposes up to k
tokens per decoding request, the target verifies all rows in one batched forward ([last committed
token] + draft) that also caches the round's prompt chunks, the verifier accepts a prefix plus one
target token, the stop rules are applied token by token, and the target's KV cache is rolled back
past the rejected tokens. Target-only decoding (k = 0) runs through the same loop.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass

from specdec.core.drafters import Drafter, DraftInput, NoDrafter, propose_within_k
from specdec.core.params import InvalidParams, SamplingParams, choose_mode
from specdec.core.prefill_plan import DEFAULT_BUDGET, DEFAULT_CHUNK, PrefillNeed, plan_prefill
from specdec.core.request_state import CostMeter, KPolicy, RequestState, RequestStats, new_request
from specdec.core.runner import ModelRunner
from specdec.core.target import TargetVerifier, VerifyItem
from specdec.core.tree_size import TreeSizer

log = logging.getLogger(__name__)

__all__ = ["SpecEngine", "KPolicy", "RequestStats", "Result", "StepOutput"]


@dataclass
class StepOutput:
    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None


@dataclass
class Result:
    request_id: str
    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    stats: RequestStats


class SpecEngine:
    def __init__(
        self,
        target: ModelRunner,
        tokenizer,
        drafter: Drafter | None = None,
        k_policy: KPolicy | None = None,
        eos_token_ids: set[int] | None = None,
        verify_mode: str | None = None,
        max_batched_tokens: int = DEFAULT_BUDGET,
        prefill_chunk: int = DEFAULT_CHUNK,
        price_drafts: bool = True,
    ):
        self.target = target
        # False: the adaptive k keeps k_policy.cost_ratio as a draft token's cost instead of the
        # measured one, as the router does for n-gram drafts (router/draft_depth.py want_k); the
        # capacity profiler's n-gram run then takes the router's k path over the same text
        self.price_drafts = price_drafts
        self.max_batched_tokens = max_batched_tokens  # <= 0: no budget (prompts cached whole)
        self.prefill_chunk = prefill_chunk
        self.verifier = TargetVerifier(target)
        self.tokenizer = tokenizer
        self.drafter = drafter or NoDrafter()
        self.k_policy = k_policy or KPolicy()
        if isinstance(self.drafter, NoDrafter):
            self.k_policy = KPolicy(k=0)
        if eos_token_ids is None:
            eos_token_ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
        self.eos_token_ids = set(eos_token_ids)
        self.verify_mode = verify_mode
        self.cost = CostMeter(c=self.k_policy.cost_ratio)
        self.tree_sizer = TreeSizer()
        self.waiting: deque[RequestState] = deque()
        self.running: list[RequestState] = []
        self.finished: dict[str, RequestState] = {}
        self._ids = itertools.count()

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    # ---- admission ---------------------------------------------------------------------------
    def add_request(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        k_policy: KPolicy | None = None,
    ) -> str:
        if not prompt_ids:
            raise InvalidParams("prompt", "the prompt is empty")
        vocab = self.target.vocab_size
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise InvalidParams("prompt_token_ids", f"token ids must be in [0, {vocab})")
        params.validate(vocab_size=vocab, max_context=self.target.max_len, prompt_len=len(prompt_ids))
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        req = new_request(
            rid,
            prompt_ids,
            params,
            choose_mode(params, self.verify_mode),
            k_policy or self.k_policy,
            self.eos_token_ids,
            self._decode,
        )
        self.waiting.append(req)
        return rid

    def _admit(self) -> None:
        # A running request takes its KV slot with its first chunk (or its first verify).
        while self.waiting and self.verifier.free_slots > sum(not self.verifier.has(r.id) for r in self.running):
            self.running.append(self.waiting.popleft())

    def _prefill(self, verify_tokens: int) -> list[tuple[str, list[int], SamplingParams]]:
        """This round's prompt chunks, as the budget allows: the drafter caches them now; the target
        caches them in the round's verify forward (TargetVerifier.verify), a prompt's last chunk in
        its first verify row. Returns the chunks that are not a prompt's last."""
        prefilling = [r for r in self.running if r.prefilling]
        needs = [PrefillNeed(r.id, r.prefilled, r.prefill_total) for r in prefilling]
        plan = plan_prefill(needs, verify_tokens, self.max_batched_tokens, self.prefill_chunk)
        chunks = [r for r in prefilling if r.id in plan]
        if not chunks:
            return []
        # The verifier caches all but the last token it is given: pass the prompt up to the chunk's end.
        ends = [r.prompt_ids[: plan[r.id] + 1] for r in chunks]
        self.drafter.prefill([DraftInput(r.id, toks, r.params, r.mode, 0) for r, toks in zip(chunks, ends)])
        for r in chunks:
            r.prefilled = plan[r.id]
        return [(r.id, toks, r.params) for r, toks in zip(chunks, ends) if r.prefilling]

    # ---- one round ---------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        self._admit()
        max_len = self.target.max_len
        decoding = [r for r in self.running if not r.prefilling]
        per_token = self.cost.per_token if self.price_drafts else None
        ks = [r.next_k(max_len, per_token) for r in decoding]
        chunks = self._prefill(sum(k + 1 for k in ks))
        batch = decoding + [r for r in self.running if r not in decoding and not r.prefilling]
        if not batch:
            self.verifier.prefill(chunks)
            return []
        ks += [r.next_k(max_len, per_token) for r in batch[len(decoding) :]]
        inputs = [DraftInput(r.id, r.tokens, r.params, r.mode, k) for r, k in zip(batch, ks)]
        t0 = time.perf_counter()
        drafts = propose_within_k(self.drafter, inputs)
        t1 = time.perf_counter()
        trees = any(d.scores for d in drafts)
        if trees:  # tree drafts cut to the nodes worth verifying (specdec/core/tree_size.py)
            self.tree_sizer.cut(drafts, t1 - t0)
        items = [VerifyItem(r.id, r.tokens, r.params, r.mode, d) for r, d in zip(batch, drafts)]
        results = self.verifier.verify(items, chunks)
        if trees and not chunks:
            self.tree_sizer.observe_round(drafts, [res.num_accepted for res in results], time.perf_counter() - t1)
        # A first round holds the drafter's prefill, a round with prompt chunks the target's: not a step.
        if all(r.generated for r in batch) and not chunks:
            self.cost.update(
                t1 - t0,
                max(d.depth for d in drafts),
                time.perf_counter() - t1,
                sum(len(d.tokens) + 1 for d in drafts),
            )
        outputs = []
        for req, draft, result in zip(batch, drafts, results):
            committed = req.commit(result.tokens, result.num_accepted, draft.depth, max_len)
            outputs.append(StepOutput(req.id, committed, req.finish_reason))
            if req.finish_reason is not None:
                self._finish(req, req.finish_reason)
        return outputs

    def _finish(self, req: RequestState, reason: str) -> None:
        req.finish_reason = reason
        self.running.remove(req)
        self.verifier.release(req.id)
        self.drafter.release(req.id)
        self.finished[req.id] = req

    def cancel(self, request_id: str) -> bool:
        """Drop a waiting or running request and free its slots. True if it was found."""
        for req in list(self.waiting):
            if req.id == request_id:
                self.waiting.remove(req)
                req.finish_reason = "cancelled"
                self.finished[req.id] = req
                return True
        for req in self.running:
            if req.id == request_id:
                self._finish(req, "cancelled")
                return True
        return False

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def result(self, request_id: str) -> Result:
        req = self.finished[request_id]
        return Result(req.id, req.prompt_ids, req.generated, req.text, req.finish_reason, req.stats)

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[Result]:
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        while self.has_work:
            self.step()
        return [self.result(i) for i in ids]
