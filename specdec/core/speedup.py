"""Speculative-decoding speed model (docs/design.md, Speed).

Units: time is measured in target steps (one memory-bound target forward ~ one verify of k+1
tokens); ``c`` = draft step time / target step time; ``a`` = per-token acceptance probability
under the usual i.i.d. model (each draft token is accepted with probability a, independently,
until the first rejection).  All speedups are relative to plain target-only decoding.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = [
    "expected_tokens",
    "speedup",
    "best_k",
    "pipelined_speedup",
    "predraft_speedup",
    "goodput",
    "estimate_acceptance",
    "acceptance_mle",
]


def _check(a: float, k: int, c: float | None = None) -> None:
    if not 0.0 <= a <= 1.0:
        raise ValueError(f"acceptance a must be in [0, 1] (got {a})")
    if k < 0:
        raise ValueError(f"k must be >= 0 (got {k})")
    if c is not None and c < 0:
        raise ValueError(f"cost ratio c must be >= 0 (got {c})")


def _tau(a: float, k: int) -> float:
    if a >= 1.0:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


def expected_tokens(a: float, k: int) -> float:
    """tau(k) = E[tokens per round] = 1 + a + ... + a^k = (1 - a^(k+1)) / (1 - a); k + 1 at a = 1."""
    _check(a, k)
    return _tau(a, k)


def speedup(a: float, c: float, k: int) -> float:
    """Sequential speculative decoding: S = tau(k) / (k c + 1) (Leviathan et al. 2023).

    A round costs k draft steps plus one verify (~ one target step) and yields tau(k) tokens.
    """
    _check(a, k, c)
    return expected_tokens(a, k) / (k * c + 1.0)


def best_k(a: float, c: float, k_max: int, k_min: int = 0) -> int:
    """The k in [k_min, k_max] maximising :func:`speedup` (the smallest such k on ties): each
    request's k, through :class:`specdec.core.adaptive_k.AdaptiveK`, in the engine and in the
    router (whose depth decision, router/draft_depth.py, bounds it per target)."""
    if k_min < 0 or k_max < k_min:
        raise ValueError(f"need 0 <= k_min <= k_max (got {k_min}, {k_max})")
    best, best_s = k_min, speedup(a, c, k_min)  # checks a and c once: the loop runs per request and round
    for k in range(k_min + 1, k_max + 1):
        s = _tau(a, k) / (k * c + 1.0)
        if s > best_s * (1.0 + 1e-12):
            best, best_s = k, s
    return best


def pipelined_speedup(a: float, c: float, k: int, *, hit_rate: float = 1.0) -> float:
    """Speedup when the next round's draft is produced while the target verifies this one.

    Derivation.  The target verifies round r (time 1) while the drafter drafts round r+1 (time
    k c).  If that draft turns out usable (probability ``hit_rate``), round r+1 can start as soon
    as both are done: time max(1, k c).  Otherwise the drafter must redraft after the verify
    result is known, and the drafting is back on the critical path: time 1 + k c.  Each round
    still yields tau(k) tokens on average, so

        S = tau(k) / (h max(1, k c) + (1 - h)(1 + k c)).

    With h = 1 (the default) this is the bound tau(k) / max(1, k c): drafting entirely off the
    critical path (e.g. two micro-batches alternating between the pools, each sequence compared
    with its own target-only decoding).  With h = 0 it reduces to :func:`speedup`.
    """
    _check(a, k, c)
    if not 0.0 <= hit_rate <= 1.0:
        raise ValueError(f"hit_rate must be in [0, 1] (got {hit_rate})")
    t = hit_rate * max(1.0, k * c) + (1.0 - hit_rate) * (1.0 + k * c)
    return expected_tokens(a, k) / t


def predraft_speedup(a: float, c: float, k: int) -> float:
    """:func:`pipelined_speedup` for pre-drafting on the all-accepted guess (as in PEARL).

    The pre-draft for round r+1 assumes all k tokens of round r are accepted *and* that the
    target's bonus token equals the drafter's own next token; under the i.i.d. model that has
    probability a^(k+1), which is used as the hit rate.
    """
    _check(a, k, c)
    return pipelined_speedup(a, c, k, hit_rate=a ** (k + 1))


def goodput(a: float, k: int, batch_size: int, step_time: Callable[[int], float]) -> float:
    """Tokens per second for a batch: B tau(k) / T_step(B (k + 1)).

    ``step_time(n_tokens)`` is the measured target step time for a forward over n tokens in total
    (flat while memory-bound, growing once compute-bound — which is why k must shrink with load).
    Draft time is assumed off the critical path here.
    """
    _check(a, k)
    return batch_size * expected_tokens(a, k) / step_time(batch_size * (k + 1))


def acceptance_mle(accepted: float, rejections: float) -> float | None:
    """a = N / (N + R) from N accepted draft tokens and R observed rejections (None if no data)."""
    if accepted < 0 or rejections < 0:
        raise ValueError("counts must be >= 0")
    if accepted + rejections <= 0:
        return None
    return accepted / (accepted + rejections)


def estimate_acceptance(
    accepted_per_round: Sequence[int], k_per_round: Sequence[int], *, default: float = 0.0
) -> float:
    """Maximum-likelihood a from observed rounds under the truncated-geometric model.

    A round with k drafts accepts n tokens with P(n) = a^n (1 - a) for n < k and a^k for n = k,
    so log L = N log a + R log(1 - a) with N = sum of n and R = number of rounds that ended in a
    rejection (n < k).  Hence a = N / (N + R).  (The simple ratio N / sum(k) is biased low: draft
    tokens after a rejection are never tested.)  Rounds with k = 0 carry no information; with no
    information at all ``default`` is returned.
    """
    if len(accepted_per_round) != len(k_per_round):
        raise ValueError("accepted_per_round and k_per_round must have the same length")
    n_acc = 0
    n_rej = 0
    for n, k in zip(accepted_per_round, k_per_round):
        if not 0 <= n <= k:
            raise ValueError(f"accepted count {n} outside [0, k={k}]")
        n_acc += n
        n_rej += n < k
    a = acceptance_mle(n_acc, n_rej)
    return default if a is None else a
