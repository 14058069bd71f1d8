"""Per-request state of the speculative loop, free of torch: shared by the engine and the router.

A `RequestState` owns the committed tokens of one request (DESIGN.md invariant 1): it says how
many tokens to draft next round, and commits a round's verified tokens through the stop rules.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specdec.adaptive_k import AdaptiveK
from specdec.params import SamplingParams, VerifyMode
from specdec.stops import StopChecker


@dataclass
class RequestStats:
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    fail_open_rounds: int = 0  # rounds verified with k = 0 because the draft was late or gone
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def record(self, drafted: int, accepted: int) -> None:
        self.rounds += 1
        self.drafted += drafted
        self.accepted += accepted
        for counts, n in ((self.drafted_per_position, drafted), (self.accepted_per_position, accepted)):
            counts.extend([0] * (n - len(counts)))
            for j in range(n):
                counts[j] += 1

    def as_dict(self) -> dict:
        return {
            "rounds": self.rounds, "drafted": self.drafted, "accepted": self.accepted,
            "acceptance_rate": round(self.acceptance_rate, 4), "fail_open_rounds": self.fail_open_rounds,
            "accepted_per_position": list(self.accepted_per_position),
            "drafted_per_position": list(self.drafted_per_position),
        }


@dataclass
class KPolicy:
    """Fixed k, or adaptive within [k_min, k_max] from each request's acceptance history."""
    k: int = 4
    adaptive: bool = False
    k_min: int = 1
    k_max: int = 8
    cost_ratio: float = 0.4  # c = draft step / target step, for the adaptive choice

    def make(self) -> AdaptiveK | None:
        if not self.adaptive:
            return None
        return AdaptiveK(k_min=self.k_min, k_max=self.k_max, k_init=self.k, c=self.cost_ratio)


@dataclass
class CostMeter:
    """Measured cost ratio c = draft step / target step (EWMA), for the adaptive choice of k.

    The draft step is a round's drafting time divided by its longest draft (steps run batched);
    the target step is the round's verification time."""
    c: float = 0.4
    weight: float = 0.2  # of each new round

    def update(self, draft_seconds: float, draft_steps: int, verify_seconds: float) -> float:
        if draft_steps > 0 and verify_seconds > 0:
            sample = (draft_seconds / draft_steps) / verify_seconds
            self.c += self.weight * (sample - self.c)
        return self.c


@dataclass
class RequestState:
    id: str
    prompt_ids: list[int]
    params: SamplingParams
    mode: VerifyMode
    stops: StopChecker
    adaptive: AdaptiveK | None = None
    fixed_k: int = 0
    tokens: list[int] = field(default_factory=list)  # prompt + committed generated tokens
    finish_reason: str | None = None
    stats: RequestStats = field(default_factory=RequestStats)

    def __post_init__(self) -> None:
        if not self.tokens:
            self.tokens = list(self.prompt_ids)

    @property
    def generated(self) -> list[int]:
        return self.tokens[len(self.prompt_ids):]

    @property
    def text(self) -> str:
        return self.stops.text

    def next_k(self, max_context: int, cost_ratio: float | None = None) -> int:
        """Draft length for the next round, bounded by what may still be emitted and by the context."""
        if self.adaptive is not None and cost_ratio is not None:
            self.adaptive.c = cost_ratio
        k = self.adaptive.next_k() if self.adaptive is not None else self.fixed_k
        remaining = self.params.max_tokens - len(self.generated) - 1  # the target adds one token itself
        return max(0, min(k, remaining, max_context - len(self.tokens)))

    def commit(self, verified: list[int], num_accepted: int, drafted: int, max_context: int) -> list[int]:
        """Apply the stop rules to a round's verified tokens; return the tokens committed."""
        committed, finish = self.stops.accept(verified)
        self.stats.record(drafted, min(num_accepted, len(committed)))  # nothing past a stop counts
        if self.adaptive is not None and drafted:
            self.adaptive.update(drafted, num_accepted)
        self.tokens.extend(committed)
        if finish is None and len(self.tokens) >= max_context:
            finish = "length"
        self.finish_reason = finish
        return committed


def new_request(request_id: str, prompt_ids: list[int], params: SamplingParams, mode: VerifyMode,
                k_policy: KPolicy, eos_token_ids: set[int], decode) -> RequestState:
    return RequestState(
        id=request_id, prompt_ids=list(prompt_ids), params=params, mode=mode,
        stops=StopChecker(params, eos_token_ids, decode, prompt_tokens=prompt_ids),
        adaptive=k_policy.make(), fixed_k=k_policy.k,
    )
