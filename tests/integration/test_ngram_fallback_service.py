"""AUTO requests drafting by the router's n-gram in place of their draft model, end to end (tiny
models as Ray actors, real gRPC on loopback, the router in this process).

Which requests move is decided by measured times (router/ngram_fallback.py; its rule on scripted
rounds: tests/unit/test_ngram_fallback.py). Here the decisions are pinned, as a loaded machine's
measurements would make them, so that what is checked is the path: requests switched off or moved
to n-gram mid-stream, then back to their draft model (which catches up on what it missed), give
the engine's tokens, greedy and seeded, and the n-gram drafts are counted apart from the draft
worker's.
"""

from __future__ import annotations

import threading

import pytest

from router.speculation_off import VerifyCost
from specdec.core.params import SamplingParams
from tests.integration.service_fixture import running_service

TEXTS = ["abc abc abc abc", "def fib(n):\n    return fib(n - 1) + fib(n - 2)\n", "x = 1\ny = 2\nx = 1\ny ="]


@pytest.fixture(scope="module")
def service(ray_cluster, actor_reaper, tiny_paths):
    # one lane, no pre-drafts: each round's drafts are the ones the pinned decisions asked for
    with running_service(actor_reaper, tiny_paths, micro_batches=1, predraft=False) as svc:
        yield svc


@pytest.fixture(scope="module")
def engine(tiny_paths):
    import torch

    from specdec.core.build import build_engine

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # beside the workers' processes on the two cores
    eng, parts = build_engine(
        str(tiny_paths["llama"]), str(tiny_paths["llama-draft"]), dtype="float32", num_slots=8, max_len=1024
    )
    try:
        yield eng, parts
    finally:
        torch.set_num_threads(threads)


def _generate_all(client, requests: list[dict]) -> list:
    out: list = [None] * len(requests)

    def one(i: int) -> None:
        try:
            out[i] = client.generate(timeout=240, **requests[i])
        except Exception as exc:  # noqa: BLE001 - reported by the assertions
            out[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    return out


def test_auto_requests_moved_to_ngram_and_back_keep_the_engines_tokens(service, engine, monkeypatch):
    eng, parts = engine
    tok = parts.target.tokenizer
    prompts = [list(tok(TEXTS[i % len(TEXTS)])["input_ids"]) for i in range(6)]
    seeded = [dict(temperature=0.8, seed=7 + i) if i % 3 == 2 else {} for i in range(6)]
    params = [SamplingParams(max_tokens=48, ignore_eos=True, **kw) for kw in seeded]
    expected = eng.generate(prompts, params)

    # Pinned decisions: the goodput switch holds every other AUTO request off, and n-gram drafts
    # come and go with the rounds (each request on n-gram for three rounds, then back for three).
    rounds = {"n": 0}

    def switch(jobs, cost, now, cfg):
        return [j.off or (j.auto and j.k > 0 and i % 2 == 1) for i, j in enumerate(jobs)]

    def fallback(jobs, off, evidence, ngram_k, ngram_on, changed_at, cost, now, cfg, pool=None):
        rounds["n"] += 1
        return [k > 0 and (rounds["n"] // 3) % 2 == 0 for k in ngram_k]

    monkeypatch.setattr("router.target_balance.plan_speculation", switch)
    monkeypatch.setattr("router.target_balance.plan_fallback", fallback)
    monkeypatch.setattr("router.target_balance.TargetBalance._decided", lambda self: True)
    monkeypatch.setattr("router.target_balance.TargetBalance.cost", lambda self: VerifyCost(t1=0.05, slope=0.0))

    metric = service.metric
    before = {w: metric("specdec_draft_sequences_total", {"worker": w}) for w in ("ngram", "draft-0")}
    requests = [
        dict(prompt_token_ids=p, max_tokens=48, ignore_eos=True, mode="auto", **kw) for p, kw in zip(prompts, seeded)
    ]
    outs = _generate_all(service.client, requests)
    for i, (o, e) in enumerate(zip(outs, expected)):
        assert not isinstance(o, Exception), f"request {i}: {o!r}"
        assert o.token_ids == e.token_ids, f"request {i} differs from the engine"
    after = {w: metric("specdec_draft_sequences_total", {"worker": w}) for w in before}
    assert after["ngram"] > before["ngram"], "no round drafted by n-gram"
    assert after["draft-0"] > before["draft-0"], "no round drafted by the draft model"
    assert metric("specdec_rebalance_actions_total", {"action": "ngram_on"}) > 0
    assert metric("specdec_rebalance_actions_total", {"action": "ngram_off"}) > 0
    service.wait_slots_free()
