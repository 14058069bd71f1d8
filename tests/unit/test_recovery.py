"""Recovery in proportion (docs/design.md, "Recovery"): after the target restarts, running requests
cache their committed tokens again in chunks within each round's token budget, never all at once in
one forward, and complete with the tokens they would have had. The scenarios run the router's
scheduler over a stand-in target worker that keeps a KV cache per request the way a worker does (a
call computes every token of its sequence past what is cached) and loses it all when it restarts."""

from __future__ import annotations

import asyncio

import pytest

from router.config import RouterConfig
from router.metrics import Metrics
from router.scheduler import Job, TargetScheduler
from router.workers import WorkerUnavailable
from specdec.core.params import SamplingParams, VerifyMode
from specdec.rpc import worker_pb2

BUDGET, CHUNK, PROMPT, NEW = 256, 128, 1000, 6


def _next_token(context) -> int:
    return 1 + sum(context) % 251  # the model: a function of the whole context


class _CachingTarget:
    """A target worker's client as the scheduler uses it. Its calls return what a worker would,
    record how many tokens each sequence made it compute (past its cache), and a restart empties
    its caches and starts a new process (``restarts``), as killing a worker does."""

    def __init__(self, slots: int):
        self.name = "target-0"
        self.info = worker_pb2.WorkerInfo(num_slots=slots, max_context=8192, vocab_size=256, eos_token_ids=[0])
        self.lock = asyncio.Lock()
        self.restarts = 0
        self.cache: dict[str, int] = {}  # request key -> tokens cached
        self.computed: list[tuple[int, str, int]] = []  # (process, request key, tokens computed)
        self.fail_next = False

    def restart(self) -> None:
        self.restarts += 1
        self.cache.clear()

    async def wait_up(self, timeout: float) -> None:
        return None

    def _compute(self, key: str, tokens, upto: int) -> None:
        self.computed.append((self.restarts, key, max(0, upto - self.cache.get(key, 0))))
        self.cache[key] = upto

    async def call_timed(self, method: str, request, timeout: float):
        if self.fail_next:  # killed during this call; the new process is up when the router looks again
            self.fail_next = False
            self.restart()
            raise WorkerUnavailable("target-0: Verify: UNAVAILABLE: Socket closed")
        if method == "Prefill":
            for s in request.sequences:
                self._compute(s.request_id, s.tokens, len(s.tokens) - 1)
            return worker_pb2.PrefillResponse(outcomes=[worker_pb2.PrefillOutcome() for _ in request.sequences]), None
        assert method == "Verify"
        for s in request.prefill:  # prompt chunks cached in the same forward
            self._compute(s.request_id, s.tokens, len(s.tokens) - 1)
        outcomes = []
        for item in request.items:
            tokens = list(item.sequence.tokens)
            self._compute(item.sequence.request_id, tokens, len(tokens))
            outcomes.append(worker_pb2.VerifyOutcome(tokens=[_next_token(tokens)], num_accepted=0))
        return worker_pb2.VerifyResponse(outcomes=outcomes), None

    async def release(self, keys: list[str]) -> None:
        for key in keys:
            self.cache.pop(key, None)


def _scheduler() -> tuple[TargetScheduler, _CachingTarget]:
    cfg = RouterConfig(micro_batches=1, max_batched_tokens=BUDGET, prefill_chunk=CHUNK, default_mode="off")
    target = _CachingTarget(slots=4)
    return TargetScheduler("m", target, None, None, cfg, Metrics(), lambda ids: ""), target


def _submit(sched: TargetScheduler, name: str, seed: int) -> Job:
    prompt = [1 + (seed * 7 + i) % 200 for i in range(PROMPT)]
    job = sched.new_job(
        name, prompt, SamplingParams(max_tokens=NEW, ignore_eos=True), VerifyMode.GREEDY, "off", None, None
    )
    sched.submit(job)
    return job


def _expected(prompt: list[int]) -> list[int]:
    tokens = list(prompt)
    for _ in range(NEW):
        tokens.append(_next_token(tokens))
    return tokens[len(prompt) :]


async def _round(sched: TargetScheduler) -> None:
    batch = sched._take(0)
    try:
        await sched._round(batch)
    finally:
        for job in batch:
            job.in_flight = False


async def _run(restart_after: int, during_call: bool) -> tuple[list[Job], _CachingTarget, TargetScheduler, list]:
    """Two requests run; after ``restart_after`` rounds the target restarts (between two rounds, or
    killed during the next round's call); the rounds go on until both are done. Also returns the
    requests' generated token counts when the target restarted."""
    sched, target = _scheduler()
    jobs = [_submit(sched, f"r{i}", i) for i in range(2)]
    rounds, at_restart = 0, []
    while not all(j.done for j in jobs):
        if rounds == restart_after:
            at_restart = [len(j.state.generated) for j in jobs]
            if during_call:
                target.fail_next = True
            else:
                target.restart()
        await _round(sched)
        rounds += 1
        assert rounds < 100
    return jobs, target, sched, at_restart


@pytest.mark.parametrize("during_call", [False, True], ids=["between rounds", "during a call"])
@pytest.mark.parametrize("restart_after", [3, 11], ids=["while prefilling", "while decoding"])
def test_a_restarted_target_gets_the_contexts_again_in_chunks_within_the_budget(restart_after, during_call):
    async def scenario():
        jobs, target, sched, at_restart = await _run(restart_after, during_call)
        assert (min(at_restart) > 0) == (restart_after == 11), at_restart  # the phase the ids say
        for job in jobs:
            assert job.state.generated == _expected(job.state.prompt_ids)  # unchanged by the restart
        after = [n for process, _, n in target.computed if process == 1]
        assert after, "the new process served the rest"
        # No call asks the new process for more than a round's budget; each context came back in
        # several chunks, all of it: a request that had decoded got its generated tokens back too.
        assert max(after) <= BUDGET
        for job in jobs:
            got = sum(n for process, key, n in target.computed if process == 1 and key == job.key)
            assert got >= len(job.state.tokens) - 1
        assert sched.metrics.recached._value.get() == 2

    asyncio.run(scenario())


def test_without_a_restart_nothing_is_cached_again():
    async def scenario():
        jobs, target, sched, _ = await _run(restart_after=-1, during_call=False)
        assert all(process == 0 for process, _, _ in target.computed)
        assert sched.metrics.recached._value.get() == 0
        for job in jobs:  # each prompt once, in chunks, then one token a round
            assert sum(n for _, key, n in target.computed if key == job.key) == PROMPT - 1 + NEW

    asyncio.run(scenario())


def test_a_new_worker_process_counts_a_restart_even_at_the_same_address():
    from router.workers import StaticEndpoint, WorkerClient

    w = WorkerClient(StaticEndpoint("127.0.0.1:1"), "target")
    seen = []
    for instance, address in [("a", "h:1"), ("a", "h:1"), ("b", "h:1"), ("b", "h:2"), ("b", "h:2")]:
        w.record_info(worker_pb2.WorkerInfo(instance=instance), address)
        seen.append(w.restarts)
    assert seen == [0, 0, 1, 2, 2]
