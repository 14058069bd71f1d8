"""Bad `target.tensor_parallel` values fail with a clear error before anything starts."""

from __future__ import annotations

import pytest

from cluster.config import ServeConfig, load_config
from cluster.placement import check_tensor_parallel, embedded_node, largest_group


def _cfg(model: str, tp, **ray) -> ServeConfig:
    return ServeConfig.from_dict(
        {"target": {"model": model, "tensor_parallel": tp, "threads": 2}, "draft": None, "ray": ray or None}
    )


@pytest.mark.parametrize("tp", [0, -2, 1.5, "2", True])
def test_not_a_rank_count(tp):
    with pytest.raises(ValueError, match="target.tensor_parallel: (expected an integer|must be >= 1)"):
        _cfg("t", tp)


def test_drafters_stay_at_tp_1_and_the_flag_sets_the_target(tmp_path):
    with pytest.raises(ValueError, match="only the target pool"):
        ServeConfig.from_dict({"target": {"model": "t"}, "draft": {"model": "d", "tensor_parallel": 2}})
    path = tmp_path / "c.yaml"
    path.write_text("target: {model: t}\ndraft: null\n")
    cfg = load_config(path, tensor_parallel=2, draft="d")
    assert (cfg.target.tensor_parallel, cfg.draft.tensor_parallel, cfg.target.actors) == (2, 1, 2)


def test_heads_that_do_not_divide_name_the_model_and_n(tiny_paths):
    from specdec.core.tp import TPError

    with pytest.raises(TPError) as err:  # 4 heads, 2 KV heads
        check_tensor_parallel(_cfg(str(tiny_paths["qwen2"]), 3), None)
    assert "tensor_parallel=3" in str(err.value) and str(tiny_paths["qwen2"]) in str(err.value)
    check_tensor_parallel(_cfg(str(tiny_paths["qwen2"]), 2), None)  # whole heads: fine


def test_more_ranks_than_any_node_holds(tiny_paths):
    # 4 ranks shard the tiny model (4 heads; 2 KV heads replicated), but the cluster has 2 target_gpu
    cfg = _cfg(str(tiny_paths["llama"]), 4, resources={"target_gpu": 2})
    num_cpus, resources = embedded_node(cfg)
    assert resources == {"target_gpu": 2}
    with pytest.raises(ValueError, match=r"needs 4 bundles .* no node of this cluster holds more than 2"):
        check_tensor_parallel(cfg, [{"CPU": float(num_cpus), **resources}])
    check_tensor_parallel(cfg, [{"CPU": 8.0, "target_gpu": 4.0}])
    # by default the embedded cluster is sized for every rank
    sized = _cfg(str(tiny_paths["llama"]), 4)
    assert embedded_node(sized)[1] == {"target_gpu": 4.0} and embedded_node(sized)[0] >= 4
    assert largest_group({"CPU": 16, "GPU": 3}, {"CPU": 1, "GPU": 1}) == 3


def test_launch_refuses_before_starting_ray_or_workers(tiny_paths):
    import ray

    from cluster.launch import launch
    from specdec.core.tp import TPError

    was_up = ray.is_initialized()
    with pytest.raises(TPError, match="tensor_parallel=3"):
        launch(_cfg(str(tiny_paths["llama"]), 3))
    with pytest.raises(ValueError, match="needs 4 bundles"):
        launch(_cfg(str(tiny_paths["llama"]), 4, resources={"target_gpu": 2}))
    assert ray.is_initialized() == was_up  # nothing was started


def test_scaling_a_pool_of_groups_is_refused(tiny_paths):
    cfg = ServeConfig.from_dict(
        {
            "target": {"model": str(tiny_paths["qwen2"]), "tensor_parallel": 2, "threads": 2},
            "draft": None,
            "router": {"scaling": {"enabled": True}},
        }
    )
    with pytest.raises(ValueError, match="scaling a pool of tensor-parallel groups is not supported"):
        check_tensor_parallel(cfg, None)
