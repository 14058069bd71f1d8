"""Per-request state of the speculative loop, free of torch: shared by the engine and the router.

A `RequestState` owns the committed tokens of one request (docs/design.md, invariant 1): it says how
many tokens to draft next round, and commits a round's verified tokens through the stop rules.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specdec.core.adaptive_k import AdaptiveK
from specdec.core.params import SamplingParams, VerifyMode
from specdec.core.stops import StopChecker


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
            "rounds": self.rounds,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "fail_open_rounds": self.fail_open_rounds,
            "accepted_per_position": list(self.accepted_per_position),
            "drafted_per_position": list(self.drafted_per_position),
        }


@dataclass
class KPolicy:
    """Fixed k, or adaptive within [k_min, k_max] from each request's acceptance history."""

    k: int = 4
    adaptive: bool = False
    k_min: int = 1
    k_max: int = 12
    cost_ratio: float = 0.4  # c = draft step / target step, for the adaptive choice

    def make(self) -> AdaptiveK | None:
        if not self.adaptive:
            return None
        return AdaptiveK(k_min=self.k_min, k_max=self.k_max, k_init=self.k, c=self.cost_ratio)


@dataclass
class LineFit:
    """A least-squares line y = a + b x through recent (x, y) points (exponentially weighted
    moments, ``weight`` per new point); no line until the x values have spread."""

    weight: float = 0.05
    _moments: list[float] = field(default_factory=lambda: [0.0] * 5, repr=False)  # 1, x, y, x^2, x y

    def add(self, x: float, y: float) -> None:
        for i, v in enumerate((1.0, x, y, x * x, x * y)):
            self._moments[i] += self.weight * (v - self._moments[i])

    def line(self, at: float = 0.0) -> tuple[float, float] | None:
        """(y at x = ``at``, slope); None while the points' x values have a variance below 0.25."""
        w, x, y, xx, xy = self._moments
        if w <= 0:
            return None
        x, y, xx, xy = x / w, y / w, xx / w, xy / w
        var = xx - x * x
        if var < 0.25:
            return None
        slope = (xy - x * y) / var
        return y - slope * (x - at), slope


def is_plain_round(verified_tokens: int, requests: int) -> bool:
    """A round the verify cost can be read from as plain decoding's: at most one draft token for
    every two requests."""
    return 2 * (verified_tokens - requests) <= requests


@dataclass
class PointMean:
    """A running mean of (x, y) points (``weight`` per new point); None before the first."""

    weight: float = 0.2
    point: tuple[float, float] | None = None

    def add(self, x: float, y: float) -> None:
        if self.point is None:
            self.point = (x, y)
        else:
            px, py = self.point
            self.point = (px + self.weight * (x - px), py + self.weight * (y - py))


