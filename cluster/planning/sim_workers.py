"""Simulated draft and target workers, as the router's own code sees them.

:class:`SimWorker` answers the calls the router makes on a ``router.workers.WorkerClient``
(``call_timed`` of Verify, Prefill, Propose and Release; ``stub.Info`` for telemetry) with real
protobuf messages, after their cost (:mod:`cluster.planning.costs`) has run on a simulated device
(:mod:`cluster.planning.devices`). The worker's compute time comes back as the real worker reports
it, so the router's cost meters measure the simulated devices as they measure real ones.

What the target accepts comes from each request's acceptance model (:class:`Outcomes`), not from
token values. Token ids are placeholders chosen so that the router's own checks read the sampled
outcome: a prompt is its request's index followed by zeros, every draft token is 0, and the
target's last token is 0 exactly when the drafter's next token would have matched it too (a
pre-draft on the all-accepted guess is then usable), 1 otherwise. Where the deployment drafts token
trees, a tree node's token is its rank among its siblings and the target's walk of the tree is
drawn by depth and rank (:mod:`cluster.planning.sim_trees`).
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from cluster.planning.costs import Costs
from cluster.planning.devices import Call, Device, Worker
from cluster.planning.sim_trees import (
    SimTrees,
    TreeTally,
    accept_path,
    chain_expected,
    draft_tree,
    expected_accepted,
)
from cluster.planning.workload import SimRequestSpec
from router.jobs import Job
from router.target_link import TargetLink
from specdec.core.round_types import Draft
from specdec.rpc import generate_pb2, worker_pb2
from specdec.rpc.convert import draft_to_proto

__all__ = ["MATCH", "MISS", "VOCAB", "Outcomes", "SimNgram", "SimTargetLink", "SimVerifyRequest", "SimWorker"]

VOCAB = 1 << 30  # token ids carry request indices (a prompt's first token)
MATCH, MISS = 0, 1  # a draft token / a target token the drafter would not have guessed


@dataclass
class _Request:
    spec: SimRequestSpec
    drafter: str  # "draft" | "ngram": whose acceptance model applies
    index: int  # its prompt's first token


class Outcomes:
    """Per request, what its drafter proposes and the target accepts each round: drawn from its
    acceptance model (a request's first round from the model's first-round part where it has one)
    with the simulation's random stream. ``trees``: the draft model drafts token trees of that shape
    (for the requests the draft worker drafts them for); None: chains."""

    def __init__(self, rng: random.Random, trees: SimTrees | None = None):
        self.rng = rng
        self.trees = trees
        self.tally = TreeTally()
        self._by_key: dict[str, _Request] = {}
        self._by_index: dict[int, str] = {}
        self._pending: dict[str, tuple[int, int, bool]] = {}  # an n-gram draft's drawn outcome

    def add(self, index: int, key: str, spec: SimRequestSpec, drafter: str) -> None:
        self._by_key[key] = _Request(spec, drafter, index)
        self._by_index[index] = key

    def forget(self, key: str) -> None:
        r = self._by_key.pop(key, None)
        if r is not None:
            self._by_index.pop(r.index, None)
        self._pending.pop(key, None)

    def _model(self, key: str, tokens: int):  # noqa: ANN202 - an AcceptanceModel or a GreedyPath
        r = self._by_key[key]
        model = r.spec.acceptance[r.drafter]
        if model.first is not None and tokens <= r.spec.prompt_tokens:
            model = model.first
        return model

    def _draw(self, key: str, tokens: int, k: int) -> tuple[int, int, bool]:
        position = tokens - self._by_key[key].spec.prompt_tokens
        return self._model(key, tokens).sample(k, self.rng, max(0, position))

    def _chances(self, key: str, tokens: int):  # noqa: ANN202
        """The per-token chances a tree is drawn by: a greedy path's replay is of chains, so its
        trees follow the model it falls back to past its end."""
        model = self._model(key, tokens)
        return getattr(model, "rest", model)

    def tree(self, key: str, tokens: int, k: int) -> Draft | None:
        """The tree the drafter proposes for a round of depth ``k``; None for a request that has
        ended (a late Propose the router let finish: its result goes unused)."""
        assert self.trees is not None
        if key not in self._by_key:
            return None
        return draft_tree(self.trees, self._chances(key, tokens).accept_p, k)

    def verify_tree(self, key: str, tokens: int, draft: Draft) -> list[int]:
        """The target's tokens for a tree: the accepted path and one more."""
        assert self.trees is not None
        model = self._chances(key, tokens)
        drafted = 0  # as deep as the drafter would have gone: the chain's draw of draft_p
        while drafted < draft.depth and self.rng.random() < model.at(model.draft_p, drafted):
            drafted += 1
        path, after = accept_path(draft, model.accept_p, drafted, self.trees, self.rng)
        self.tally.add(
            draft.k,
            len(path),
            expected_accepted(draft, model.accept_p, model.draft_p, self.trees.runner_up),
            chain_expected(model.accept_p, model.draft_p, draft.depth),
        )
        return path + [after]

    def ngram(self, tokens: list[int], k: int) -> int:
        """How many tokens the n-gram drafter proposes for the request whose tokens these are."""
        key = self._by_index[tokens[0]]
        drawn = self._draw(key, len(tokens), k)
        self._pending[key] = drawn
        return drawn[0]

    def verify(self, key: str, tokens: int, k: int) -> list[int]:
        """The target's tokens for a draft of ``k``: the accepted prefix and one more."""
        drawn = self._pending.pop(key, None)
        if drawn is None or drawn[0] != k:
            drawn = self._draw(key, tokens, k) if k > 0 else (0, 0, False)
        drafted, accepted, bonus = drawn
        accepted = min(accepted, drafted, k)
        return [MATCH] * accepted + [MATCH if accepted == k and k > 0 and bonus else MISS]


