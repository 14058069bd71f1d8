"""Chunked prefill in the service: long prompts never stall the others, outputs stay exact.

Router + draft and target Ray actors on tiny models (fp32), with a small chunk and budget so a few
hundred prompt tokens take many rounds. The checks are structural (counts of chunks and rounds),
never timings: the speed figures are `specdec bench serve --workload mixed` (docs/results.md,
"Chunked prefill").
"""

from __future__ import annotations

import random
import threading
import time

import pytest

from specdec.core.params import SamplingParams
from specdec.core.request_state import KPolicy
from specdec.rpc.client import SpecdecClient, build_request

CHUNK, BUDGET, SLOTS, MAX_LEN = 16, 40, 8, 1024


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 250) for _ in range(n)]


@pytest.fixture(scope="module")
def chunked(ray_cluster, actor_reaper, tiny_paths):
    from draft_worker.actor import spawn_draft_worker
    from router.config import RouterConfig
    from router.server import RouterThread, TargetBinding
    from router.workers import ActorEndpoint
    from target_worker.actor import spawn_target_worker

    worker = {"dtype": "float32", "num_slots": SLOTS, "max_len": MAX_LEN, "threads": 1}
    target = spawn_target_worker({"model": str(tiny_paths["llama"]), **worker})
    draft = spawn_draft_worker({"model": str(tiny_paths["llama-draft"]), **worker})
    actor_reaper.extend([target, draft])
    config = RouterConfig(
        port=0,
        metrics_port=None,
        k_policy=KPolicy(k=3),
        micro_batches=1,
        max_batched_tokens=BUDGET,
        prefill_chunk=CHUNK,
        default_max_tokens=16,
    )
    binding = TargetBinding(
        "tiny",
        ActorEndpoint(target, "t0"),
        ActorEndpoint(draft, "d0"),
        "tiny-draft",
        tokenizer=str(tiny_paths["llama"]),
    )
    router = RouterThread([binding], config).start(connect_timeout=300)
    client = SpecdecClient(router.address)
    try:
        yield router, client
    finally:
        client.close()
        router.stop(grace=0)


@pytest.fixture(scope="module")
def reference(tiny_paths):
    """The single-process engine with the same chunking: a prompt served alone."""
    import torch

    from specdec.core.build import build_engine

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    eng, _ = build_engine(
        str(tiny_paths["llama"]),
        str(tiny_paths["llama-draft"]),
        dtype="float32",
        num_slots=2,
        max_len=MAX_LEN,
        k_policy=KPolicy(k=3),
    )
    eng.max_batched_tokens, eng.prefill_chunk = BUDGET, CHUNK

    def run(prompt: list[int], params: SamplingParams) -> list[int]:
        return eng.generate([prompt], params)[0].token_ids

    yield run
    torch.set_num_threads(threads)


