"""The calibration that goes through the simulator: the draft prefill's scale.

The drafter prefills a prompt in two ways: a Prefill of the prompt's chunks, sent beside the
target's prefill of the same chunks, and the prompt's tail (a whole prompt that fits one round)
with its first Propose. The time the draft worker reports for the first holds its contention with
the target on a shared device; the simulator adds that contention itself (its processor-sharing
device), so the measured time over the profile's curve would count it twice. Instead the scale is
fitted through the simulation: the bench's own scenarios are simulated, and the scale moved until
the simulated drafter prefills as fast per token as the service's did.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from cluster.config import ServeConfig
from cluster.planning.predict import predict_bench, scenarios_of
from cluster.planning.profile import Profile

__all__ = ["draft_prefill_ms_per_token", "calibrate_draft_prefill", "timed_kinds", "PREFILLS", "PROPOSES"]

_STEPS = 4  # fixed-point steps at most (the stretch moves a little with the scale)
_CLOSE = 0.02  # stop once the simulated time per token is within this of the measured


PREFILLS, PROPOSES = "draft_prefills", "prefilling_proposes"  # the two ways, as the round split names them


def timed_kinds(result: dict[str, Any]) -> tuple[str, ...]:
    """Which ways of prefilling the drafter a bench serve result (or a prediction) timed."""
    splits = [(r.get("summary") or {}).get("split") or {} for r in result.get("results", [])]
    return tuple(kind for kind in (PREFILLS, PROPOSES) if any(s.get(kind) for s in splits))


def draft_prefill_ms_per_token(
    result: dict[str, Any], profile: Profile, kinds: tuple[str, ...] = (PREFILLS, PROPOSES)
) -> float | None:
    """The draft worker's prefill time per token over a bench serve result's (or a prediction's)
    scenarios, from their round splits: its Prefills, and its Proposes that also prefill less
    their draft steps as ``profile`` prices them (``Overhead.propose_ms``), of the ``kinds``
    given; None where none was timed."""
    ms = tokens = 0.0
    for r in result.get("results", []):
        split = (r.get("summary") or {}).get("split") or {}
        calls = split.get(PREFILLS) or 0
        if PREFILLS in kinds and calls and split.get("draft_prefill_tokens"):
            ms += calls * split["draft_prefill_compute_ms"]
            tokens += calls * split["draft_prefill_tokens"]
        calls = split.get(PROPOSES) or 0
        if PROPOSES in kinds and calls and split.get("prefilling_propose_tokens"):
            rows, steps = split["prefilling_propose_rows"], split["prefilling_propose_steps"]
            drafting = profile.overhead.propose_ms(profile.draft_propose, rows, steps) or 0.0
            ms += calls * max(0.0, split["prefilling_propose_compute_ms"] - drafting)
            tokens += calls * split["prefilling_propose_tokens"]
    return ms / tokens if tokens > 0 else None


def calibrate_draft_prefill(
    profile: Profile, serve: ServeConfig, bench: dict[str, Any], colocated: bool = True, draws: int = 4
) -> float | None:
    """The ``draft_prefill_scale`` under which the simulation of ``bench``'s scenarios (its
    requests, modes and seed, on ``serve``'s deployment) has the drafter prefill as fast per token
    as the service did (its Prefills and its Proposes that prefill); None where ``bench`` timed
    neither, or the simulation sends neither. Only the ways the service timed are compared: a way
    the simulation takes where the service did not would pull the fit away from what the service
    measured (before closed loops were staggered, the simulated Prefills of prompts split into
    chunks, 2x stretched by the target's prefill beside them, pulled it to 1.11 where the service's
    own Proposes read 1.2-1.4)."""
    kinds = timed_kinds(bench)
    measured = draft_prefill_ms_per_token(bench, profile, kinds)
    if measured is None or profile.draft_prefill is None:
        return None
    scenarios, opts = scenarios_of(bench)
    trial = copy.deepcopy(profile)
    scale = 1.0
    for _ in range(_STEPS):
        trial.overhead = dataclasses.replace(profile.overhead, draft_prefill_scale=scale)
        pred = predict_bench(
            trial,
            serve,
            scenarios,
            opts.get("requests", 8),
            opts.get("max_tokens", 128),
            tuple(opts.get("modes", ("auto", "off"))),
            opts.get("seed", 0),
            colocated,
            draws,
        )
        simulated = draft_prefill_ms_per_token(pred, trial, kinds)
        if simulated is None or simulated <= 0:
            return None
        ratio = measured / simulated
        scale *= ratio
        if abs(ratio - 1.0) <= _CLOSE:
            break
    return round(scale, 3)
