"""Tensor parallelism as a transform on a ModelRunner: keep one rank's shard of every layer.

As in gpt-fast's ``tp.py``, the model code does not change: q/k/v/gate/up keep their rank's output
rows (whole heads), o/down their input columns, and the partial outputs of o and down are summed
with an all-reduce on the process group (the runner's ``all_reduce`` hook). Grouped-query
attention: the KV heads are divided between the ranks, or, with fewer KV heads than ranks, each
KV head is replicated on the ranks whose query heads use it. The KV cache then holds only the
rank's KV heads. The lm_head is split by vocabulary and the logit slices gathered on rank 0
(``split``), or kept whole on every rank (``replicated``: only rank 0 computes it); the faster
one is the default (docs/results.md, "Tensor parallelism on a CPU").

Int8 weights (per-output-row scales) and vocabulary subsets shard too: a row slice keeps its
rows' scales, and a column slice keeps every row's scale, so the sharded sums equal the unsharded
int8 matmul up to summation order.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

from specdec.core.packed import PackedWeight
from specdec.core.quant import Int8Weight, Weight
from specdec.core.runner import ModelRunner, RunnerError

log = logging.getLogger(__name__)

LM_HEAD_MODES = ("split", "replicated")
# The faster of the two in `specdec bench runner --tp 2` (Qwen 1.5B bf16, CPU; docs/results.md): the
# split mode's extra gather costs more than rank 0 reading the whole lm_head. Re-measure on GPUs.
DEFAULT_LM_HEAD = "replicated"

__all__ = [
    "TPError",
    "TPPlan",
    "LM_HEAD_MODES",
    "DEFAULT_LM_HEAD",
    "plan_shard",
    "check_shardable",
    "check_model",
    "shard_runner",
]


class TPError(ValueError):
    """The model cannot be sharded over this many ranks (raised at start-up, before any work)."""


@dataclass(frozen=True)
class TPPlan:
    """Rank `rank`'s share of one model over `world` ranks (head and row ranges)."""

    rank: int
    world: int
    heads: tuple[int, int]  # query heads [lo, hi)
    kv_heads: tuple[int, int]  # KV heads [lo, hi)
    mlp: tuple[int, int]  # MLP channels [lo, hi)

    @property
    def num_heads(self) -> int:
        return self.heads[1] - self.heads[0]

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]


def check_shardable(heads: int, kv_heads: int, mlp: int, world: int, model: str = "the model") -> None:
    """Raise TPError, naming the model and the rank count, unless whole heads divide over `world`."""
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise TPError(f"tensor_parallel must be an integer >= 1 (got {world!r})")
    if world == 1:
        return
    problems = []
    if heads % world:
        problems.append(f"its {heads} attention heads do not divide by {world}")
    if kv_heads % world and world % kv_heads:
        problems.append(f"its {kv_heads} KV heads neither divide by {world} nor divide {world}")
    if mlp % world:
        problems.append(f"its MLP width {mlp} does not divide by {world}")
    if problems:
        raise TPError(
            f"{model} cannot be sharded over tensor_parallel={world} ranks: {'; '.join(problems)} "
            "(each rank keeps whole heads)"
        )


def check_model(spec: str, world: int) -> None:
    """:func:`check_shardable` for a model spec (reads its config only): fail before starting ranks."""
    from specdec.core.models import load_config

    config = load_config(spec)
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    check_shardable(heads, kv_heads, config.intermediate_size, world, spec)