class SimNgram:
    """The router's n-gram drafter in a simulation: it proposes as many tokens as the request's
    n-gram acceptance model draws (``NgramDrafter.propose_one``'s interface)."""

    def __init__(self, outcomes: Outcomes):
        self.outcomes = outcomes

    def propose_one(self, tokens: list[int], k: int) -> Draft:
        if k <= 0:
            return Draft(tokens=[], probs=[])
        return Draft(tokens=[MATCH] * self.outcomes.ngram(tokens, k), probs=None)


@dataclass
class SimVerifyRequest:
    """A round's Verify as a simulated target needs it: (request key, its tokens, its draft) per
    row, and (request key, its tokens) per prompt chunk cached beside them. A simulated link passes
    it instead of the protobuf request, whose encoding of every row's whole context is the service's
    cost of a round, not a decision."""

    items: list[tuple[str, int, Draft]]
    prefill: list[tuple[str, int]] = field(default_factory=list)


class SimTargetLink(TargetLink):
    """The router's target link to a simulated worker. Two things differ from the service's: the
    round's request is not encoded (:class:`SimVerifyRequest`), and the router's own time for a
    round (building and sending it: ``Costs.router_s``), which a simulation does not spend, is
    waited before the call, where the service spends it."""

    def __init__(self, link: TargetLink, costs: Costs):
        super().__init__(link.name, link.target, link.cfg)
        self.costs = costs

    def encode(  # type: ignore[override]
        self, jobs: Sequence[Job], drafts: Sequence[Draft], prefill: Sequence[worker_pb2.Sequence] = ()
    ) -> SimVerifyRequest:
        return SimVerifyRequest(
            [(j.key, len(j.state.tokens), d) for j, d in zip(jobs, drafts)],
            [(s.request_id, len(s.tokens)) for s in prefill],
        )

    async def verify(
        self,
        jobs: Sequence[Job],
        drafts: Sequence[Draft],
        cached_on: int,
        prefill: Sequence[worker_pb2.Sequence] = (),
    ) -> tuple[list, float | None, BaseException | None]:
        await asyncio.sleep(self.costs.router_s(len(jobs)))
        return await super().verify(jobs, drafts, cached_on, prefill)


