"""Token trees from the draft model and their size from measured costs (specdec/core/tree_drafting.py,
specdec/core/tree_size.py; docs/design.md, "Token trees")."""

from __future__ import annotations

import math

import pytest
import torch

from specdec.core.draft_options import draft_options_from_dict
from specdec.core.drafters import DraftInput, ModelDrafter, propose_within_k
from specdec.core.params import SamplingParams, VerifyMode
from specdec.core.round_types import Draft
from specdec.core.runner import ModelRunner
from specdec.core.token_tree import depths, leaf_paths
from specdec.core.tree_drafting import TreeShape, branch_chain
from specdec.core.tree_size import TreeSizer
from tests.conftest import load_hf


@pytest.fixture(scope="module")
def draft_model(tiny_paths):
    return load_hf(tiny_paths["llama-draft"])


def _inputs(k: int, mode=VerifyMode.GREEDY) -> list[DraftInput]:
    params = SamplingParams(max_tokens=50, seed=7 if mode is VerifyMode.INVARIANT else None)
    gen = torch.Generator().manual_seed(3)
    return [
        DraftInput(f"r{i}", torch.randint(0, 256, (n,), generator=gen).tolist(), params, mode, k)
        for i, n in enumerate((9, 20))
    ]


@pytest.mark.parametrize("expand", [0, 1, 3])
@pytest.mark.parametrize("mode", [VerifyMode.GREEDY, VerifyMode.INVARIANT])
def test_a_tree_holds_the_chain_and_is_cut_to_k(draft_model, expand, mode):
    """The draft model's own chain is a path of its tree: a tree never accepts less."""
    k = 4
    chain = ModelDrafter(ModelRunner(draft_model, num_slots=2, max_len=64)).propose(_inputs(k, mode))
    drafter = ModelDrafter(ModelRunner(draft_model, num_slots=2, max_len=64), tree=TreeShape(3, expand, 12))
    trees = propose_within_k(drafter, _inputs(k, mode))
    for c, t in zip(chain, trees):
        assert t.parents is not None and len(t.scores) == t.k <= 12
        assert max(depths(t.parents)) <= k
        paths = [[t.tokens[i] for i in p] for p in leaf_paths(t.parents)]
        assert any(p[: len(c.tokens[:k])] == c.tokens[:k] for p in paths), (paths, c.tokens)
        # A node is no likelier than its parent (the cut keeps trees).
        assert all(p < 0 or t.scores[i] <= t.scores[p] + 1e-9 for i, p in enumerate(t.parents))
        assert t.k > t.depth  # several candidates somewhere
    # The draft runner's slots hold chains again, ready for the next round.
    assert not drafter.runner.trees
    again = drafter.propose(_inputs(k, mode))
    assert [d.tokens[:1] for d in again] == [d.tokens[:1] for d in trees]


def test_sampling_requests_draft_sampled_trees(draft_model):
    """A grown tree for a sampling request: each node with the q it and its siblings were drawn from
    (specdec/core/tree_sampling.py); distinct siblings. Runners-up as leaves stay greedy-only."""
    drafter = ModelDrafter(ModelRunner(draft_model, num_slots=2, max_len=64), tree=TreeShape(3, 2, 12))
    drafts = drafter.propose(_inputs(3, VerifyMode.REJECTION))
    for d in drafts:
        assert d.parents is not None and len(d.probs) == d.k > d.depth
        for parent in set(d.parents):
            siblings = [i for i, p in enumerate(d.parents) if p == parent]
            assert len({d.tokens[i] for i in siblings}) == len(siblings)
            assert all(d.probs[i] == d.probs[siblings[0]] and d.tokens[i] in d.probs[i][0] for i in siblings)
    leaves = ModelDrafter(ModelRunner(draft_model, num_slots=2, max_len=64), tree=TreeShape(3, 0, 12))
    assert all(d.parents is None and d.probs for d in leaves.propose(_inputs(3, VerifyMode.REJECTION)))


def test_branch_chain_puts_runners_up_beside_the_chain():
    ranks = [[(5, math.log(0.6)), (6, math.log(0.3))], [(7, math.log(0.9)), (8, math.log(0.05))]]
    draft = branch_chain([5, 7], ranks, size=10)
    assert draft.tokens == [5, 6, 7, 8] and draft.parents == [-1, -1, 0, 0]
    assert draft.scores[2] == pytest.approx(math.log(0.6 * 0.9))
    assert branch_chain([5, 7], ranks, size=2).tokens == [5, 7]  # the likeliest two
    assert branch_chain([6, 7], ranks, size=10).parents is None  # not the ranking it came from


def _tree(scores: list[float]) -> Draft:
    n = len(scores)
    return Draft(tokens=list(range(n)), parents=[-1] + [0] * (n - 1), scores=[math.log(s) for s in scores])


def test_the_sizer_keeps_what_pays():
    sizer = TreeSizer()
    draft = _tree([0.9, 0.5, 0.1, 0.01])
    assert sizer.cut([draft], draft_s=0.1)[0].k == 4  # nothing measured: all, once
    # Flat verify costs: every node pays.
    for width in (2, 3, 4, 5):
        sizer.observe(width, 0.1, 1.0, 1)
    assert sizer.cut([draft], 0.1)[0].k == 4
    # Each row costs as much as the whole first verify: only the likeliest node pays.
    sizer = TreeSizer()
    for width in (2, 3, 4, 5):
        sizer.observe(width, 0.1 * (width - 1), 1.0, 1)
    kept = sizer.cut([draft], 0.1)[0]
    assert kept.tokens == [0]
    # A width never measured is tried: it costs no more than its neighbours suggest.
    assert sizer.verify_cost(7) == pytest.approx(0.4) and TreeSizer().verify_cost(3) is None


def test_the_sizer_weighs_nodes_by_the_measured_acceptance():
    """A row costs half a verify: at the draft's word two nodes pay; where the target accepts a
    fifth of what the draft promises, one does. (A sizer that ignored acceptance fails this.)"""
    sizer = TreeSizer()
    for width in (2, 3, 4, 5):
        sizer.observe(width, 0.1 + 0.05 * (width - 1), 1.0, 1)
    draft = _tree([0.9, 0.5, 0.1, 0.01])
    assert sizer.cut([draft], 0.1)[0].k == 2
    sizer.observe(5, sizer.verify_s[5], expected=50.0, accepted=1)
    sizer.observe(5, sizer.verify_s[5], expected=50.0, accepted=1)
    assert sizer.calibration < 0.5
    assert sizer.cut([draft], 0.1)[0].k == 1


def test_tree_options_are_checked():
    assert draft_options_from_dict({"tree_width": 3, "tree_expand": 0}).tree_expand == 0
    for bad in ({"tree_width": 0}, {"tree_nodes": "8"}, {"tree_expand": -1}, {"tree_width": True}):
        with pytest.raises(ValueError, match="tree_"):
            draft_options_from_dict(bad)