def plan_shard(heads: int, kv_heads: int, mlp: int, rank: int, world: int, model: str = "the model") -> TPPlan:
    check_shardable(heads, kv_heads, mlp, world, model)
    if not 0 <= rank < world:
        raise TPError(f"rank {rank} outside [0, {world})")
    local = heads // world
    if kv_heads >= world:
        local_kv = kv_heads // world
        kv = (rank * local_kv, (rank + 1) * local_kv)
    else:  # fewer KV heads than ranks: the one KV head this rank's query heads use, replicated
        group = world // kv_heads  # ranks sharing one KV head
        kv = (rank // group, rank // group + 1)
    width = mlp // world
    return TPPlan(rank, world, (rank * local, (rank + 1) * local), kv, (rank * width, (rank + 1) * width))


def _copy(t: torch.Tensor) -> torch.Tensor:
    # A slice is a view of the whole matrix: copy it so the unsharded weights can be freed.
    return t.clone(memory_format=torch.contiguous_format)


def _plain(w: torch.Tensor | PackedWeight) -> torch.Tensor:
    # a packed weight is packed again for the shard (shard_runner)
    return w.source if isinstance(w, PackedWeight) else w


def _rows(w: Weight, lo: int, hi: int) -> Weight:
    if isinstance(w, Int8Weight):
        return Int8Weight(_copy(w.q[lo:hi]), _copy(w.scale[lo:hi]), _copy(_plain(w.dense)[lo:hi]))
    return _copy(_plain(w)[lo:hi])


def _cols(w: Weight, lo: int, hi: int) -> Weight:
    if isinstance(w, Int8Weight):  # per-row scales hold for any subset of a row's columns
        return Int8Weight(_copy(w.q[:, lo:hi]), w.scale, _copy(_plain(w.dense)[:, lo:hi]))
    return _copy(_plain(w)[:, lo:hi])


def _bias(b: torch.Tensor | None, lo: int, hi: int) -> torch.Tensor | None:
    return None if b is None else _copy(b[lo:hi])


def _pad_rows(w: Weight, rows: int) -> Weight:
    """`w` with zero rows appended up to `rows` (equal shards for the gather)."""
    extra = rows - w.shape[0]
    if extra == 0:
        return w
    if isinstance(w, Int8Weight):
        return Int8Weight(
            torch.cat([w.q, w.q.new_zeros(extra, w.q.shape[1])]),
            torch.cat([w.scale, w.scale.new_ones(extra)]),
            torch.cat([w.dense, w.dense.new_zeros(extra, w.dense.shape[1])]),
        )
    return torch.cat([w, w.new_zeros(extra, w.shape[1])])


class _Gather:
    """The lm_head hook of a vocabulary-split runner: rank 0 gets the whole row of logits."""

    def __init__(self, rank: int, world: int, width: int, group):
        self.rank, self.world, self.width, self.group = rank, world, width, group

    def __call__(self, local: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(local) for _ in range(self.world)] if self.rank == 0 else None
        dist.gather(local.contiguous(), parts, dst=0, group=self.group)
        if self.rank != 0:  # the followers' logits are never read
            return local.new_empty(local.shape[0], self.width)
        return torch.cat(parts, dim=-1)[:, : self.width]


class _AllReduce:
    def __init__(self, group):
        self.group = group

    def __call__(self, x: torch.Tensor) -> None:
        dist.all_reduce(x, group=self.group)


def shard_runner(
    runner: ModelRunner,
    rank: int,
    world: int,
    group=None,
    lm_head: str = DEFAULT_LM_HEAD,
    model: str = "the model",
) -> TPPlan:
    """Keep rank `rank`'s shard of `runner` (in place) and sum partial outputs over `group`.

    Call on a fresh runner (no slot in use): the KV cache is reallocated for the rank's KV heads.
    Every rank must call it with the same arguments but its own rank.
    """
    if lm_head not in LM_HEAD_MODES:
        raise TPError(f"lm_head must be one of {LM_HEAD_MODES} (got {lm_head!r})")
    if runner.free_slots != runner.num_slots:
        raise RunnerError("shard_runner needs a runner with no slot in use")
    mlp = runner.layers[0].gate.shape[0]
    plan = plan_shard(runner.num_heads, runner.num_kv_heads, mlp, rank, world, model)
    if world == 1:
        return plan
    d = runner.head_dim
    q_lo, q_hi = plan.heads[0] * d, plan.heads[1] * d
    kv_lo, kv_hi = plan.kv_heads[0] * d, plan.kv_heads[1] * d
    m_lo, m_hi = plan.mlp
    for w in runner.layers:
        w.q, w.q_bias = _rows(w.q, q_lo, q_hi), _bias(w.q_bias, q_lo, q_hi)
        w.k, w.k_bias = _rows(w.k, kv_lo, kv_hi), _bias(w.k_bias, kv_lo, kv_hi)
        w.v, w.v_bias = _rows(w.v, kv_lo, kv_hi), _bias(w.v_bias, kv_lo, kv_hi)
        w.o = _cols(w.o, q_lo, q_hi)
        w.gate, w.up = _rows(w.gate, m_lo, m_hi), _rows(w.up, m_lo, m_hi)
        w.down = _cols(w.down, m_lo, m_hi)
    runner.num_heads, runner.num_kv_heads = plan.num_heads, plan.num_kv_heads
    runner.alloc_kv_cache()  # this rank's kv heads only
    runner.all_reduce = _AllReduce(group)
    if lm_head == "split":
        width = runner.lm_head.shape[0]  # the vocabulary, or its subset
        chunk = -(-width // world)
        lo, hi = min(rank * chunk, width), min((rank + 1) * chunk, width)
        runner.lm_head = _pad_rows(_rows(runner.lm_head, lo, hi), chunk)
        runner.gather_logits = _Gather(rank, world, width, group)
    if runner.packed:
        runner.pack_weights()  # the shards, and the padding rule for their shapes
    log.info(
        "%s: rank %d/%d keeps heads %s, KV heads %s, MLP %s, lm_head %s",
        model,
        rank,
        world,
        plan.heads,
        plan.kv_heads,
        plan.mlp,
        lm_head,
    )
    return plan