@dataclass
class CostMeter:
    """Measured costs of a round, in units of a target step, for the adaptive choice of k.

    c: draft time per draft token / verify time (EWMA). The draft step is a round's drafting time
    divided by its longest draft (steps run batched); the target step is the round's verify time
    (the service passes the target worker's own compute: a wall time can hold another lane's call).
    r: what one more verified token adds to a verify, relative to a one-token verify. A verify is
    flat in k only while it stays memory-bound (on 2 CPU cores it grows past ~5 tokens), so each
    draft token costs c + r; r comes from a least-squares line through recent rounds' (tokens
    verified, verify seconds), 0 until rounds of different sizes have been seen.
    """

    c: float = 0.4
    weight: float = 0.2  # of each new round, for c
    line_weight: float = 0.05  # for the lines: a longer memory, to span many sizes
    verify: LineFit = field(default=None, repr=False)  # verify seconds by tokens verified
    # (tokens verified, seconds) of recent rounds that were plain decoding, and of those that were not
    # (update's `requests`): the rebalancer's line through the two (anchored_line).
    plain: PointMean = field(default_factory=PointMean, repr=False)
    drafting: PointMean = field(default_factory=PointMean, repr=False)

    def __post_init__(self) -> None:
        self.verify = self.verify or LineFit(self.line_weight)

    def update(
        self,
        draft_seconds: float,
        draft_steps: int,
        verify_seconds: float,
        verified_tokens: int = 0,
        requests: int | None = None,
    ) -> float:
        """One round's costs; `requests`: the rows it verified for (`is_plain_round` tells plain
        decoding's rounds from drafting ones)."""
        if draft_steps > 0 and verify_seconds > 0:
            sample = (draft_seconds / draft_steps) / verify_seconds
            self.c += self.weight * (sample - self.c)
        if verified_tokens > 0 and verify_seconds > 0:
            self.verify.add(float(verified_tokens), verify_seconds)
            if requests:
                plain = is_plain_round(verified_tokens, requests)
                (self.plain if plain else self.drafting).add(float(verified_tokens), verify_seconds)
        return self.c

    def line(self) -> tuple[float, float] | None:
        """(one-token verify seconds, seconds per extra verified token) through recent rounds; None
        until rounds of different sizes have been seen (the rebalancer's goodput model uses it)."""
        return self.verify.line(at=1.0)

    def anchored_line(self) -> tuple[float, float] | None:
        """As `line`, but through the mean of recent plain rounds and the mean of recent drafting
        rounds where both were seen at widths 2 or more tokens apart: speculating rounds alone span
        too few widths to place plain decoding's (router/speculation_off.py, `plain_probe_due`),
        and one plain round among many would barely move a least-squares line."""
        if self.plain.point is None or self.drafting.point is None:
            return self.line()
        (x0, y0), (x1, y1) = self.plain.point, self.drafting.point
        if x1 - x0 < 2:
            return self.line()
        slope = (y1 - y0) / (x1 - x0)
        return y0 - slope * (x0 - 1.0), slope

    @property
    def r(self) -> float:
        fit = self.line()
        if fit is None:
            return 0.0
        one_token, slope = fit
        return min(max(slope / one_token, 0.0), 1.0) if one_token > 0 else 0.0

    @property
    def per_token(self) -> float:
        """Cost of one more draft token (drafting it and verifying it), in target steps."""
        return self.c + self.r


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
    prefilled: int = 0  # prompt tokens in the target's cache, set by the chunked prefill (prefill_plan)
    # Tokens to cache in chunks before the next verify, when more than the prompt's: a request
    # that lost its caches (preempted: router/preemption.py) caches what it had again, in chunks.
    refill: int | None = None

    def __post_init__(self) -> None:
        if not self.tokens:
            self.tokens = list(self.prompt_ids)

    @property
    def prefill_total(self) -> int:
        """Tokens to cache before the first verify (whose row feeds the last of them): the prompt's
        but its last, or what `refill` says."""
        return len(self.prompt_ids) - 1 if self.refill is None else self.refill

    @property
    def prefilling(self) -> bool:
        return self.prefilled < self.prefill_total

    @property
    def generated(self) -> list[int]:
        return self.tokens[len(self.prompt_ids) :]

    @property
    def text(self) -> str:
        return self.stops.text

    def next_k(self, max_context: int, cost_ratio: float | None = None, k_range: tuple[int, int] | None = None) -> int:
        """Draft length for the next round, bounded by what may still be emitted and by the context
        (and, for an adaptive request, by ``k_range``: the target's depth plan, router/draft_depth.py,
        which also scales ``cost_ratio``)."""
        if self.adaptive is not None and cost_ratio is not None:
            self.adaptive.c = cost_ratio
        k = self.adaptive.next_k() if self.adaptive is not None else self.fixed_k
        if self.adaptive is not None and k_range is not None:
            k = min(max(k, k_range[0]), k_range[1])
        remaining = self.params.max_tokens - len(self.generated) - 1  # the target adds one token itself
        return max(0, min(k, remaining, max_context - len(self.tokens)))

    def commit(
        self, verified: list[int], num_accepted: int, drafted: int, max_context: int, adapt: bool = True
    ) -> list[int]:
        """Apply the stop rules to a round's verified tokens; return the tokens committed. ``adapt``
        false: the draft came from another drafter than the one the adaptive k measures."""
        committed, finish = self.stops.accept(verified)
        self.stats.record(drafted, min(num_accepted, len(committed)))  # nothing past a stop counts
        if self.adaptive is not None and drafted and adapt:
            self.adaptive.update(drafted, num_accepted)
        self.tokens.extend(committed)
        if finish is None and len(self.tokens) >= max_context:
            finish = "length"
        self.finish_reason = finish
        return committed


def new_request(
    request_id: str,
    prompt_ids: list[int],
    params: SamplingParams,
    mode: VerifyMode,
    k_policy: KPolicy,
    eos_token_ids: set[int],
    decode,
) -> RequestState:
    return RequestState(
        id=request_id,
        prompt_ids=list(prompt_ids),
        params=params,
        mode=mode,
        stops=StopChecker(params, eos_token_ids, decode, prompt_tokens=prompt_ids),
        adaptive=k_policy.make(),
        fixed_k=k_policy.k,
    )
