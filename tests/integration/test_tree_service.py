"""Token trees through the service: the draft worker proposes trees, the router sizes them and the
target worker verifies them, and greedy and seeded outputs stay the engine's (docs/design.md, "Token
trees"). Tiny random models, a local Ray cluster, real gRPC on loopback."""

from __future__ import annotations

import threading

import pytest

from specdec.core.build import build_engine
from specdec.core.params import SamplingParams
from specdec.core.request_state import KPolicy
from tests.integration.service_fixture import MAX_LEN, running_service

TREES = {"tree_width": 3, "tree_expand": 2, "tree_nodes": 10}


@pytest.fixture(scope="module")
def service(ray_cluster, actor_reaper, tiny_paths):
    with running_service(actor_reaper, tiny_paths, draft_options=TREES) as svc:
        yield svc


@pytest.fixture(scope="module")
def engine(tiny_paths):
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the workers' processes share the two cores
    eng, _ = build_engine(
        str(tiny_paths["llama"]), None, dtype="float32", num_slots=8, max_len=MAX_LEN, k_policy=KPolicy(k=0)
    )
    try:
        yield eng
    finally:
        torch.set_num_threads(threads)


PROMPTS = [[1, 2, 3, 4, 5, 6], [100, 101, 102, 103, 100, 101, 102], [42] * 9, [7, 8, 9, 10, 11, 12, 13, 14]]


def test_trees_give_the_target_alone_output(service, engine):
    params = [
        SamplingParams(max_tokens=32, ignore_eos=True),
        SamplingParams(max_tokens=32, ignore_eos=True, temperature=0.8, seed=5),
    ]
    want = {}
    for i, prompt in enumerate(PROMPTS):
        for j, p in enumerate(params):
            (res,) = engine.generate([prompt], p)
            want[i, j] = res.token_ids
    got, errors = {}, []

    def run(i: int, j: int) -> None:
        p = params[j]
        try:
            out = service.client.generate(
                prompt_token_ids=PROMPTS[i],
                max_tokens=p.max_tokens,
                ignore_eos=True,
                temperature=p.temperature,
                seed=p.seed,
                mode="draft",
                timeout=120,
            )
            got[i, j] = out.token_ids
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=key) for key in want]  # concurrent: trees batched
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    assert got == want
    # Trees were verified. How far the router cuts them depends on the verify times it measures
    # (specdec/core/tree_size.py), but before the first measurement it verifies whole trees, and a
    # tree of width 3 has at least 3 nodes: some draft went out with more than 2.
    trees = service.metric("specdec_draft_tree_nodes_count")
    assert trees > 0
    assert service.metric("specdec_draft_tree_nodes_bucket", {"le": "2.0"}) < trees


def test_sampling_requests_are_served_with_sampled_trees(service):
    """Unseeded sampling: the draft worker draws trees (specdec/core/tree_sampling.py), the router
    passes them with each node's q, the target verifies them by recursive rejection."""
    before = service.metric("specdec_draft_tree_nodes_count")
    for prompt in PROMPTS[:2]:
        out = service.client.generate(
            prompt_token_ids=prompt, max_tokens=24, ignore_eos=True, temperature=1.0, mode="draft", timeout=120
        )
        assert len(out.token_ids) == 24
    assert service.metric("specdec_draft_tree_nodes_count") > before
