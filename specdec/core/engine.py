"""SpecEngine: the single-process speculative loop over a batch with continuous admission.

Each round: the drafter proposes up to k tokens per running request, the target verifies all rows
in one batched forward ([last committed token] + draft), the verifier accepts a prefix plus one
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
from specdec.core.request_state import CostMeter, KPolicy, RequestState, RequestStats, new_request
from specdec.core.runner import ModelRunner
from specdec.core.target import TargetVerifier, VerifyItem

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
    ):
        self.target = target
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
        admitted = []
        while self.waiting and self.verifier.free_slots > len(admitted):
            admitted.append(self.waiting.popleft())
        if admitted:
            self.verifier.prefill([(r.id, r.tokens, r.params) for r in admitted])
            self.running.extend(admitted)

    # ---- one round ---------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        self._admit()
        batch = list(self.running)
        if not batch:
            return []
        max_len = self.target.max_len
        inputs = [DraftInput(r.id, r.tokens, r.params, r.mode, r.next_k(max_len, self.cost.per_token)) for r in batch]
        t0 = time.perf_counter()
        drafts = propose_within_k(self.drafter, inputs)
        t1 = time.perf_counter()
        results = self.verifier.verify([VerifyItem(r.id, r.tokens, r.params, r.mode, d) for r, d in zip(batch, drafts)])
        if all(r.generated for r in batch):  # a first round holds the drafter's prefill: not a step
            self.cost.update(
                t1 - t0,
                max(len(d.tokens) for d in drafts),
                time.perf_counter() - t1,
                sum(len(d.tokens) + 1 for d in drafts),
            )
        outputs = []
        for req, draft, result in zip(batch, drafts, results):
            committed = req.commit(result.tokens, result.num_accepted, len(draft.tokens), max_len)
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
