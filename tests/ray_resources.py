"""What Ray is asked for when a pool's worker actor is created: shared by the cluster-file and k8s tests."""

from __future__ import annotations

from specdec.rpc.worker_host import actor_options


def actor_demand(placement: dict | None) -> dict[str, float]:
    """The Ray resources of one replica (what the worker's spawn passes to Ray), zero amounts left out."""
    opts = actor_options(placement, {})
    demand = {"CPU": opts["num_cpus"], "GPU": opts.get("num_gpus", 0), **opts.get("resources", {})}
    if opts.get("accelerator_type"):
        demand[f"accelerator_type:{opts['accelerator_type']}"] = 0.001  # how Ray spells accelerator_type=
    return {k: v for k, v in demand.items() if v}
