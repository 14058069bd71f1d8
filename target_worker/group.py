"""A tensor-parallel target worker: N rank actors in one placement group, seen as one worker.

* :class:`TargetRank` is one rank (a Ray actor in bundle r of the group's STRICT_PACK placement
  group). Each loads the model, joins the torch.distributed group at rank 0's address (gloo on
  CPU, NCCL on CUDA) and keeps its shard (``specdec.core.tp``). Rank 0 serves ``TargetService``
  over its LeaderRunner; ranks > 0 follow its commands in lockstep (``specdec.core.lockstep``).
  The ranks split the worker's ``threads`` between them.
* :class:`TargetGroup` is the group's supervisor (a small Ray actor, no resources). It answers
  ``address()`` like a single target worker, so the router cannot tell a group from one worker.
  When a rank dies, or rank 0 finds the group broken (a dead or hung rank: the collective
  timeout), it kills every rank and starts them again as a unit with a new rendezvous; meanwhile
  ``address()`` waits, and the router replays the round on the new group (router/target_link.py).

Ray and torch are imported lazily: importing this module is cheap and torch-free.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid

from specdec.rpc.worker_config import WorkerConfig
from specdec.rpc.worker_host import WorkerHost, actor_options, placement_bundle
from specdec.rpc.worker_secret import current_secret

log = logging.getLogger(__name__)

DEFAULT_RESOURCES = {"target_gpu": 1}
DEFAULT_TIMEOUT_S = 60.0  # a collective waiting longer than this fails: the group restarts
START_TIMEOUT_S = 900.0  # placing the bundles, loading the model on every rank, joining

__all__ = ["TargetGroup", "TargetRank", "spawn_target_group"]


class TargetRank:
    """One rank of a tensor-parallel target group."""

    def __init__(self, config: dict, rank: int, world: int, timeout_s: float, secret: str | None = None):
        import torch

        from specdec.core.models import load_model
        from specdec.core.tp_group import GroupSpec, split_threads

        self.cfg = WorkerConfig.from_dict(config)
        self.rank, self.world = rank, world
        torch.set_num_threads(split_threads(self.cfg.threads, world))
        self.loaded = load_model(self.cfg.model, dtype=self.cfg.dtype, device=self.cfg.device)
        self.spec = GroupSpec(
            self.cfg.model,
            world,
            dtype=self.cfg.dtype,
            device=self.cfg.device,
            num_slots=self.cfg.num_slots,
            max_len=self.cfg.max_len,
            timeout_s=timeout_s,
        )
        self.runner = self.spec.build_runner(self.loaded.model)
        self.leader = None
        self.host: WorkerHost | None = None
        self._secret = secret  # the worker secret rank 0 serves with (specdec.rpc.worker_secret)

    def rendezvous(self) -> str:
        """Rank 0: 'host:port' where the group meets (a free port on this node)."""
        import ray

        from specdec.core.tp_group import free_port

        host = ray.util.get_node_ip_address()
        return f"{host}:{free_port(host)}"

    def join(self, master: str) -> None:
        """Join the group, keep this rank's shard; rank 0 then serves TargetService."""
        from specdec.core.tp_group import init_group, shard_and_lead
        from specdec.rpc import worker_pb2_grpc
        from target_worker.servicer import SERVICE_NAME, target_servicer

        init_group(self.rank, self.world, master, self.cfg.device, self.spec.timeout_s)
        runner = shard_and_lead(self.runner, self.rank, self.spec)
        self.loaded.model = None  # the unsharded weights can go
        if self.rank == 0:
            self.leader = runner
            servicer = target_servicer(self.cfg, self.loaded, runner)
            self.host = WorkerHost(
                self.cfg,
                [(worker_pb2_grpc.add_TargetServiceServicer_to_server, servicer, SERVICE_NAME)],
                servicer,
                secret=self._secret,
            )

    def run(self) -> str:
        """Block while the group works; return (or raise) why it stopped."""
        from specdec.core.lockstep import follow

        if self.rank == 0:
            self.leader.wait_done()
            if self.host is not None:
                self.host.shutdown(grace=0)  # no half-working rank 0: clients see UNAVAILABLE
            return f"rank 0: {self.leader.broken or 'stopped'}"
        follow(self.runner)
        return f"rank {self.rank}: stopped"

    def stop(self) -> None:
        if self.leader is not None:
            self.leader.stop()

    def address(self) -> str:
        return self.host.address()

    def info(self) -> dict:
        return self.host.info() if self.host is not None else {"pid": os.getpid()}

    def drain(self) -> None:
        self.host.drain()

    def pid(self) -> int:
        return os.getpid()


