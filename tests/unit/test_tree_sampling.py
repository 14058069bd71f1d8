"""Sampled token trees keep the target's distribution (specdec/core/tree_sampling.py)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from specdec.core import tree_sampling
from specdec.core.params import SamplingParams, VerifyMode
from specdec.core.round_types import Draft
from specdec.core.sampling import make_generator, process_logits
from specdec.core.tree_sampling import draw_children
from specdec.core.verify import verify_tree
from tests.conftest import chi2_pvalue

CHI2_ALPHA = 1e-3
V = 6
P_ROOT = [0.35, 0.25, 0.15, 0.10, 0.10, 0.05]  # the target after the committed tokens
Q_ROOT = [0.05, 0.10, 0.40, 0.30, 0.10, 0.05]  # the draft there: far from it, so most draws are rejected
P_NEXT = {t: np.roll([0.4, 0.3, 0.1, 0.1, 0.05, 0.05], t).tolist() for t in range(V)}  # after token t
Q_NEXT = {t: np.roll([0.1, 0.1, 0.1, 0.2, 0.2, 0.3], t).tolist() for t in range(V)}
IDS = list(range(V))


def _sampled_tree(g: torch.Generator, width: int = 3, grandchildren: int = 2) -> Draft:
    """A tree of depth 2 drawn as the drafter draws one: `width` root children without replacement
    from Q_ROOT, each with `grandchildren` children drawn from Q_NEXT after it."""
    tokens, parents, probs = [], [], []
    for t in draw_children(IDS, Q_ROOT, width, g):
        tokens.append(t)
        parents.append(-1)
        probs.append((IDS, Q_ROOT))
    for node, t in list(enumerate(tokens)):
        for c in draw_children(IDS, Q_NEXT[t], grandchildren, g):
            tokens.append(c)
            parents.append(node)
            probs.append((IDS, Q_NEXT[t]))
    return Draft(tokens=tokens, probs=probs, parents=parents)


def _logits(draft: Draft) -> torch.Tensor:
    rows = [P_ROOT] + [P_NEXT[t] for t in draft.tokens]
    return torch.tensor(rows, dtype=torch.float64).log()


def _run(n: int, make_draft=_sampled_tree) -> tuple[list[int], dict[int, list[int]], list[int]]:
    """n rounds: the first tokens, the second tokens by first where the first was a tree node, and
    the accepted depths."""
    g_draft, g_verify = make_generator(1), make_generator(2)
    first, second, depths = [], {t: [] for t in range(V)}, []
    for _ in range(n):
        draft = make_draft(g_draft)
        params = SamplingParams(temperature=1.0)
        result, path = verify_tree(_logits(draft), draft, params, VerifyMode.REJECTION, start_pos=0, generator=g_verify)
        assert [draft.tokens[i] for i in path] == result.tokens[: len(path)]
        first.append(result.tokens[0])
        if path:
            second[result.tokens[0]].append(result.tokens[1])
        depths.append(len(path))
    return first, second, depths


def test_a_sampled_tree_gives_the_targets_tokens_and_depth_helps():
    first, second, depths = _run(6000)
    assert chi2_pvalue(first, P_ROOT) > CHI2_ALPHA
    # After an accepted node, the next token is the target's after it, whichever way it came.
    for t, seconds in second.items():
        if len(seconds) >= 300:
            assert chi2_pvalue(seconds, P_NEXT[t]) > CHI2_ALPHA, t
    assert sum(len(s) >= 300 for s in second.values()) >= 3
    # Runners-up pay: with one child the first token is accepted with probability
    # sum(min(p, q)) = 0.45; three children drawn without replacement take it above that.
    assert np.mean([d > 0 for d in depths]) > sum(min(p, q) for p, q in zip(P_ROOT, Q_ROOT)) + 0.2
    assert max(depths) == 2


def test_dropping_without_replacement_is_caught(monkeypatch):
    """SpecInfer's with-replacement rule (every child against q itself) on children drawn without
    replacement does not give the target's distribution; the chi-square sees it."""
    monkeypatch.setattr(tree_sampling, "sibling_q", lambda q, drawn: q)
    first, _, _ = _run(6000)
    assert chi2_pvalue(first, P_ROOT) < CHI2_ALPHA


