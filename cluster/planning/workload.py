"""What the simulator is fed: requests (arrival time, prompt and output lengths) and how their
drafts are accepted.

Arrivals: Poisson at a rate (the same generator as `specdec bench serve`, so a prediction of a run
sees the run's own arrival times) or a trace file. Lengths: fixed, uniform, normal, or the
profile's own prompts. Acceptance: per draft position, the chance that the drafter proposes one
more token and that the target accepts it, each request with its own curve when it comes from the
profile (copy-heavy prompts accept more than new code), or one i.i.d. rate a.
"""

from __future__ import annotations

import csv
import json
import random
from dataclasses import dataclass, field
from pathlib import Path

from cluster.planning.profile import DrafterStats, Profile, merge_rounds
from specdec.bench.serve import poisson_arrivals

__all__ = [
    "WorkloadError",
    "AcceptanceModel",
    "SimRequestSpec",
    "LengthDist",
    "parse_lengths",
    "poisson_requests",
    "load_trace",
    "acceptance_pool",
]


class WorkloadError(ValueError):
    """A workload that cannot be simulated; the message says what to fix."""


@dataclass
class AcceptanceModel:
    """P(one more draft token is proposed | position j reached) and P(it is accepted | proposed),
    per position j = 0, 1, ...; past the last position the last value holds."""

    draft_p: list[float]
    accept_p: list[float]
    first: AcceptanceModel | None = None  # a request's first round, where it differs (None: as the rest)

    @classmethod
    def iid(cls, a: float) -> AcceptanceModel:
        if not 0.0 <= a <= 1.0:
            raise WorkloadError(f"acceptance must be in [0, 1] (got {a})")
        return cls([1.0], [a])

    @classmethod
    def from_rounds(cls, rows: list[list[int]], prior: AcceptanceModel | None = None, weight: float = 4.0):
        """Estimates from rounds [k, drafted, accepted, count]; each position's ratio is pulled toward
        ``prior`` with ``weight`` pseudo-rounds (positions seen rarely follow the prior)."""
        top = max((r[0] for r in rows), default=0)
        draft_p, accept_p = [], []
        for j in range(max(top, 1)):
            reach = sum(n for k, d, a, n in rows if d >= j and k > j)
            more = sum(n for k, d, a, n in rows if d > j and k > j)
            tested = sum(n for k, d, a, n in rows if a >= j and d > j)
            passed = sum(n for k, d, a, n in rows if a > j)
            pd = prior.at(prior.draft_p, j) if prior else 1.0
            pa = prior.at(prior.accept_p, j) if prior else 0.5
            w = weight if prior else 1.0
            draft_p.append((more + w * pd) / (reach + w))
            accept_p.append((passed + w * pa) / (tested + w))
        return cls(draft_p, accept_p)

    @staticmethod
    def at(values: list[float], j: int) -> float:
        return values[min(j, len(values) - 1)]

    def sample(self, k: int, rng: random.Random, position: int = 0) -> tuple[int, int, bool]:
        """(tokens drafted, tokens accepted, whether the drafter's next token would match the
        target's bonus token too: a pre-draft on the all-accepted guess is then usable). Drawn
        alike at every output ``position`` (a greedy path's is not: greedy_path.py)."""
        drafted = 0
        while drafted < k and rng.random() < self.at(self.draft_p, drafted):
            drafted += 1
        accepted = 0
        while accepted < drafted and rng.random() < self.at(self.accept_p, accepted):
            accepted += 1
        bonus = accepted == drafted and rng.random() < self.at(self.accept_p, drafted)
        return drafted, accepted, bonus


@dataclass
class SimRequestSpec:
    t: float  # arrival, seconds from the start
    prompt_tokens: int
    output_tokens: int  # the request ends after this many tokens
    # by drafter, "draft" and "ngram": an AcceptanceModel, or a GreedyPath (greedy_path.py; same sample())
    acceptance: dict[str, AcceptanceModel] = field(default_factory=dict)
    id: str = ""


@dataclass
class LengthDist:
    kind: str  # fixed | uniform | normal | profile
    a: float = 0.0
    b: float = 0.0
    values: list[int] = field(default_factory=list)

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return int(self.a)
        if self.kind == "uniform":
            return rng.randint(int(self.a), int(self.b))
        if self.kind == "normal":
            return max(1, round(rng.gauss(self.a, self.b)))
        return rng.choice(self.values)

    @property
    def mean(self) -> float:
        if self.kind == "fixed":
            return self.a
        if self.kind in ("uniform", "normal"):
            return (self.a + self.b) / 2 if self.kind == "uniform" else self.a
        return sum(self.values) / len(self.values)


