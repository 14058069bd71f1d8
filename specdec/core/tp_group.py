"""Joining a tensor-parallel group, and a group of local processes for one-process tools.

:func:`init_group` joins the torch.distributed group (gloo on CPU; on CUDA gloo for the small
commands and NCCL for the tensors), rendezvous at rank 0's ``host:port``. :func:`shard_and_lead`
turns a fresh runner into rank r's part. :class:`LocalGroup` makes the calling process rank 0 and
starts ranks 1..N-1 as child processes on this machine: what ``specdec generate --tp N``, ``specdec
bench runner --tp N`` and the tests use (the service runs its ranks as Ray actors instead).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import os
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from specdec.core.lockstep import LeaderRunner, follow
from specdec.core.runner import ModelRunner
from specdec.core.tp import DEFAULT_LM_HEAD, check_shardable, shard_runner

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 60.0
JOIN_TIMEOUT_S = 600.0

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "GroupSpec",
    "LocalGroup",
    "free_port",
    "init_group",
    "local_device",
    "shard_and_lead",
    "split_threads",
]


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def split_threads(total: int | None, world: int) -> int:
    """Torch threads per rank when `world` ranks share `total` cores (default: this machine's)."""
    total = total or os.cpu_count() or 1
    if total < world:
        log.warning("%d ranks on %d cores: each rank gets 1 thread (oversubscribed)", world, total)
    return max(1, total // world)


def init_group(
    rank: int,
    world: int,
    master: str,
    device: str = "cpu",
    timeout_s: float = DEFAULT_TIMEOUT_S,
    join_timeout_s: float = JOIN_TIMEOUT_S,
) -> None:
    """Join the default process group at rank 0's `master` ("host:port"; rank 0 listens there).

    Ranks load their weights at different speeds, so joining may take `join_timeout_s`; once
    joined, a collective that waits longer than `timeout_s` fails (a dead or hung rank)."""
    dev = torch.device(device)
    backend = "cpu:gloo,cuda:nccl" if dev.type == "cuda" else "gloo"
    if dev.type == "cuda" and dev.index is not None:
        torch.cuda.set_device(dev)
    host, port = master.rsplit(":", 1)
    store = dist.TCPStore(
        host.strip("[]"),
        int(port),
        world,
        is_master=rank == 0,
        timeout=datetime.timedelta(seconds=join_timeout_s),
    )
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s)
    )
    log.info("rank %d/%d joined the group at %s (%s)", rank, world, master, backend)


@dataclass
class GroupSpec:
    """How every rank builds its runner: the same model and arguments on each."""

    model: str
    world: int
    dtype: str = "float32"
    device: str = "cpu"
    num_slots: int = 8
    max_len: int = 2048
    lm_head: str = DEFAULT_LM_HEAD
    timeout_s: float = DEFAULT_TIMEOUT_S
    runner_kwargs: dict = field(default_factory=dict)  # weight_quant, vocab_subset

    def build_runner(self, model) -> ModelRunner:
        return ModelRunner(model, num_slots=self.num_slots, max_len=self.max_len, **self.runner_kwargs)


def shard_and_lead(runner: ModelRunner, rank: int, spec: GroupSpec) -> LeaderRunner | ModelRunner:
    """Shard `runner` for `rank`; rank 0 gets a LeaderRunner (with heartbeats), others the runner."""
    shard_runner(runner, rank, spec.world, lm_head=spec.lm_head, model=spec.model)
    if rank == 0:
        return LeaderRunner(runner, heartbeat_s=spec.timeout_s / 4)
    return runner


def local_device(device: str, rank: int) -> str:
    """Rank `rank`'s device in a local group: GPU r for a bare "cuda" (one GPU per rank)."""
    return f"cuda:{rank}" if device == "cuda" else device


def _follower_main(rank: int, spec: GroupSpec, master: str, threads: int) -> None:
    from specdec.core.models import load_model

    torch.set_num_threads(threads)
    device = local_device(spec.device, rank)
    loaded = load_model(spec.model, dtype=spec.dtype, device=device)
    runner = spec.build_runner(loaded.model)
    del loaded
    init_group(rank, spec.world, master, device, spec.timeout_s)
    shard_and_lead(runner, rank, spec)
    try:
        follow(runner)
    finally:
        dist.destroy_process_group()


def _follower_command(rank: int, spec: GroupSpec, master: str, threads: int) -> tuple[list[str], dict]:
    """`python -m specdec.core.tp_group ARGS` for one follower, and its environment (this checkout
    first on the path, so the child runs the same code as its parent)."""
    args = {"rank": rank, "spec": dataclasses.asdict(spec), "master": master, "threads": threads}
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    return [sys.executable, "-m", "specdec.core.tp_group", json.dumps(args)], env


class LocalGroup:
    """This process is rank 0; ranks 1..N-1 are child processes (killed with it).

    ``start(runner)`` takes rank 0's fresh unsharded runner and returns its LeaderRunner once the
    group is joined; ``close()`` stops the followers and leaves the group. A follower whose rank 0
    is gone finds it at its next collective and exits. Each rank runs with
    ``threads`` torch threads (default: this machine's cores split between the ranks); rank 0's
    own thread count is the caller's to set.
    """

    def __init__(self, spec: GroupSpec, threads: int | None = None):
        self.spec = spec
        self.threads = threads or split_threads(None, spec.world)
        self.procs: list = []
        self.leader: LeaderRunner | None = None

    def start(self, runner: ModelRunner) -> LeaderRunner:
        mlp = runner.layers[0].gate.shape[0]
        check_shardable(runner.num_heads, runner.num_kv_heads, mlp, self.spec.world, self.spec.model)
        master = f"127.0.0.1:{free_port()}"
        for rank in range(1, self.spec.world):
            cmd, env = _follower_command(rank, self.spec, master, self.threads)
            self.procs.append(subprocess.Popen(cmd, env=env))
        try:
            init_group(0, self.spec.world, master, local_device(self.spec.device, 0), self.spec.timeout_s)
            leader = shard_and_lead(runner, 0, self.spec)
        except BaseException:
            self._reap()
            raise
        assert isinstance(leader, LeaderRunner)
        self.leader = leader
        return leader

    def _reap(self) -> None:
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)
        self.procs = []

    def close(self) -> None:
        if self.leader is not None:
            self.leader.stop()
            self.leader = None
        self._reap()
        if dist.is_initialized():
            dist.destroy_process_group()

    def __enter__(self) -> LocalGroup:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


if __name__ == "__main__":  # a follower started by LocalGroup
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _a = json.loads(sys.argv[1])
    _follower_main(_a["rank"], GroupSpec(**_a["spec"]), _a["master"], _a["threads"])
