"""Request id -> KV slot, with least-recently-used eviction.

Worker caches are caches (docs/design.md, invariant 1): when every slot is taken, the slot of the
request idle the longest may be reused, because a request that comes back brings its committed
tokens and its cache is rebuilt from them. So a router that died without releasing its requests
cannot leave a worker full for good.

Whatever else a worker keeps per request (a sampling generator, a drafter's guess budget) lives
and dies with the slot: the owner passes ``on_free``, called with the request id whenever its
slot is freed — released, evicted or cancelled alike — so no map keyed by request id outgrows
the slots.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Collection

from specdec.core.runner import ModelRunner, SlotsExhausted

log = logging.getLogger(__name__)


class SlotTable:
    def __init__(self, runner: ModelRunner, on_free: Callable[[str], None] | None = None):
        self.runner = runner
        self.on_free = on_free
        self._slots: OrderedDict[str, int] = OrderedDict()  # oldest use first
        self.evicted = 0  # caches evicted to place a new request (WorkerInfo.evicted)

    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._slots

    def __getitem__(self, request_id: str) -> int:
        return self._slots[request_id]

    @property
    def free(self) -> int:
        return self.runner.free_slots

    def get(self, request_id: str, busy: Collection[str] = ()) -> tuple[int, bool]:
        """The request's slot (marked as just used) and whether it is new; evicts the least recently
        used request outside `busy` when no slot is free."""
        if request_id in self._slots:
            self._slots.move_to_end(request_id)
            return self._slots[request_id], False
        if self.runner.free_slots == 0:
            victim = next((rid for rid in self._slots if rid not in busy and rid != request_id), None)
            if victim is None:
                raise SlotsExhausted(f"all {self.runner.num_slots} KV-cache slots are in use by this batch")
            log.debug("evicting the idle cache of %s for %s", victim, request_id)
            self.release(victim)
            self.evicted += 1
        self._slots[request_id] = self.runner.alloc_slot()
        return self._slots[request_id], True

    def release(self, request_id: str) -> bool:
        """Free the request's slot and, through ``on_free``, its other state (also when it has no
        slot: state made before a slot was placed must not outlive the call)."""
        slot = self._slots.pop(request_id, None)
        if self.on_free is not None:
            self.on_free(request_id)
        if slot is None:
            return False
        self.runner.free_slot(slot)
        return True

    def evictable(self, busy: Collection[str]) -> int:
        """How many new requests a batch touching `busy` could place (free + idle slots)."""
        return self.runner.free_slots + sum(1 for rid in self._slots if rid not in busy)
