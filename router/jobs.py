"""A request as the router's scheduler holds it (:class:`Job`), and what it streams back (:class:`Chunk`)."""

from __future__ import annotations

import asyncio
import itertools
import math
from dataclasses import dataclass, field
from typing import Any

import grpc

from router.clock import now
from specdec.core.params import SamplingParams, VerifyMode
from specdec.core.request_state import RequestState
from specdec.rpc.errors import RpcStatusError

__all__ = ["Chunk", "Job", "PreDraft", "QueueFull", "next_job_key"]

_ids = itertools.count()


def next_job_key(request_id: str) -> str:
    """A worker cache key unique within this router (request ids from clients need not be)."""
    return f"{request_id or 'req'}#{next(_ids)}"


class QueueFull(RpcStatusError):
    def __init__(self, message: str) -> None:
        super().__init__(grpc.StatusCode.RESOURCE_EXHAUSTED, message)


@dataclass
class Chunk:
    """What a round committed for one job; the last one has ``finish_reason`` set."""

    token_ids: list[int]
    text: str
    finish_reason: str | None = None


@dataclass
class PreDraft:
    drafter: str  # the draft worker computing it
    base: int  # len(tokens) + len(draft) the pre-draft continued from
    draft: list[int]  # the draft it assumed accepted
    task: asyncio.Task  # -> list[worker_pb2.Draft]
    index: int  # this job's position in the task's result


@dataclass(eq=False)
class Job:
    key: str  # worker cache key (unique per router)
    request_id: str  # the caller's id (echoed)
    state: RequestState
    spec: str  # off | draft | ngram (resolved)
    auto: bool
    deadline: float | None  # deadline on the router clock (router/clock.py)
    # Who sent it (router.client_limit.client_key): slots and prefill budget are shared across clients.
    client: str = ""
    t_arrival: float = field(default_factory=now)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    t_first: float | None = None
    t_last: float | None = None
    emitted: int = 0  # characters of text sent
    in_flight: bool = False
    cancelled: str | None = None  # "cancelled" | "deadline" | "shutdown" while a round is in flight
    done: bool = False
    outcome: str | None = None
    predraft: PreDraft | None = None
    # Drafting (router/drafter_pool.py): where its drafts come from now, when it last moved, the
    # drafter it just left, and every drafter that may hold a KV slot for it (all released at the end).
    drafter: str | None = None
    drafter_at: float | None = None
    moved_from: str | None = None
    drafters: set[str] = field(default_factory=set)
    # Tokens of it each drafter was sent (a Propose carrying many more catches a drafter up: its
    # time says nothing of a draft step).
    draft_fed: dict[str, int] = field(default_factory=dict)
    # Speculation switched off by the rebalancer's goodput rule (AUTO requests), when it last
    # changed, and whether its starting state was planned (router/target_balance.py:start).
    spec_off: bool = False
    spec_changed_at: float = -math.inf
    spec_planned: bool = False
    # AUTO requests: whether the router's n-gram drafts for it, in place of its draft model or of
    # plain decoding (router/ngram_fallback.py), when that last changed, how its n-gram guesses
    # fared (decayed (accepted, rejections)), and this round's guess, scored once the target has verified.
    ngram_on: bool = False
    ngram_changed_at: float = -math.inf
    ngram_evidence: tuple[float, float] = (0.0, 0.0)
    ngram_guess: list[int] | None = None
    span: Any = None  # the request's span while tracing is on (router/traces.py): its rounds' parent
    # The target process (TargetLink.process) holding its KV cache; None while nothing is cached.
    cached_on: int | None = None

    @property
    def params(self) -> SamplingParams:
        return self.state.params

    @property
    def mode(self) -> VerifyMode:
        return self.state.mode

    @property
    def source(self) -> str:
        """Where this round's draft comes from: off, draft (a draft worker) or ngram (the router's
        own drafter, as the request's mode or chosen for an AUTO request)."""
        return "ngram" if self.ngram_on else self.spec

    def fed_to(self, drafter: str) -> int:
        """Tokens of it ``drafter`` was sent (and holds, while it keeps the slot)."""
        return self.draft_fed.get(drafter, 0)

    def cache_again(self) -> None:
        """Its KV cache on the target is gone (it was preempted, or the target restarted): its
        committed tokens are cached again in chunks within the rounds' budget before its next
        verify, as a prompt is (``RequestState.refill``; docs/design.md, "Recovery")."""
        st = self.state
        st.refill, st.prefilled = len(st.tokens) - 1, 0
        self.cached_on, self.predraft = None, None
