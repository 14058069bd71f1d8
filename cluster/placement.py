"""What a deployment needs from the cluster, checked before anything starts.

A tensor-parallel target needs whole heads on every rank (checked against the model's config) and
one node holding all its ranks' bundles (STRICT_PACK). The embedded cluster is sized from the
config here too, so the check and the cluster agree.
"""

from __future__ import annotations

import os

from cluster.config import ServeConfig
from specdec.rpc.worker_host import placement_bundle

__all__ = ["embedded_node", "check_tensor_parallel", "largest_group"]

DEFAULT_KEYS = {"target": "target_gpu", "draft": "draft_gpu"}


def embedded_node(cfg: ServeConfig) -> tuple[int, dict[str, float]]:
    """(logical CPUs, custom resources) of the embedded local cluster for this config."""
    pools = [(p, role) for p, role in ((cfg.target, "target"), (cfg.draft, "draft")) if p is not None]
    workers = sum(p.actors for p, _ in pools)
    num_cpus = cfg.ray.num_cpus or max(os.cpu_count() or 1, workers)
    if cfg.ray.resources:
        return num_cpus, dict(cfg.ray.resources)
    res: dict[str, float] = {}
    for pool, role in pools:
        wanted = (pool.placement or {}).get("resources") or {DEFAULT_KEYS[role]: 1}
        for key, amount in wanted.items():
            res[key] = res.get(key, 0) + float(amount) * pool.actors
    return num_cpus, res


def largest_group(node: dict[str, float], bundle: dict[str, float]) -> int:
    """How many copies of `bundle` fit on a node with `node`'s total resources."""
    fits = [int(node.get(key, 0.0) / amount + 1e-9) for key, amount in bundle.items() if amount > 0]
    return min(fits) if fits else 0


def check_tensor_parallel(cfg: ServeConfig, nodes: list[dict[str, float]] | None) -> None:
    """Raise ValueError, saying what to change, when the target's tensor_parallel cannot work:
    heads that do not divide (TPError names the model and N) or no node for all its ranks.
    `nodes`: the total resources of each node (None: not known yet, checked once joined)."""
    pool = cfg.target
    n = pool.tensor_parallel
    if n == 1:
        return
    if cfg.router.scaling.enabled:  # the pool actuator starts single workers, not groups
        raise ValueError(
            f"target.tensor_parallel={n} with router.scaling.enabled: scaling a pool of tensor-parallel "
            "groups is not supported yet; turn scaling off or use tensor_parallel 1"
        )
    from specdec.core.tp import check_model  # reads the model's config (imports transformers)

    check_model(pool.worker.model, n)
    if nodes is None:
        return
    bundle = placement_bundle(pool.placement, {"target_gpu": 1})
    best = max((largest_group(node, bundle) for node in nodes), default=0)
    if best < n:
        raise ValueError(
            f"target.tensor_parallel={n}: a group needs {n} bundles of {bundle} on one node (STRICT_PACK), "
            f"but no node of this cluster holds more than {best}; lower tensor_parallel or add resources"
        )
