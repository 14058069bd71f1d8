"""Preemption: a client below its fair share of KV slots takes one from a client above it.

Fair admission (router/batching.py, `next_admission`) gives free slots to the client holding the
fewest, but a client that came alone holds every slot, and a newcomer would wait for one of its
requests to finish: 93 s behind eight 4,000-token prompts on this machine. So while a waiting
client holds fewer than its share (the slots over the clients present, rounded down) and another
holds more than its share (rounded up), one of that client's requests gives its slot up, between
rounds (docs/design.md, "Scheduling"). It loses only its caches: its committed tokens are the truth
(invariant 1), it waits again in the queue, and when it gets a slot back it caches its tokens again
in chunks within the round's budget, as a prompt is (`RequestState.refill`). The one given up is the
cheapest to redo: the one with the fewest tokens cached, the last admitted among equals.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

from router.jobs import Job

__all__ = ["victim", "requeue"]


def victim(waiting: Sequence[str], running: Sequence[Job], capacity: int) -> Job | None:
    """The running request to preempt for the waiting clients, or None. ``waiting``: the clients
    of the queued requests; only requests between rounds (not in flight) can be preempted."""
    held = Counter(j.client for j in running)
    clients = set(waiting) | set(held)
    if len(running) < capacity or len(clients) < 2:
        return None
    floor_share, ceil_share = capacity // len(clients), math.ceil(capacity / len(clients))
    if not any(held[c] < floor_share for c in set(waiting)):
        return None
    rich = [j for j in running if held[j.client] > ceil_share and not j.in_flight and not j.done]
    if not rich:
        return None
    most = max(held[j.client] for j in rich)
    # The running set is in admission order: at equal progress, the last admitted gives its slot up.
    return min((j for j in reversed(rich) if held[j.client] == most), key=_cached)


def _cached(job: Job) -> int:
    st = job.state
    return st.prefilled if st.prefilling else len(st.tokens)


def requeue(job: Job) -> None:
    """Make a preempted job start over from its committed tokens: no caches anywhere, its tokens
    cached again in chunks before its next verify."""
    job.cache_again()
    job.drafter, job.moved_from = None, None
    job.draft_fed.clear()
    job.drafters.clear()
