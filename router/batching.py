"""How a target's requests are admitted and batched, and how long a round waits for its drafts.

Reads: the target's KV slots, the drafter's when static pairing bounds the batch, ``max_batch``,
the running count, the clients of the queued and running requests and ``fair_share``,
``micro_batches`` / ``split_min_batch``, a request's asked mode and k, ``default_mode``, the
router's ``k_policy``, the measured verify time and the draft deadline knobs
(``draft_deadline_s`` / ``draft_deadline_factor`` / ``draft_deadline_min_s``), all of
:class:`router.config.RouterConfig`.
Decides: the batch capacity (:func:`batch_capacity`), whether a waiting request joins the batch
(:func:`can_admit`) and which one (:func:`next_admission`), each lane's share of a round
(:func:`lane_share`), a request's resolved mode (:func:`resolve_spec`) and k policy
(:func:`request_k_policy`), and the draft deadline (:func:`draft_deadline`).

Plain functions: no asyncio, grpc or torch; router/scheduler.py and router/drafting.py apply
them. The chunked-prefill plan, and its share of each round's budget per client, is
:func:`specdec.core.prefill_plan.plan_prefill` (shared with the engine); a request's draft length
is router/draft_depth.py's.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence

from router.config import RouterConfig
from specdec.core.request_state import KPolicy

__all__ = [
    "batch_capacity",
    "resolve_spec",
    "request_k_policy",
    "can_admit",
    "next_admission",
    "lane_share",
    "draft_deadline",
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


def next_admission(
    waiting: Sequence[str],
    running: Sequence[str],
    fair_share: bool = True,
    last_admitted: Mapping[str, int] | None = None,
) -> int:
    """Which queued request takes the next free slot: an index into ``waiting``, the clients of the
    queued requests in arrival order (``running``: those of the running ones; ``last_admitted``:
    when each client last got a slot, as an increasing count).

    Fair share: the oldest request of the client with the fewest requests running; among clients
    with as many, the one that got a slot least recently (never first), then the one whose oldest
    request came first. Slots then go round robin across the waiting clients, and a client holding
    its share (ceil(slots / clients)) or more never takes a slot while one below it waits. A
    client alone takes every free slot (nothing is held back), and a client's own requests keep
    their order. Without fair share: the oldest request (FIFO), where one client's queued burst
    holds off everyone who came after it."""
    if not fair_share:
        return 0
    held = Counter(running)
    last = last_admitted or {}
    turn = {c: (held[c], last.get(c, -1)) for c in waiting}
    best = 0
    for i, client in enumerate(waiting):
        if turn[client] < turn[waiting[best]]:
            best = i
    return best


def lane_share(running: int, lane: int, micro_batches: int, split_min_batch: int) -> int:
    """How many ready requests lane ``lane`` takes for its round (0: this lane sits out). Below
    ``split_min_batch`` running requests there is one batch; from it on, ``micro_batches`` lanes
    take a share each."""
    lanes = micro_batches if running >= split_min_batch else 1
    if lane >= lanes:
        return 0
    return math.ceil(running / lanes)


def draft_deadline(cfg: RouterConfig, verify_ema: float | None, k: int) -> float:
    """How long a round waits for its drafts: ``draft_deadline_factor`` x (k + 1) recent verify
    times (a draft slower than that cannot pay for itself), within [draft_deadline_min_s,
    draft_deadline_s]; ``draft_deadline_s`` until a verify time has been measured. A later draft
    fails open (the round verifies with k = 0)."""
    cap = cfg.draft_deadline_s
    if verify_ema is None or cfg.draft_deadline_factor <= 0:
        return cap
    return min(cap, max(cfg.draft_deadline_min_s, cfg.draft_deadline_factor * (k + 1) * verify_ema))
