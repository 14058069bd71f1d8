"""Which target gets a new request (router/target_choice.py)."""

from __future__ import annotations

import pytest

from router.target_choice import TargetChoiceConfig, pick_target
from router.views import TargetView

CFG = TargetChoiceConfig()


def test_requests_go_to_the_least_loaded_replica_per_slot():
    ts = [TargetView("a", running=4, capacity=8), TargetView("b", running=3, waiting=2, capacity=8)]
    assert pick_target(ts, CFG).index == 0
    ts = [TargetView("a", running=4, capacity=4), TargetView("b", running=6, capacity=16)]
    assert pick_target(ts, CFG).index == 1  # per slot, not per request
    ts = [TargetView("a", up=False), TargetView("b", running=8, waiting=30, capacity=8)]
    assert pick_target(ts, CFG).index == 1
    # a saturated replica goes last (the load alone would have picked it: route_around)
    ts = [TargetView("a", running=1, capacity=8, level="shallow"), TargetView("b", running=3, capacity=8)]
    r = pick_target(ts, CFG)
    assert (r.index, r.around) == (1, True)
    assert pick_target(ts[:1], CFG).index == 0  # the only one still serves


def test_config_is_strict():
    with pytest.raises(ValueError, match="unknown key"):
        TargetChoiceConfig.from_dict({"saturated_penalt": 2})
    with pytest.raises(ValueError, match="saturated_penalty"):
        TargetChoiceConfig.from_dict({"saturated_penalty": -1})