class _Stub:
    """The worker's ``Info``, as the router's telemetry loop polls it: device load over the last period."""

    def __init__(self, worker: SimWorker):
        self.w = worker

    async def Info(self, request: worker_pb2.InfoRequest, timeout: float | None = None) -> worker_pb2.WorkerInfo:  # noqa: N802
        w = self.w
        now = asyncio.get_running_loop().time()
        window = now - w.last_sample if w.last_sample is not None else 0.0
        info = worker_pb2.WorkerInfo()
        info.CopyFrom(w.info)
        if window > 0:
            busy = min(1.0, max(0.0, w.worker.busy_in(now - window, now) / window))
            info.telemetry.CopyFrom(
                worker_pb2.DeviceTelemetry(device="sim", source="process", time=now, window_s=window, busy=busy)
            )
        w.last_sample = now
        return info


class SimWorker:
    """A draft or target worker behind the router's worker-client interface."""

    def __init__(
        self,
        name: str,
        role: str,
        device: Device,
        slots: int,
        max_context: int,
        costs: Costs,
        outcomes: Outcomes,
        catch_up: Callable[[int], bool],
        noise: Callable[[], float] | None = None,
    ):
        self.name, self.role = name, role
        self.costs, self.outcomes, self.catch_up, self.noise = costs, outcomes, catch_up, noise
        self.worker = Worker(device)
        # workers on one simulated device (a colocated drafter and its target) share a placement
        self.info = worker_pb2.WorkerInfo(
            model=name,
            role=role,
            device="sim",
            max_context=max_context,
            vocab_size=VOCAB,
            num_slots=slots,
            free_slots=slots,
            placement=f"sim/{id(device)}",
        )
        self.up = True
        self.restarts = 0  # simulated workers never restart
        self.address = f"sim/{name}"
        self.down_since: float | None = None
        self.last_recovery_s: float | None = None
        self.telemetry = None  # set by the router's telemetry loop from stub.Info
        self.last_sample: float | None = None
        self.lock = asyncio.Lock()
        self.stub = _Stub(self)
        self.cached: dict[str, int] = {}  # tokens of each request it holds

    def __repr__(self) -> str:
        return f"SimWorker({self.role}, {self.name})"

    # ---- the worker client's interface -------------------------------------------------------------
    def record_info(self, info: worker_pb2.WorkerInfo, address: str | None) -> None:
        """The telemetry loop's Info (WorkerClient.record_info); the same process always."""
        self.info = info

    async def wait_up(self, timeout: float) -> None:
        return None

    def release(self, request_ids: list[str]) -> asyncio.Future:
        for key in request_ids:
            self.cached.pop(key, None)
            if self.role == "target":
                self.outcomes.forget(key)
        done = asyncio.get_running_loop().create_future()
        done.set_result(None)
        return done

    async def call(self, method: str, request, timeout: float):  # noqa: ANN001 - as WorkerClient.call
        return (await self.call_timed(method, request, timeout))[0]

    async def call_timed(self, method: str, request, timeout: float):  # noqa: ANN001
        """(response, the worker's compute seconds): the RPC's overhead, then its compute on the
        device."""
        if method == "Verify":
            return await self._verify(request)
        if method == "Prefill":
            return await self._prefill(request)
        if method == "Propose":
            return await self._propose(request)
        if method == "Release":
            self.release(list(request.request_ids))
            return worker_pb2.ReleaseResponse(), None
        raise NotImplementedError(f"a simulated worker does not serve {method}")

    # ---- compute --------------------------------------------------------------------------------
    async def _run(self, overhead: float, work: float) -> float:
        """Wait ``overhead`` (RPC and router time: no device), then run ``work`` on the device; the
        seconds it computed."""
        if overhead > 0:
            await asyncio.sleep(overhead)
        if self.noise is not None and work > 0:
            work *= self.noise()
        call = self.worker.submit(Call(work))
        if not call.done:
            done = asyncio.get_running_loop().create_future()
            call.on_done(lambda: done.done() or done.set_result(None))
            await done
        return call.ran_s

    def _new_tokens(self, seq: worker_pb2.Sequence, cache_last: bool) -> int:
        n = len(seq.tokens) - (0 if cache_last else 1)
        new = n - self.cached.get(seq.request_id, 0)
        self.cached[seq.request_id] = n
        return max(0, new)

    async def _verify(self, request: SimVerifyRequest):
        c = self.costs
        items = request.items
        # Tokens each row computes: a verify row its draft and the committed tokens its cache lacks
        # (one, or a prompt's last chunk too), a prompt chunk all but its last token.
        new = [n - min(self.cached.get(key, 0), n - 1) + d.k for key, n, d in items]
        new += [max(0, n - 1 - self.cached.get(key, 0)) for key, n in request.prefill]
        context = max([n for _, n, _ in items] + [n for _, n in request.prefill])
        # The target's GEMMs run over the rows' tokens packed (runner.forward), so a round costs what
        # uniform rows of the mean width cost, not the widest row times the batch; a tree's nodes are
        # its row's tokens.
        verify_tokens = sum(d.k + 1 for _, _, d in items)
        work = c.verify_s(len(items), verify_tokens / len(items), context) if items else 0.0
        if sum(new) > verify_tokens:
            # A forward that also caches prompt tokens costs at least a prefill of all its tokens.
            work = max(work, c.prefill_s(1, sum(new), context))
        compute = await self._run(c.verify_rpc_s, work)
        for key, n in request.prefill:
            self.cached[key] = max(self.cached.get(key, 0), n - 1)
        outcomes = []
        for key, n, d in items:
            if d.parents is not None:
                tokens = self.outcomes.verify_tree(key, n, d)
            else:
                tokens = self.outcomes.verify(key, n, d.k)
            self.cached[key] = n + len(tokens) - 1
            outcomes.append(worker_pb2.VerifyOutcome(request_id=key, tokens=tokens, num_accepted=len(tokens) - 1))
        return worker_pb2.VerifyResponse(outcomes=outcomes), compute

    async def _prefill(self, request: worker_pb2.PrefillRequest):
        c = self.costs
        seqs = request.sequences
        if self.role == "target":
            context = max(self.cached.get(s.request_id, 0) for s in seqs)
            width = max(self._new_tokens(s, cache_last=False) for s in seqs)
            work = c.prefill_s(len(seqs), width, context)
            rpc = c.verify_rpc_s
        else:
            work = c.draft_prefill_s(sum(self._new_tokens(s, cache_last=False) for s in seqs))
            rpc = c.draft_rpc_s
        compute = await self._run(rpc, work)
        outcomes = [worker_pb2.PrefillOutcome(request_id=s.request_id) for s in seqs]
        return worker_pb2.PrefillResponse(outcomes=outcomes), compute

    async def _propose(self, request: worker_pb2.ProposeRequest):
        c = self.costs
        seqs = request.sequences
        k = max(s.k for s in seqs)
        context = max(len(s.tokens) for s in seqs)
        # More new tokens than a round commits (a prompt's tail, a moved request, catching up after
        # speculation was off) is a prefill before the draft steps.
        new = [self._new_tokens(s, cache_last=True) for s in seqs]
        trees = self.outcomes.trees
        # A tree grows a level per draft forward over `expand` nodes of each row (tree_drafting.py):
        # priced as a chain's steps at that many rows; `expand` 0 runs the chain's own forwards.
        rows = len(seqs) * (max(1, trees.expand) if trees is not None else 1)
        work = c.draft_s(rows, k, context) + c.draft_prefill_s(sum(n for n in new if self.catch_up(n)))
        compute = await self._run(c.draft_rpc_s, work)
        drafts = [self._draft(s) for s in seqs]
        return worker_pb2.ProposeResponse(drafts=drafts), compute

    def _draft(self, s: worker_pb2.Sequence) -> worker_pb2.Draft:
        """A chain of ``k`` first choices, or (where the drafter drafts trees: every request when
        they are grown, greedy and seeded ones only when runners-up are leaves;
        specdec/core/drafters.py) a tree ``k`` deep."""
        trees, tree = self.outcomes.trees, None
        grows = trees is not None and (trees.expand > 0 or s.mode != generate_pb2.VERIFY_MODE_REJECTION)
        if grows and s.k > 0:
            tree = self.outcomes.tree(s.request_id, len(s.tokens), s.k)
        if tree is None:
            return worker_pb2.Draft(request_id=s.request_id, tokens=[MATCH] * s.k)
        return draft_to_proto(s.request_id, tree)


def jitter(rng: random.Random, sigma: float) -> Callable[[], float] | None:
    """A factor on each call's work, exp(N(0, sigma)) (None when sigma is 0)."""
    return (lambda: math.exp(rng.gauss(0.0, sigma))) if sigma > 0 else None