def test_children_not_drawn_from_their_q_are_point_masses():
    """A drafter that does not follow the scheme (fixed tokens, a q that does not hold them) still
    gets the target's distribution: each such child is verified as a point mass."""

    def fixed(_g):
        return Draft(tokens=[2, 3, 0], probs=[([4, 5], [0.5, 0.5])] * 3, parents=[-1, -1, -1])

    first, _, _ = _run(4000, fixed)
    assert chi2_pvalue(first, P_ROOT) > CHI2_ALPHA

    def without_q(_g):
        return Draft(tokens=[2, 3, 0], parents=[-1, -1, -1])

    first, _, depths = _run(4000, without_q)
    assert chi2_pvalue(first, P_ROOT) > CHI2_ALPHA
    assert np.mean(depths) == pytest.approx(P_ROOT[2] + P_ROOT[3] + P_ROOT[0], abs=0.03)  # p of the set


def test_draw_children_is_sampling_without_replacement():
    """The first draw follows q; the second follows q without the first, renormalised."""
    g = make_generator(3)
    draws = [draw_children(IDS, Q_ROOT, 2, g) for _ in range(8000)]
    assert all(a != b for a, b in draws)
    assert chi2_pvalue([a for a, _ in draws], Q_ROOT) > CHI2_ALPHA
    after_2 = [b for a, b in draws if a == 2]
    rest = [0.0 if t == 2 else q / (1 - Q_ROOT[2]) for t, q in enumerate(Q_ROOT)]
    assert chi2_pvalue(after_2, rest) > CHI2_ALPHA
    # Broken: the second draw from q itself would put 2 there too; here it never does.
    assert 2 not in after_2


def test_a_cut_sampled_tree_keeps_earlier_siblings_only():
    qs = [(IDS, Q_ROOT)] * 3 + [(IDS, Q_NEXT[0])]
    tree = Draft(tokens=[2, 3, 0, 5], probs=list(qs), parents=[-1, -1, -1, 0])
    assert tree.keep([0, 2, 3]).tokens == [2, 5]  # 0 goes: its earlier sibling 3 was cut
    greedy = Draft(tokens=[2, 3, 0, 5], parents=[-1, -1, -1, 0])
    assert greedy.keep([0, 2, 3]).tokens == [2, 0, 5]  # greedy siblings do not depend on each other


def test_the_engine_samples_trees_with_the_targets_distribution(tiny, monkeypatch):
    """Through the engine (draft model trees, target verify): the first two tokens of a sampling
    request follow the target's own distribution."""
    from specdec.core import drafters, target
    from specdec.core.drafters import ModelDrafter
    from specdec.core.engine import KPolicy, SpecEngine
    from specdec.core.runner import ModelRunner
    from specdec.core.tree_drafting import TreeShape

    # Reproducible randomness for unseeded requests (the generators are seeded from OS entropy).
    seeds = itertools.count(100)
    monkeypatch.setattr(target, "make_generator", lambda seed: make_generator(next(seeds)))
    monkeypatch.setattr(drafters, "make_generator", lambda seed: make_generator(next(seeds)))
    model, draft_model = tiny["target"], tiny["draft"]
    shape = TreeShape(width=3, expand=2, nodes=8)
    drafter = ModelDrafter(ModelRunner(draft_model, num_slots=4, max_len=64), tree=shape)
    engine = SpecEngine(ModelRunner(model, num_slots=4, max_len=64), tiny["tokenizer"], drafter, KPolicy(k=3))
    engine.tree_sizer.cut = lambda drafts, draft_s: list(drafts)  # every node verified: no timing in the test
    proposed = []
    propose = drafter.propose
    drafter.propose = lambda inputs: proposed.extend(out := propose(inputs)) or out
    prompt = [5, 17, 42, 9, 77, 3]
    params = SamplingParams(max_tokens=2, temperature=1.0, top_k=3, ignore_eos=True)
    results = engine.generate([prompt] * 900, params)
    assert any(d.parents is not None and d.probs and len(d.tokens) > d.depth for d in proposed)
    pairs = [tuple(r.token_ids) for r in results]
    # The target alone: the top 3 after the prompt, then the top 3 after each.
    with torch.no_grad():
        first = process_logits(model(torch.tensor([prompt])).logits[0, -1], params).exp()
        support = first.nonzero().flatten().tolist()
        cells, expected = {}, []
        for a in support:
            after = process_logits(model(torch.tensor([prompt + [a]])).logits[0, -1], params).exp()
            for b in after.nonzero().flatten().tolist():
                cells[(a, b)] = len(cells)
                expected.append(float(first[a] * after[b]))
    assert all(p in cells for p in pairs)
    assert math.isclose(sum(expected), 1.0, rel_tol=1e-4)
    assert chi2_pvalue([cells[p] for p in pairs], expected) > CHI2_ALPHA
