"""The service with a tensor-parallel target: a group of 2 rank actors behind one supervisor actor.

A local Ray cluster (conftest ``ray_cluster``), the tiny Llama (4 heads, 2 KV heads) sharded over
2 ranks joined by gloo, a draft worker at TP 1 beside it, and the router in this process with the
group's handle (it cannot tell it from a single worker). Outputs are compared with the
single-process engine at TP 1 and with transformers.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from specdec.core.params import SamplingParams
from specdec.core.request_state import KPolicy
from specdec.rpc.client import SpecdecClient

MAX_LEN = 512
SLOTS = 8
PROMPTS = ["def fib(n):", "hello world, ", "The quick brown fox", "import numpy as np\n"]


@pytest.fixture(scope="module")
def tp_service(ray_cluster, actor_reaper, tiny_paths):
    from draft_worker.actor import spawn_draft_worker
    from router.config import RouterConfig
    from router.server import RouterThread, TargetBinding
    from router.workers import ActorEndpoint
    from target_worker.group import spawn_target_group

    config = {"model": str(tiny_paths["llama"]), "dtype": "float32", "num_slots": SLOTS, "max_len": MAX_LEN}
    group = spawn_target_group({**config, "threads": 2}, 2, timeout_s=20.0)  # 2 threads: 1 per rank
    draft = spawn_draft_worker({**config, "model": str(tiny_paths["llama-draft"]), "threads": 1})
    actor_reaper.extend([group, draft])
    router_cfg = RouterConfig(
        port=0,
        metrics_port=None,
        k_policy=KPolicy(k=3, adaptive=True, k_min=1, k_max=6),
        recovery_timeout_s=240.0,
        default_max_tokens=64,
    )
    binding = TargetBinding(
        "tiny-llama",
        ActorEndpoint(group, "target-0"),
        ActorEndpoint(draft, "draft-0"),
        "tiny-llama-draft",
        tokenizer=str(tiny_paths["llama"]),
    )
    router = RouterThread([binding], router_cfg).start(connect_timeout=300)
    client = SpecdecClient(router.address)
    try:
        yield group, client
    finally:
        client.close()
        router.stop(grace=0)


@pytest.fixture(scope="module")
def engine(tiny_paths):
    """The single-process engine at TP 1 with the same models (the reference)."""
    from specdec.core.build import build_engine

    eng, parts = build_engine(
        str(tiny_paths["llama"]), str(tiny_paths["llama-draft"]), num_slots=16, max_len=MAX_LEN, k_policy=KPolicy(k=3)
    )
    return eng, parts


def _encode(engine, text: str) -> list[int]:
    return list(engine[1].target.tokenizer(text)["input_ids"])


def test_the_group_is_one_worker_with_two_ranks(tp_service):
    import ray

    group, client = tp_service
    info = ray.get(group.info.remote(), timeout=60)
    assert info["tensor_parallel"] == 2 and len(set(info["ranks"])) == 2
    assert info["free_slots"] == SLOTS and info["model"].endswith("llama")
    assert [(m["name"], m["role"], m["ready"]) for m in client.list_models()][0] == ("tiny-llama", "target", True)


def test_greedy_equals_tp1_and_transformers(tp_service, engine, tiny_paths):
    from tests.conftest import greedy_ids

    _, client = tp_service
    prompt = _encode(engine, "def fib(n):")
    n = 24
    out = client.generate(prompt_token_ids=prompt, max_tokens=n, ignore_eos=True, timeout=120)
    (tp1,) = engine[0].generate([prompt], SamplingParams(max_tokens=n, ignore_eos=True))
    assert out.token_ids == tp1.token_ids and out.stats["drafted"] > 0
    assert out.token_ids == greedy_ids(tiny_paths["llama"], prompt, n)


def test_8_concurrent_streams_greedy_and_seeded(tp_service, engine):
    """8 streams at once (greedy and seeded invariant sampling, with and without the drafter):
    each equals the TP 1 engine token for token."""
    _, client = tp_service
    reqs = []
    for i in range(8):
        sampling = dict(temperature=0.8, top_p=0.9, seed=100 + i) if i % 2 else {}
        reqs.append((_encode(engine, PROMPTS[i % 4]), 20 + i, ["draft", "off", "ngram", "auto"][i % 4], sampling))
    results: list = [None] * len(reqs)

    def run(i: int) -> None:
        prompt, n, mode, sampling = reqs[i]
        chunks = client.generate_stream(
            prompt_token_ids=prompt, max_tokens=n, ignore_eos=True, mode=mode, timeout=240, **sampling
        )
        results[i] = [t for c in chunks for t in c.token_ids]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(reqs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=240)
    expected = engine[0].generate(
        [p for p, _, _, _ in reqs], [SamplingParams(max_tokens=n, ignore_eos=True, **s) for _, n, _, s in reqs]
    )
    for i, (got, want) in enumerate(zip(results, expected)):
        assert got == want.token_ids, f"stream {i} ({reqs[i][2]}, {reqs[i][3]}) differs from TP 1"


def test_killing_one_rank_restarts_the_group_and_the_request_completes_unchanged(tp_service, engine):
    import ray

    group, client = tp_service
    prompt = _encode(engine, "The quick brown fox")
    params = dict(max_tokens=400, ignore_eos=True, temperature=0.9, seed=7)
    (expected,) = engine[0].generate([prompt], [SamplingParams(**params)])
    old = ray.get(group.rank_pids.remote(), timeout=60)
    out: dict = {"tokens": []}
    started = threading.Event()

    def run():
        try:
            for c in client.generate_stream(prompt_token_ids=prompt, timeout=300, **params):
                out["tokens"] += c.token_ids
                started.set()
        except Exception as exc:  # noqa: BLE001 - reported below
            out["error"] = exc
        started.set()

    t = threading.Thread(target=run)
    t.start()
    assert started.wait(120)
    os.kill(old[1], signal.SIGKILL)  # a follower rank: the router never talks to it
    at_kill = len(out["tokens"])
    t.join(300)
    assert "error" not in out, out.get("error")
    assert 0 < at_kill < params["max_tokens"], "the rank was not killed mid-request"
    assert out["tokens"] == expected.token_ids
    t_end = time.monotonic() + 120
    while True:
        info = ray.get(group.info.remote(), timeout=180)
        if info["group_restarts"] >= 1:
            break
        assert time.monotonic() < t_end, "the group did not restart"
        time.sleep(0.5)
    assert set(info["ranks"]).isdisjoint(old)  # both ranks are new processes: restarted as a unit
