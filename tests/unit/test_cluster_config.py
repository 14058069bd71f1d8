"""cluster.config: worker threads follow whether the router overlaps drafting with the verify."""

from __future__ import annotations

import os

from cluster.config import ServeConfig, default_threads


def test_alternating_rounds_give_every_worker_every_core():
    assert default_threads("draft", cores=2) == default_threads("target", cores=2) == 2
    assert default_threads("target", cores=16) == 16


def test_pipelined_rounds_split_the_cores():
    assert (default_threads("draft", 2, pipelined=True), default_threads("target", 2, pipelined=True)) == (1, 1)
    assert (default_threads("draft", 8, pipelined=True), default_threads("target", 8, pipelined=True)) == (2, 6)


def test_serve_config_applies_the_router_mode_and_keeps_explicit_threads():
    pools = {"target": {"model": "t"}, "draft": {"model": "d"}}
    cores = os.cpu_count()
    plain = ServeConfig.from_dict({**pools, "router": {"micro_batches": 1, "predraft": False}})
    assert plain.target.worker.threads == plain.draft.worker.threads == cores
    piped = ServeConfig.from_dict({**pools, "router": {"micro_batches": 1, "predraft": True}})
    assert piped.draft.worker.threads == default_threads("draft", cores, pipelined=True)
    explicit = ServeConfig.from_dict(
        {"target": {"model": "t", "threads": 3}, "draft": {"model": "d"}, "router": {"micro_batches": 1}}
    )
    assert explicit.target.worker.threads == 3