class TargetGroup:
    """Supervises the ranks of one tensor-parallel target worker; restarts them as a unit."""

    def __init__(
        self,
        config: dict,
        tensor_parallel: int,
        placement: dict | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        group_id: str | None = None,
        start_timeout_s: float = START_TIMEOUT_S,
        secret: str | None = None,
    ):
        self.cfg = WorkerConfig.from_dict(config)
        self._secret = secret
        self.world = tensor_parallel
        self.placement = placement
        self.timeout_s = timeout_s
        self.start_timeout_s = start_timeout_s
        self.name = f"specdec-tp-{group_id or uuid.uuid4().hex[:8]}"
        self._cv = threading.Condition()
        self._ranks: list = []
        self._runs: list = []
        self._address: str | None = None
        self._closed = False
        self.restarts = 0
        self.started_at = time.time()
        self.pg = self._placement_group()
        self._start()
        threading.Thread(target=self._watch, daemon=True, name="tp-group-watch").start()

    # ---- placement and start -----------------------------------------------------------------
    def _placement_group(self):
        import ray
        from ray.exceptions import GetTimeoutError
        from ray.util import placement_group

        bundle = placement_bundle(self.placement, DEFAULT_RESOURCES)
        try:  # a restarted supervisor finds its group's bundles again
            pg = ray.util.get_placement_group(self.name)
        except ValueError:
            pg = placement_group([dict(bundle) for _ in range(self.world)], strategy="STRICT_PACK", name=self.name)
        try:
            ray.get(pg.ready(), timeout=self.start_timeout_s)
        except GetTimeoutError:
            ray.util.remove_placement_group(pg)
            raise RuntimeError(
                f"target group of {self.world} ranks: no node could hold {self.world} bundles of {bundle} "
                f"(STRICT_PACK) within {self.start_timeout_s:.0f} s; see `ray status`"
            ) from None
        return pg

    def _start(self) -> None:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        config = self.cfg.to_dict()
        ranks = []
        for rank in range(self.world):
            placement = dict(self.placement or {"resources": dict(DEFAULT_RESOURCES)})
            placement["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                self.pg, placement_group_bundle_index=rank
            )
            opts = actor_options(placement, DEFAULT_RESOURCES, max_restarts=0)
            ranks.append(
                ray.remote(TargetRank)
                .options(max_concurrency=4, **opts)
                .remote(config, rank, self.world, self.timeout_s, self._secret)
            )
        try:
            master = ray.get(ranks[0].rendezvous.remote(), timeout=self.start_timeout_s)
            ray.get([r.join.remote(master) for r in ranks], timeout=self.start_timeout_s)
            runs = [r.run.remote() for r in ranks]
            address = ray.get(ranks[0].address.remote(), timeout=60)
        except BaseException:
            self._kill(ranks)
            raise
        with self._cv:
            self._ranks, self._runs, self._address = ranks, runs, address
            self._cv.notify_all()
        log.info("target group %s: %d ranks serving at %s", self.name, self.world, address)

    @staticmethod
    def _kill(ranks: list) -> None:
        import ray

        for r in ranks:
            try:
                ray.kill(r, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass

    # ---- failure and restart -----------------------------------------------------------------
    def _watch(self) -> None:
        import ray

        while not self._closed:
            runs = self._runs
            done, _ = ray.wait(runs, num_returns=1, timeout=1.0)
            if not done or self._closed:
                continue
            try:
                why = ray.get(done[0])
            except Exception as exc:  # noqa: BLE001 - a rank died or its loop failed
                why = f"rank {runs.index(done[0])}: {type(exc).__name__}: {str(exc).strip().splitlines()[-1]}"
            log.warning("target group %s lost a rank (%s): restarting all %d ranks", self.name, why, self.world)
            with self._cv:
                self._address = None
                ranks = self._ranks
            self._kill(ranks)
            delay = 1.0
            while not self._closed:
                try:
                    self._start()
                    self.restarts += 1
                    break
                except Exception as exc:  # noqa: BLE001 - keep trying: the router waits for us
                    log.error("target group %s failed to restart: %s; retrying in %.0f s", self.name, exc, delay)
                    time.sleep(delay)
                    delay = min(delay * 2, 30.0)

    # ---- what the router and the launcher call -----------------------------------------------
    def address(self, timeout: float = START_TIMEOUT_S) -> str:
        """Rank 0's gRPC address; waits while the group restarts."""
        with self._cv:
            if not self._cv.wait_for(lambda: self._address is not None or self._closed, timeout):
                raise TimeoutError(f"target group {self.name} did not come back within {timeout:.0f} s")
            if self._address is None:
                raise RuntimeError(f"target group {self.name} is shut down")
            return self._address

    def _rank0(self):
        self.address()
        return self._ranks[0]

    def info(self) -> dict:
        import ray

        info = ray.get(self._rank0().info.remote(), timeout=60)
        return {**info, "tensor_parallel": self.world, "group_restarts": self.restarts, "ranks": self.rank_pids()}

    def rank_pids(self) -> list[int]:
        import ray

        self.address()
        return ray.get([r.pid.remote() for r in self._ranks], timeout=60)

    def pid(self) -> int:
        return self.rank_pids()[0]

    def drain(self) -> None:
        import ray

        ray.get(self._rank0().drain.remote(), timeout=60)

    def shutdown(self, grace: float = 5.0) -> None:
        import ray

        self._closed = True
        with self._cv:
            ranks, self._address = self._ranks, None
            self._cv.notify_all()
        try:
            ray.get(ranks[0].stop.remote(), timeout=max(grace, 1.0))
        except Exception:  # noqa: BLE001 - best effort: the ranks are killed next
            pass
        self._kill(ranks)
        ray.util.remove_placement_group(self.pg)


def spawn_target_group(
    config: dict | WorkerConfig,
    tensor_parallel: int,
    placement: dict | None = None,
    name: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    max_restarts: int = -1,
):
    """Create a TargetGroup supervisor (no resources of its own; its ranks take one bundle each of
    ``placement``); returns the handle. ``ray.get(handle.address.remote())`` waits for the group."""
    import ray

    cfg = WorkerConfig.from_dict(config)
    if cfg.model.lower() == "ngram":
        raise ValueError("worker config 'model': a target worker needs a model, not 'ngram'")
    opts = {"num_cpus": 0, "max_restarts": max_restarts, "max_task_retries": 3, "max_concurrency": 16}
    if name is not None:
        opts["name"] = name
    return (
        ray.remote(TargetGroup)
        .options(**opts)
        .remote(cfg.to_dict(), tensor_parallel, placement, timeout_s, uuid.uuid4().hex[:8], secret=current_secret())
    )