def parse_lengths(spec: str, profile_values: list[int] | None = None) -> LengthDist:
    """``N`` | ``uniform:A:B`` | ``normal:MEAN:SD`` | ``profile`` (the profile's own prompts)."""
    parts = str(spec).split(":")
    try:
        if len(parts) == 1 and parts[0] != "profile":
            n = int(parts[0])
            if n < 1:
                raise ValueError
            return LengthDist("fixed", n)
        if parts[0] == "uniform" and len(parts) == 3 and 1 <= int(parts[1]) <= int(parts[2]):
            return LengthDist("uniform", int(parts[1]), int(parts[2]))
        if parts[0] == "normal" and len(parts) == 3 and float(parts[1]) >= 1 and float(parts[2]) >= 0:
            return LengthDist("normal", float(parts[1]), float(parts[2]))
    except ValueError:
        pass
    if parts == ["profile"]:
        if not profile_values:
            raise WorkloadError("lengths 'profile' need a profile with an acceptance run (--profile)")
        return LengthDist("profile", values=list(profile_values))
    raise WorkloadError(f"{spec!r}: lengths are N, uniform:A:B, normal:MEAN:SD or profile (N >= 1)")


def _without(rows: list[list[int]], first: list[int]) -> list[list[int]]:
    """``rows`` less one round ``first`` ([k, drafted, accepted])."""
    out, left = [], bool(first)
    for k, d, a, n in rows:
        if left and [k, d, a] == first:
            n, left = n - 1, False
        if n > 0:
            out.append([k, d, a, n])
    return out


def acceptance_pool(stats: DrafterStats) -> list[AcceptanceModel]:
    """One model per profiled request, each pulled toward the pooled one (few rounds: mostly pooled).
    Where the profile recorded each request's first round, the first rounds get a model of their own
    (pooled over the requests: one round each) and the other models leave them out: a first draft
    that fails at once (an n-gram proposing from the prompt's tail) is not spread over every round,
    and the adaptive k starts from it as the service's does."""
    firsts = [r.first for r in stats.requests if r.first]
    if len(firsts) < len(stats.requests):  # not recorded (an older profile): every round alike
        pooled = AcceptanceModel.from_rounds(stats.pooled())
        return [AcceptanceModel.from_rounds(r.rounds, prior=pooled) for r in stats.requests]
    rest = [_without(r.rounds, r.first) for r in stats.requests]
    pooled = AcceptanceModel.from_rounds(merge_rounds(rest))
    first = AcceptanceModel.from_rounds([[k, d, a, 1] for k, d, a in firsts], prior=pooled, weight=1.0)
    models = [AcceptanceModel.from_rounds(rows, prior=pooled) for rows in rest]
    for m in models:
        m.first = first
    return models


def poisson_requests(
    n: int,
    rate: float,
    prompt: LengthDist,
    output: LengthDist,
    acceptance: dict[str, list[AcceptanceModel]],
    seed: int = 0,
) -> list[SimRequestSpec]:
    """``n`` Poisson arrivals at ``rate``/s; each request draws its lengths and, per drafter, one of
    the acceptance models given (a profiled request's, or the one i.i.d. model)."""
    if rate <= 0 or n < 1:
        raise WorkloadError("a Poisson workload needs rate > 0 and at least one request")
    rng = random.Random(seed + 1)
    return [
        SimRequestSpec(
            t=t,
            prompt_tokens=prompt.sample(rng),
            output_tokens=output.sample(rng),
            acceptance={name: rng.choice(models) for name, models in acceptance.items() if models},
            id=f"r{i}",
        )
        for i, t in enumerate(poisson_arrivals(n, rate, seed))
    ]


def load_trace(path: str | Path, acceptance: dict[str, list[AcceptanceModel]], seed: int = 0) -> list[SimRequestSpec]:
    """A trace: JSONL or CSV rows with ``t`` (seconds, or ``timestamp``), ``prompt_tokens`` and
    ``output_tokens``; arrival times are taken relative to the first."""
    path = Path(path)
    if not path.is_file():
        raise WorkloadError(f"{path}: no such trace file")
    text = path.read_text()
    if path.suffix == ".csv":
        rows = list(csv.DictReader(text.splitlines()))
    else:
        try:
            rows = [json.loads(line) for line in text.splitlines() if line.strip()]
        except json.JSONDecodeError as exc:
            raise WorkloadError(f"{path}: not JSONL ({exc.msg})") from None
    rng = random.Random(seed)
    out = []
    for i, row in enumerate(rows, 1):
        try:
            t = float(row.get("t", row.get("timestamp")))
            p, o = int(row["prompt_tokens"]), int(row["output_tokens"])
        except (KeyError, TypeError, ValueError):
            raise WorkloadError(f"{path}: row {i} needs t (or timestamp), prompt_tokens and output_tokens") from None
        if p < 1 or o < 1:
            raise WorkloadError(f"{path}: row {i}: prompt_tokens and output_tokens must be >= 1")
        acc = {name: rng.choice(models) for name, models in acceptance.items() if models}
        out.append(SimRequestSpec(t, p, o, acc, str(row.get("id", f"t{i}"))))
    if not out:
        raise WorkloadError(f"{path}: an empty trace")
    t0 = min(r.t for r in out)
    for r in out:
        r.t -= t0
    return sorted(out, key=lambda r: r.t)


def profile_lengths(profile: Profile, drafter: str = "draft") -> tuple[list[int], list[int]]:
    """Prompt and output lengths of the profile's acceptance run."""
    stats = profile.drafters.get(drafter) or next(iter(profile.drafters.values()), None)
    if stats is None:
        return [], []
    return [r.prompt_tokens for r in stats.requests], [r.output_tokens for r in stats.requests]
