"""The engine end to end (specdec.core.engine.SpecEngine): target-only decoding against speculative
decoding with the acceptance held at a set rate (scripts/fixed_acceptance.py), side by side in one
process, each speculative run's tokens compared with the same engine's at k = 0.

Reported per batch size and rate: tokens/s of both, the measured per-token acceptance a (the
maximum-likelihood estimate over the run's rounds) and cost ratio c (a draft step over a target
step of the k = 0 run at the same batch), the bound tau / (k c + 1) of specdec/core/speedup.py at
those a and c, and the measured speedup's share of it.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, field

from fixed_acceptance import FixedAcceptanceDrafter
from gpu_costs import sync

from specdec.core.engine import KPolicy, SpecEngine
from specdec.core.params import SamplingParams
from specdec.core.speedup import estimate_acceptance, expected_tokens, speedup


def make_prompts(vocab_size: int, count: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(length)] for _ in range(count)]


@dataclass
class EngineRun:
    tokens: list[list[int]]  # generated ids per prompt
    wall_s: float
    verify_s: list[float]  # per round: the batched verify
    rounds: list[tuple[int, int]]  # (drafted, accepted) of every request's every round
    commit_times: list[list[float]] = field(default_factory=list)  # per prompt: when each round committed
    steady: list[bool] = field(default_factory=list)  # per round: its verify cached no prompt tokens

    @property
    def step_s(self) -> float:
        """The mean verify of the rounds that cached no prompt tokens: a target step."""
        times = [t for t, ok in zip(self.verify_s, self.steady) if ok]
        return sum(times) / len(times)

    @property
    def tokens_per_s(self) -> float:
        return sum(map(len, self.tokens)) / self.wall_s

    def round_ms(self, prompt: int = 0) -> float:
        """Mean ms between one prompt's rounds after its first (the first holds its prefill)."""
        times = self.commit_times[prompt]
        return (times[-1] - times[0]) / (len(times) - 1) * 1e3 if len(times) > 1 else float("nan")


def run_engine(target, tokenizer, prompts, max_tokens: int, drafter=None, k: int = 0) -> EngineRun:
    """One engine over ``prompts`` (greedy, no EOS, ``max_tokens`` each), every round timed."""
    engine = SpecEngine(target, tokenizer, drafter, k_policy=KPolicy(k=k), eos_token_ids=set())
    verify_s: list[float] = []
    steady: list[bool] = []
    verify, slots = engine.verifier.verify, engine.verifier.slots

    def timed_verify(items, prefill=()):  # a round's verify: the target step the bound is priced in
        # A prompt's chunks ride in the verify's forward (its last one in its first row): no step.
        prompt = bool(prefill) or any(
            i.request_id not in slots or target.lengths[slots[i.request_id]] < len(i.tokens) - 1 for i in items
        )
        sync()
        t0 = time.perf_counter()
        out = verify(items, prefill)
        sync()
        if items:  # a forward of chunks alone is no round
            verify_s.append(time.perf_counter() - t0)
            steady.append(not prompt)
        return out

    engine.verifier.verify = timed_verify
    ids = [engine.add_request(p, SamplingParams(max_tokens=max_tokens)) for p in prompts]
    commits: dict[str, list[float]] = {rid: [] for rid in ids}
    rounds: list[tuple[int, int]] = []
    sync()
    t0 = time.perf_counter()
    while engine.has_work:
        states = [*engine.waiting, *engine.running]  # a request admitted now may verify this round
        before = {r.id: (r.stats.rounds, r.stats.drafted, r.stats.accepted) for r in states}
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            if out.new_token_ids:
                commits[out.request_id].append(now)
        for r in states:
            n, d, a = before[r.id]
            if r.stats.rounds > n:
                rounds.append((r.stats.drafted - d, r.stats.accepted - a))
    wall = time.perf_counter() - t0
    tokens = [engine.result(i).token_ids for i in ids]
    return EngineRun(tokens, wall, verify_s, rounds, [commits[i] for i in ids], steady)


def acceptance(rounds: list[tuple[int, int]]) -> tuple[float, int]:
    """(a, trials): the maximum-likelihood per-token acceptance over the rounds that drafted, and
    the coins it rests on (accepted tokens + rejections)."""
    drafted = [(d, n) for d, n in rounds if d > 0]
    a = estimate_acceptance([n for _, n in drafted], [d for d, _ in drafted])
    return a, sum(n + (n < d) for d, n in drafted)


