"""The router's scheduling decisions as plain functions: what the scheduler does, and what the
capacity simulator (``cluster/planning``) runs unchanged (DESIGN.md: one policy, run by the
service and by the planner).

No asyncio, grpc or torch here: each function takes the few numbers the decision depends on.
The chunked-prefill plan is :func:`specdec.core.prefill_plan.plan_prefill` (shared with the
engine); the per-request draft length is :meth:`specdec.core.request_state.RequestState.next_k`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from router.config import RouterConfig
from specdec.core.request_state import CostMeter, KPolicy, RequestState

__all__ = [
    "batch_capacity",
    "resolve_spec",
    "request_k_policy",
    "can_admit",
    "lane_share",
    "want_k",
    "policy_k",
    "draft_deadline",
    "least_loaded",
    "predraft_k",
]


def batch_capacity(target_slots: int, max_batch: int, draft_slots: int | None = None) -> int:
    """Requests decoded together on one target: its KV slots, ``max_batch`` (0 = the slots), and the
    draft worker's slots when there is one."""
    cap = min(target_slots, max_batch or target_slots)
    return cap if draft_slots is None else min(cap, draft_slots)


def resolve_spec(spec: str, default_mode: str, has_draft: bool) -> tuple[str, bool]:
    """(resolved mode, auto): "auto" means ``default_mode`` ("draft" falls back to the router's
    n-gram drafter when the deployment has no draft worker)."""
    if spec != "auto":
        return spec, False
    spec = default_mode
    if spec == "draft" and not has_draft:
        spec = "ngram"
    return spec, True


def request_k_policy(spec: str, k: int | None, policy: KPolicy) -> KPolicy:
    """A request's k policy: none when off, its own fixed ``k`` (capped at k_max) when it asks, else
    the router's."""
    if spec == "off":
        return KPolicy(k=0)
    if k is not None:
        return KPolicy(k=min(k, policy.k_max), adaptive=False)
    return policy


def can_admit(running: int, capacity: int, closing: bool = False) -> bool:
    """A waiting request joins the running batch while there is a free slot (continuous batching)."""
    return running < capacity and not closing


def lane_share(running: int, lane: int, micro_batches: int, split_min_batch: int) -> int:
    """How many ready requests lane ``lane`` takes for its round (0: this lane sits out). Below
    ``split_min_batch`` running requests there is one batch; from it on, ``micro_batches`` lanes
    take a share each."""
    lanes = micro_batches if running >= split_min_batch else 1
    if lane >= lanes:
        return 0
    return math.ceil(running / lanes)


def want_k(
    spec: str,
    auto: bool,
    running: int,
    auto_off_batch: int,
    state: RequestState,
    max_context: int,
    cost: CostMeter,
    cost_scale: float = 1.0,
    k_range: tuple[int, int] | None = None,
) -> int:
    """Draft tokens for a request's next round: none when off, none for AUTO requests while more
    than ``auto_off_batch`` requests run (the goodput gate: batched verification turns
    compute-bound), else the request's k policy with the measured cost of a draft token (model
    drafts only; n-gram drafts cost the router next to nothing), scaled and bounded by the
    rebalancer's depth plan for the target's device load (``cost_scale``, ``k_range``)."""
    if spec == "off":
        return 0
    if auto and auto_off_batch and running > auto_off_batch:
        return 0
    return state.next_k(max_context, cost.per_token * cost_scale if spec == "draft" else None, k_range)


def policy_k(state: RequestState) -> int:
    """The k a request's policy would choose now, before the bounds of its remaining tokens and the
    context (what a pre-draft is sized by)."""
    return state.adaptive.next_k() if state.adaptive is not None else state.fixed_k


def least_loaded(loads: Sequence[tuple]) -> int:
    """Index of the target a new request goes to: the smallest load key (first on ties)."""
    return min(range(len(loads)), key=loads.__getitem__)


def draft_deadline(cfg: RouterConfig, verify_ema: float | None, k: int) -> float:
    """How long a round waits for its drafts: ``draft_deadline_factor`` x (k + 1) recent verify
    times (a draft slower than that cannot pay for itself), within [draft_deadline_min_s,
    draft_deadline_s]; ``draft_deadline_s`` until a verify time has been measured. A later draft
    fails open (the round verifies with k = 0)."""
    cap = cfg.draft_deadline_s
    if verify_ema is None or cfg.draft_deadline_factor <= 0:
        return cap
    return min(cap, max(cfg.draft_deadline_min_s, cfg.draft_deadline_factor * (k + 1) * verify_ema))


def predraft_k(
    policy_k: int, generated: int, k: int, max_tokens: int, tokens: int, max_context: int, room: int | None = None
) -> int:
    """Length of the pre-draft for round r+1, drafted while round r (``k`` draft tokens) verifies on
    the guess that all of it is accepted plus the target's bonus token (0: no pre-draft). It drafts
    that guess and its own tokens, so it runs its length + 1 steps: at most ``room``
    (:func:`router.rebalance.predraft_room`; None: no bound)."""
    remaining = max_tokens - (generated + k + 1) - 1
    fit = policy_k if room is None else room - 1
    return max(0, min(policy_k, fit, remaining, max_context - (tokens + k + 1)))
