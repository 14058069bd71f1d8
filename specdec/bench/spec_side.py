"""The specdec side of `specdec bench generate`: the single-process engine, with its drafter timed."""

from __future__ import annotations

import time
from dataclasses import dataclass

from specdec.bench.records import Outcome, Round
from specdec.core.engine import SpecEngine
from specdec.core.params import SamplingParams


class TimedDrafter:
    """Wraps a drafter: times each propose() and counts the draft tokens that reached verification
    (of a token tree, those on its longest path: what a round can accept, as RequestStats counts)."""

    def __init__(self, inner):
        self.inner = inner
        self._seconds = 0.0
        self._drafts: list = []

    def propose(self, inputs):
        t0 = time.perf_counter()
        drafts = self.inner.propose(inputs)
        self._seconds += time.perf_counter() - t0
        self._drafts.extend(drafts)
        return drafts

    def release(self, request_id: str) -> None:
        self.inner.release(request_id)

    def take(self) -> tuple[int, float]:
        """(draft tokens, seconds) since the last take. Read after the step: the engine cuts drafts
        to k, and trees to the nodes it verifies, in place."""
        out = (sum(d.depth for d in self._drafts), self._seconds)
        self._drafts, self._seconds = [], 0.0
        return out

    def __getattr__(self, name):
        return getattr(self.inner, name)


@dataclass
class SpecConfig:
    name: str
    engine: SpecEngine
    timer: TimedDrafter | None
    k: int | None  # fixed k, None for adaptive / n-gram / target-only
    temperature: float = 0.0  # above 0: unseeded sampling (rejection verification), not greedy


def run_spec(cfg: SpecConfig, prompt_ids: list[int], max_tokens: int) -> Outcome:
    """One request through the engine, step by step, timing each round."""
    engine = cfg.engine
    if cfg.timer is not None:
        cfg.timer.take()
    rounds: list[Round] = []
    t0 = time.perf_counter()
    rid = engine.add_request(prompt_ids, SamplingParams(max_tokens=max_tokens, temperature=cfg.temperature))
    while engine.has_work:
        ts = time.perf_counter()
        outputs = engine.step()
        te = time.perf_counter()
        committed = sum(len(o.new_token_ids) for o in outputs if o.request_id == rid)
        drafted, draft_s = cfg.timer.take() if cfg.timer is not None else (0, 0.0)
        rounds.append(Round(te - ts, committed, drafted, draft_s))
    seconds = time.perf_counter() - t0
    result = engine.result(rid)
    return seconds, list(result.token_ids), result.text, result.finish_reason, rounds, result.stats.as_dict()
