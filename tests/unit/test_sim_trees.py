"""Token trees in the capacity simulator (cluster/planning/sim_trees.py): the simulated draft worker
proposes trees, the router's own TreeSizer cuts them, and the simulated target accepts a path drawn
by depth and rank.

Tolerances come from the sample: each round's accepted tokens are drawn independently given the
tree verified, so the sum over rounds of (accepted - the model's expectation for that tree) has the
sum of the rounds' model variances as its variance, whatever the router decided from earlier
rounds (a martingale). Four standard deviations of that sum: a correct simulation fails about once
in 16,000 runs, and the runs are seeded."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest

import cluster.planning.sim_workers
from cluster.planning.profile import Grid
from cluster.planning.sim_trees import SimTrees, accept_path, chain_expected, draft_tree, expected_accepted
from cluster.planning.simulator import simulate
from specdec.core.request_state import KPolicy
from specdec.core.token_tree import depths
from tests.unit.test_planning_sim import deployment, make_profile, requests

A = 0.6  # the chain model's per-token acceptance
K = 4
SHAPE = SimTrees(width=3, expand=2, nodes=12, runner_up=0.3)
SIGMAS = 4.0


def run(trees: SimTrees | None, sloped: bool, n: int = 20, output: int = 200):
    """Requests with a fixed k, on flat verify costs (every node is free: the sizer keeps whole
    trees) or sloped ones (a verify of 32 tokens costs 2 of one: the sizer cuts)."""
    profile = make_profile()
    if sloped:
        profile.target_forward = Grid([1, 64], [1, 32], [[100.0, 200.0], [100.0, 200.0]])
    dep = dataclasses.replace(deployment(profile, k_policy=KPolicy(k=K)), trees=trees)
    res = simulate(dep, requests(n, A, output=output), seed=3)
    assert res.summary["errors"] == 0  # the router's checks of every outcome passed
    return res


def within_sample_error(trees: dict, mean_key: str) -> bool:
    return abs(trees["accepted_mean"] - trees[mean_key]) <= SIGMAS * trees["expected_sd_of_mean"]


# ---- the tree, its draw and its expectation ------------------------------------------------------


def test_the_tree_has_the_draft_workers_shape_with_siblings_told_apart_by_rank():
    d = draft_tree(SimTrees(width=3, expand=2, nodes=100), [A], K)
    assert len(d.tokens) == 3 + 3 * (2 * 3)  # the root's 3, then 2 grown per level, 3 children each
    assert max(depths(d.parents)) == K
    siblings = {}
    for t, p in zip(d.tokens, d.parents):
        siblings.setdefault(p, []).append(t)
    assert all(sorted(ts) == [0, 1, 2] for ts in siblings.values())
    cut = draft_tree(SHAPE, [A], K)
    assert cut.k == SHAPE.nodes and cut.tokens[:1] == [0]
    assert cut.holds([0] * K)  # the draft's own chain (first choices all the way) is kept whole
    chain_with_leaves = draft_tree(SimTrees(width=3, expand=0, nodes=100), [A], K)
    assert len(chain_with_leaves.tokens) == 3 * K
    with pytest.raises(ValueError, match="runner_up"):
        SimTrees(runner_up=1.5)
    # a late Propose for a request that has ended gets a chain (the router does not use it)
    assert cluster.planning.sim_workers.Outcomes(random.Random(0), SHAPE).tree("ended", 10, K) is None


def test_the_expectation_by_depth_and_rank_by_hand():
    """A root with its first choice and one runner-up, the first choice with one child."""
    d = draft_tree(SimTrees(width=2, expand=1, nodes=3, runner_up=0.5), [0.6, 0.8], 2)
    assert (d.tokens, d.parents) == ([0, 1, 0], [-1, -1, 0])
    p_first, p_runner_up, p_deep = 0.6, 0.4 * 0.5, 0.6 * 0.8
    mean, var = expected_accepted(d, [0.6, 0.8], [1.0], 0.5)
    assert mean == pytest.approx(p_first + p_runner_up + p_deep)
    assert var == pytest.approx(p_first + p_runner_up + 3 * p_deep - mean**2)
    assert [math.exp(s) for s in d.scores] == pytest.approx([p_first, p_runner_up, p_deep])  # what the sizer reads
    assert chain_expected([0.6, 0.8], [1.0], 2) == pytest.approx(0.6 + 0.48)


def test_the_draw_matches_the_expectation_over_many_walks():
    rng = random.Random(0)
    d = draft_tree(SHAPE, [A], K)
    mean, var = expected_accepted(d, [A], [1.0], SHAPE.runner_up)
    n = 20_000
    total = sum(len(accept_path(d, [A], K, SHAPE, rng)[0]) for _ in range(n))
    assert abs(total / n - mean) <= SIGMAS * math.sqrt(var / n)


# ---- through the router ---------------------------------------------------------------------------


def test_a_tree_run_accepts_what_the_acceptance_model_expects_of_the_trees_verified():
    res = run(SHAPE, sloped=True)
    t = res.trees
    assert t["rounds"] > 500
    assert within_sample_error(t, "expected_mean")
    assert t["accepted_mean"] > t["chain_expected_mean"]  # runners-up catch some of the chain's misses


def test_a_sim_verify_that_ignores_rank_is_caught(monkeypatch):
    """Broken: every kept child is the target's token with the first choice's chance, whatever its
    rank. It accepts more than the model says the trees are worth, and the check above fails."""

    def rank_blind(draft, accept_p, drafted, shape, rng):
        kids: dict[int, list[int]] = {}
        for i, p in enumerate(draft.parents):
            kids.setdefault(p, []).append(i)
        node, path = -1, []
        while len(path) < drafted:
            a = accept_p[min(len(path), len(accept_p) - 1)]
            nxt = next((c for c in kids.get(node, ()) if rng.random() < a), None)
            if nxt is None:
                break
            path.append(draft.tokens[nxt])
            node = nxt
        return path, shape.width

    monkeypatch.setattr(cluster.planning.sim_workers, "accept_path", rank_blind)
    t = run(SHAPE, sloped=True).trees
    assert not within_sample_error(t, "expected_mean")


def test_the_routers_tree_sizer_cuts_the_trees_where_nodes_cost():
    """The router's own histogram of the nodes it verified (specdec_draft_tree_nodes): on sloped
    costs most trees are cut below the 12 nodes proposed; on flat ones they are verified whole."""
    assert draft_tree(SHAPE, [A], K).k == 12  # what a round at k = 4 proposes

    def cut_share(trees: dict) -> float:
        buckets = trees["router_nodes_le"]
        assert buckets[math.inf] == trees["rounds"]  # the router saw every tree the target verified
        return buckets[8.0] / buckets[math.inf]

    sloped = run(SHAPE, sloped=True).trees
    flat = run(SHAPE, sloped=False).trees
    assert cut_share(sloped) > 0.5 > 0.1 > cut_share(flat)
    assert sloped["nodes_mean"] < flat["nodes_mean"]


def test_with_no_runner_up_chance_a_tree_accepts_what_its_chain_does():
    """Per round, against a chain as deep as the tree verified: the sizer may still cut a deep node
    of the chain that does not pay, and a chain run (never cut) is then deeper, so the comparison is
    at equal depth."""
    t = run(dataclasses.replace(SHAPE, runner_up=0.0), sloped=False).trees
    assert t["expected_mean"] == pytest.approx(t["chain_expected_mean"], rel=1e-6)
    assert within_sample_error(t, "chain_expected_mean")
    with_runners_up = run(SHAPE, sloped=False).trees
    assert not within_sample_error(with_runners_up, "chain_expected_mean")  # the check can fail


def test_a_prediction_simulates_the_trees_its_draft_worker_is_configured_to_draft():
    """The draft worker drafts a tree where draft_options.tree_width > 1 (specdec/core/build.py)."""
    from cluster.config import ServeConfig
    from cluster.planning.predict import _deployment

    def trees_of(draft_options):
        pools = {"target": {"model": "t"}, "draft": {"model": "d", "draft_options": draft_options}}
        serve = ServeConfig.from_dict({**pools, "router": {"micro_batches": 1, "predraft": False}})
        return _deployment(make_profile(), serve, "auto", colocated=True).trees

    assert trees_of({"tree_width": 3, "tree_expand": 2, "tree_nodes": 10}) == SimTrees(3, 2, 10)
    assert trees_of(None) is None  # chains by default
    with pytest.raises(ValueError, match="tree_width"):
        SimTrees.of_draft_worker({"tree_width": 0})


def test_a_plan_candidate_with_trees_reports_what_they_accept_beside_the_chain():
    """`specdec plan`'s simulations over the catalog's roofline: on a GPU a verify of a few more rows
    costs about the same, so the trees stay and their runners-up add tokens."""
    from cluster.planning.catalog import load_catalog
    from cluster.planning.planner import SLO, Candidate, PlanWorkload, SearchSpace, _Planner
    from cluster.planning.workload import AcceptanceModel, parse_lengths
    from router.config import RouterConfig

    def evaluate(trees):
        wl = PlanWorkload(2.0, parse_lengths("256"), parse_lengths("64"), {"draft": [AcceptanceModel.iid(A)]}, 20)
        wl.trees = trees
        catalog = load_catalog()
        planner = _Planner(
            catalog,
            catalog.model("llama-3.1-8b"),
            catalog.model("llama-3.2-1b"),
            wl,
            SLO(),
            SearchSpace(),
            RouterConfig(),
            lambda _: None,
        )
        return planner.evaluate(Candidate("A100-80GB", 1, 1, "colocated", 1, "adaptive", 32))[1]

    assert evaluate(None).trees is None
    t = evaluate(SHAPE).trees
    assert t["nodes_mean"] > 4 and t["accepted_mean"] > t["chain_expected_mean"]
    assert within_sample_error(t, "expected_mean")