def _chunks(router) -> float:
    return router.metrics.sample("specdec_prefill_chunks_total") or 0.0


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_long_prompts_are_chunked_and_a_prompt_beside_them_is_unchanged(chunked, reference, seeded):
    router, client = chunked
    prompt = _prompt(1, 120)
    params = dict(max_tokens=20, ignore_eos=True)
    if seeded:
        params.update(temperature=0.8, seed=11)
    cached_before = router.metrics.sample("specdec_draft_prefill_tokens_total") or 0.0
    calls_before = router.metrics.sample("specdec_draft_prefill_compute_seconds_count") or 0.0
    tail_before = router.metrics.sample("specdec_prefilling_propose_tokens_total") or 0.0
    alone = client.generate(prompt_token_ids=prompt, timeout=120, **params).token_ids
    assert alone == reference(prompt, SamplingParams(**params))
    if not seeded:  # the first request (a later one may start with speculation off: no draft Prefill)
        # The drafter cached the prompt's chunks in timed Prefills, each counting its new tokens
        # once, all but the last round's (those go with the first Propose); the simulator's draft
        # prefill is calibrated by these.
        cached = router.metrics.sample("specdec_draft_prefill_tokens_total") - cached_before
        assert 120 - BUDGET <= cached < 120
        calls = router.metrics.sample("specdec_draft_prefill_compute_seconds_count") - calls_before
        assert calls >= cached // BUDGET  # one per round, a round prefills BUDGET tokens at most
        assert router.metrics.sample("specdec_draft_prefill_compute_seconds_sum") > 0
        # ... and the rest with the first Propose, timed as a Propose that prefills
        assert cached + router.metrics.sample("specdec_prefilling_propose_tokens_total") - tail_before == 120

    before = _chunks(router)
    burst = [_prompt(10 + i, 300) for i in range(4)]
    results: dict[int, list[int]] = {}

    def run(i: int, p: list[int], kw: dict) -> None:
        results[i] = client.generate(prompt_token_ids=p, timeout=300, **kw).token_ids

    threads = [threading.Thread(target=run, args=(i, p, dict(max_tokens=4))) for i, p in enumerate(burst)]
    threads.append(threading.Thread(target=run, args=(9, prompt, params)))
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert results[9] == alone
    # 299 prompt tokens in chunks of 16 = 19 chunks each; the prompt under test 7 more.
    assert _chunks(router) - before >= 4 * 19 + 7


def test_a_running_stream_keeps_getting_tokens_while_long_prompts_prefill(chunked):
    router, client = chunked
    long_chunks = 4 * -(-599 // CHUNK)  # 4 prompts of 600 tokens
    stream = client.generate_stream(prompt_token_ids=_prompt(2, 20), max_tokens=60, ignore_eos=True, timeout=300)
    first = next(stream)  # the stream is decoding
    assert first.token_ids
    start = _chunks(router)
    done = threading.Event()

    def burst() -> None:
        ts = [
            threading.Thread(target=lambda p=p: client.generate(prompt_token_ids=p, max_tokens=2, timeout=300))
            for p in (_prompt(30 + i, 600) for i in range(4))
        ]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        done.set()

    threading.Thread(target=burst, daemon=True).start()
    t_end = time.monotonic() + 120
    while _chunks(router) == start:  # the burst's prefill has begun
        assert time.monotonic() < t_end, "the burst's prefill ran no chunk in 120 s"
        time.sleep(0.01)
    during = 0
    for c in stream:  # the stream gets tokens in between the burst's chunks (budget: its verify rows first)
        during += bool(c.token_ids)
        if during == 3:
            break
    assert _chunks(router) - start < long_chunks
    # A short request arriving now is not stuck behind the queue of chunks.
    short = client.generate(prompt_token_ids=_prompt(3, 10), max_tokens=2, timeout=300)
    assert short.token_ids and _chunks(router) - start < long_chunks
    stream.close()
    done.wait(timeout=300)


def test_cancel_mid_prefill_frees_the_slot_and_runs_no_more_chunks(chunked):
    import grpc

    router, client = chunked
    start = _chunks(router)
    call = client.stub.GenerateStream(build_request(prompt_token_ids=_prompt(4, 1000), max_tokens=4), timeout=300)
    t_end = time.monotonic() + 120
    while _chunks(router) - start < 3:
        assert time.monotonic() < t_end, f"the prompt's prefill ran {_chunks(router) - start} chunks in 120 s, not 3"
        time.sleep(0.01)
    call.cancel()  # the client goes away: the router drops the job
    t_end = time.monotonic() + 30
    while router.router.schedulers[0].load:
        assert time.monotonic() < t_end, "the cancelled job is still held"
        time.sleep(0.05)
    settled = _chunks(router)
    time.sleep(1.0)
    assert _chunks(router) == settled
    assert settled - start < -(-999 // CHUNK)  # far fewer than the prompt's 63 chunks ran
    with pytest.raises(grpc.RpcError):  # nothing else is wrong with the service
        client.generate(prompt_token_ids=[], timeout=30)
