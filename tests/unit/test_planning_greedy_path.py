"""The greedy path (cluster/planning/greedy_path.py): a greedy request's rounds, on real tiny models,
are what its agreement per position says, whatever k the rounds ask; the simulator follows it."""

from __future__ import annotations

import random

import pytest

from cluster.planning.greedy_path import GreedyPath, draft_agreement
from cluster.planning.workload import AcceptanceModel
from specdec.core.build import make_draft_runner, model_drafter_on
from specdec.core.engine import SpecEngine
from specdec.core.models import load_model
from specdec.core.params import SamplingParams
from specdec.core.request_state import KPolicy
from specdec.core.runner import ModelRunner

PROMPTS = [[5, 17, 9, 33, 2, 17, 9, 33, 2, 17], [101, 7, 7, 64, 3, 250, 12, 7, 7, 64, 3]]


class _Noting:
    """A drafter that notes each proposal's output position, k and draft length."""

    def __init__(self, inner, prompt_len: int):
        self.inner, self.prompt_len, self.calls = inner, prompt_len, []

    def propose(self, inputs):
        drafts = self.inner.propose(inputs)
        self.calls += [(len(i.tokens) - self.prompt_len, i.k, len(d.tokens)) for i, d in zip(inputs, drafts)]
        return drafts

    def prefill(self, inputs):
        self.inner.prefill(inputs)

    def release(self, request_id):
        self.inner.release(request_id)


@pytest.fixture(scope="module")
def pair(tiny_paths):
    target = load_model(str(tiny_paths["llama"]), dtype="float32")
    draft = load_model(str(tiny_paths["llama-draft"]), dtype="float32")
    return target, draft


POLICIES = [KPolicy(k=2), KPolicy(k=5), KPolicy(k=3, adaptive=True)]


@pytest.mark.parametrize("policy", POLICIES, ids=["k2", "k5", "adaptive"])
def test_a_greedy_requests_rounds_are_its_agreement_at_each_position(pair, policy):
    target, draft = pair
    drafter = model_drafter_on(make_draft_runner(draft, 2, 128))
    rounds = 0
    for prompt in PROMPTS:
        noting = _Noting(drafter, len(prompt))
        engine = SpecEngine(ModelRunner(target.model, num_slots=1, max_len=128), target.tokenizer, noting, policy)
        rid = engine.add_request(prompt, SamplingParams(max_tokens=24))
        seen = []  # (position, k, drafted, accepted) per round, in order
        while engine.has_work:
            noting.calls.clear()
            before = engine.running[0].stats.accepted if engine.running else 0
            engine.step()
            req = engine.finished.get(rid) or engine.running[0]
            seen += [(p, k, d, req.stats.accepted - before) for p, k, d in noting.calls]
        output = engine.result(rid).token_ids
        agree = draft_agreement(drafter, prompt, list(output))
        assert len(agree) == len(output)
        path = GreedyPath(agree, AcceptanceModel.iid(0.5))
        replayed = [(p, k, *path.sample(k, random.Random(0), p)[:2]) for p, k, _, _ in seen]
        assert seen == replayed
        rounds += len(seen)
        assert 0 < sum(a for *_, a in seen) < len(output)  # the tiny pair both agrees and parts
    assert rounds >= 8


def test_a_path_decides_each_round_and_hands_over_past_its_end():
    path = GreedyPath([3, 2, 1, 0, 5, 4, 3, 2, 1, 0], AcceptanceModel.iid(1.0))
    rng = random.Random(0)
    assert path.sample(2, rng, 0) == (2, 2, True)  # 3 agree: both drafts, and the bonus token too
    assert path.sample(3, rng, 0) == (3, 3, False)
    assert path.sample(4, rng, 1) == (4, 2, False)
    assert path.sample(4, rng, 3) == (4, 0, False)
    assert path.sample(4, rng, 10) == (4, 4, True)  # past the path: drawn from the model (a = 1)