def acceptance_checks(rate: float, rounds, drafter: FixedAcceptanceDrafter) -> tuple[dict, list[str]]:
    """The acceptance a run measured against the one it was set to: exactly what the drafter's plan
    says the verifier must accept, and the measured rate within 4 standard deviations (+0.02) of
    the set one."""
    a, trials = acceptance(rounds)
    accepted = sum(n for _, n in rounds)
    tolerance = 4 * math.sqrt(rate * (1 - rate) / max(trials, 1)) + 0.02
    out = {
        "a set": rate,
        "a measured": round(a, 4),
        "coins": trials,
        "tolerance": round(tolerance, 3),
        "accepted": accepted,
        "accepted as planned": drafter.planned_accepted,
    }
    failures = []
    if accepted != drafter.planned_accepted:
        failures.append(f"accepted {accepted} tokens, the drafter's plan says {drafter.planned_accepted}")
    if abs(a - rate) > tolerance:
        failures.append(f"acceptance {a:.3f}, set to {rate} (tolerance {tolerance:.3f})")
    return out, failures


def speculative_row(ref: EngineRun, spec: EngineRun, drafter: FixedAcceptanceDrafter, k: int, rate: float) -> dict:
    """One speculative run beside the k = 0 run at the same batch: speed, a, c, bound, identity."""
    checks, failures = acceptance_checks(rate, spec.rounds, drafter)
    step_s = ref.step_s  # the target step at this batch
    draft_step_s = sum(drafter.draft_seconds) / max(sum(drafter.draft_steps), 1)
    c = draft_step_s / step_s
    a = checks["a measured"]
    bound = speedup(a, c, k)
    measured = spec.tokens_per_s / ref.tokens_per_s
    identical = spec.tokens == ref.tokens
    if not identical:
        first = next(i for i, (x, y) in enumerate(zip(spec.tokens, ref.tokens)) if x != y)
        failures.append(f"prompt {first}: tokens differ from the same engine's at k = 0")
    return {
        **checks,
        "k": k,
        "tokens/s": round(spec.tokens_per_s, 2),
        "speedup": round(measured, 3),
        "c": round(c, 4),
        "draft step ms": round(draft_step_s * 1e3, 3),
        "verify ms": round(spec.step_s * 1e3, 3),
        "verify / target step": round(spec.step_s / step_s, 3),
        "tau": round(expected_tokens(a, k), 3),
        "bound tau/(kc+1)": round(bound, 3),
        "efficiency": round(measured / bound, 3),
        "rounds": len(spec.verify_s),
        "identical to k=0": identical,
        "failures": failures,
    }


NOT_RUN = {"not run": "the run's time budget was spent"}


def engine_e2e(
    pair,
    batches,
    rates,
    k: int,
    prompt_len: int,
    max_tokens: int,
    deadline=math.inf,
    drafter_cls=FixedAcceptanceDrafter,
):
    """``pair``: the target and draft runners and a tokenizer (scripts/gpu_engine.py's ModelPair);
    past ``deadline`` (time.monotonic) what is left is marked not run. ``drafter_cls``: the
    fixed-acceptance drafter (a test passes a broken one)."""
    out: dict = {"k": k, "prompt tokens": prompt_len, "max tokens": max_tokens, "batches": {}, "failures": []}
    prompts = make_prompts(pair.vocab_size, max(batches), prompt_len)
    for b in batches:
        if time.monotonic() > deadline:
            out["batches"][f"b={b}"] = dict(NOT_RUN)
            continue
        batch = prompts[:b]
        warm = run_engine(pair.target, pair.tokenizer, batch, 4)  # kernels, allocator, cuBLAS handles
        plan = list(zip(batch, warm.tokens))
        run_engine(pair.target, pair.tokenizer, batch, 4, drafter_cls(pair.draft, plan, 0.5), k)
        ref = run_engine(pair.target, pair.tokenizer, batch, max_tokens)
        row: dict = {
            "k=0": {
                "tokens/s": round(ref.tokens_per_s, 2),
                "target step ms": round(ref.step_s * 1e3, 3),
                "rounds": len(ref.verify_s),
            }
        }
        plan = list(zip(batch, ref.tokens))
        for i, rate in enumerate(rates):
            if time.monotonic() > deadline:
                row[f"a={rate}"] = dict(NOT_RUN)
                continue
            drafter = drafter_cls(pair.draft, plan, rate, seed=i)
            spec = run_engine(pair.target, pair.tokenizer, batch, max_tokens, drafter, k)
            row[f"a={rate}"] = speculative_row(ref, spec, drafter, k, rate)
            out["failures"] += [f"b={b} a={rate}: {f}" for f in row[f"a={rate}"]["failures"]]
        out["batches"][f"b={b}"] = row
    return out
