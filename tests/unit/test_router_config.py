"""The router config's policy sections (router/config.py): one per decision, and the older flat
``rebalance`` keys and top-level ``auto_off_batch`` still accepted, each moved to its section."""

from __future__ import annotations

import dataclasses

import pytest

from router.config import LEGACY_KEYS, RebalanceConfig, RouterConfig


def test_each_decision_has_its_section():
    cfg = RouterConfig.from_dict(
        {
            "rebalance": {"enabled": False, "period_s": 0.5},
            "drafter_choice": {"move_margin": 2.0},
            "draft_depth": {"samples": 2},
            "speculation_off": {"auto_off_batch": 24, "min_evidence": 4.0},
            "target_choice": {"saturated_penalty": 0.5},
            "scaling": {"enabled": True},
        }
    )
    assert cfg.rebalance == RebalanceConfig(enabled=False, period_s=0.5)
    assert cfg.drafter_choice.move_margin == 2.0 and cfg.draft_depth.samples == 2
    assert cfg.speculation_off.auto_off_batch == 24 and cfg.speculation_off.min_evidence == 4.0
    assert cfg.target_choice.saturated_penalty == 0.5 and cfg.scaling.enabled
    assert RouterConfig.from_dict(cfg.to_dict()) == cfg


def test_the_older_keys_still_work():
    old = RouterConfig.from_dict(
        {
            "auto_off_batch": 24,
            "rebalance": {"period_s": 0.2, "move_cooldown_s": 0.5, "depth_samples": 2, "spec_min_evidence": 4.0},
        }
    )
    new = RouterConfig.from_dict(
        {
            "speculation_off": {"auto_off_batch": 24, "min_evidence": 4.0},
            "rebalance": {"period_s": 0.2},
            "drafter_choice": {"move_cooldown_s": 0.5},
            "draft_depth": {"samples": 2},
        }
    )
    assert old == new
    assert RouterConfig(auto_off_batch=3).speculation_off.auto_off_batch == 3  # built directly, as tests do
    assert RouterConfig(rebalance={"spec_off_margin": 0.1}).speculation_off.off_margin == 0.1
    assert dataclasses.replace(old, micro_batches=1).speculation_off == old.speculation_off
    every = {old_key: getattr(getattr(RouterConfig(), section), key) for old_key, (section, key) in LEGACY_KEYS.items()}
    assert RouterConfig(rebalance=dict(every)) == RouterConfig()  # every older key lands on a field


def test_bad_config_names_the_key():
    with pytest.raises(ValueError, match=r'router.rebalance.move_margn: unknown key; did you mean "router.drafter_'):
        RouterConfig.from_dict({"rebalance": {"move_margn": 2}})
    with pytest.raises(ValueError, match="write it once"):
        RouterConfig.from_dict({"rebalance": {"move_margin": 2}, "drafter_choice": {"move_margin": 3}})
    with pytest.raises(ValueError, match="write it once"):
        RouterConfig.from_dict({"auto_off_batch": 2, "speculation_off": {"auto_off_batch": 3}})
    with pytest.raises(ValueError, match="router.drafter_choice.move_margin"):
        RouterConfig.from_dict({"rebalance": {"move_margin": 0.5}})
    with pytest.raises(ValueError, match="router.speculation_off.auto_off_batch"):
        RouterConfig.from_dict({"auto_off_batch": -1})
    with pytest.raises(ValueError, match="router.auto_of_batch: unknown key"):
        RouterConfig.from_dict({"auto_of_batch": 2})
    with pytest.raises(ValueError, match="router.rebalance.period_s"):
        RouterConfig.from_dict({"rebalance": {"period_s": 0}})
