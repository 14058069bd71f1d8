"""What a round's parts cost, in seconds: a target Verify, a target Prefill, a draft Propose, a draft
prefill, and the router and RPC overheads around them.

Two sources, one interface (:class:`Costs`):

* :class:`ProfileCosts`: measured on a machine by ``specdec profile``, interpolated (as Vidur does
  with its profiled operator tables, at the granularity of a whole forward here).
* :class:`RooflineCosts`: a device of the catalog and a model shape: a forward costs
  max(bytes moved / achieved bandwidth, FLOPs / achieved peak) plus per-layer launch overhead and,
  under tensor parallelism, two all-reduces per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

from cluster.planning.catalog import Catalog, Device, Efficiency, ModelShape
from cluster.planning.profile import Profile, ProfileError

__all__ = ["Costs", "ProfileCosts", "RooflineCosts", "fits", "memory_needed_gb"]


class Costs:
    """Costs of one target group and its drafter (seconds)."""

    draft_is_model: bool = True

    def verify_s(self, batch: int, tokens_per_row: int, context: int) -> float:
        raise NotImplementedError

    def prefill_s(self, rows: int, width: int, context: int = 0) -> float:
        """One Prefill forward: ``rows`` prompt chunks, padded to ``width`` tokens."""
        raise NotImplementedError

    def draft_s(self, batch: int, k: int, context: int) -> float:
        """One Propose of ``k`` tokens for ``batch`` sequences (0 when the drafter is not a model)."""
        raise NotImplementedError

    def draft_prefill_s(self, tokens: int) -> float:
        raise NotImplementedError

    def router_s(self, batch: int) -> float:
        raise NotImplementedError

    verify_rpc_s: float = 0.0
    draft_rpc_s: float = 0.0


class ProfileCosts(Costs):
    """Costs measured by ``specdec profile`` on one machine (the machine's own device and models).

    ``drafts_overlap_verifies``: the draft model runs on the target's device (the simulator's
    colocated deployment, one CPU machine) and the router pipelines drafting (pre-drafts or
    micro-batches), so the calibrated service's speculative Verifies ran beside its drafter's
    work. They are then priced at the plain rounds' calibration scale: the simulator's shared
    device adds that contention itself, and their own scale would count it twice. Where rounds
    alternate (the default) the speculative Verifies ran alone, and their own scale is their cost:
    12-16 % above the plain rounds' at 2-3 rows on the EPYC VM."""

    def __init__(self, profile: Profile, drafter: str = "draft", drafts_overlap_verifies: bool = False):
        self.p = profile
        self.drafts_overlap_verifies = drafts_overlap_verifies
        stats = profile.drafters.get(drafter)
        self.draft_is_model = drafter == "draft"
        if self.draft_is_model and profile.draft_forward is None:
            raise ProfileError(
                "the profile has no draft model; profile one with --draft, or plan with the n-gram drafter"
            )
        self.fixed_ms = stats.draft_ms_fixed if stats else 0.0
        self.per_token_ms = stats.draft_ms_per_token if stats else 0.0
        o = profile.overhead
        self.verify_rpc_s = o.verify_rpc_ms / 1e3
        self.draft_rpc_s = o.draft_rpc_ms / 1e3 if self.draft_is_model else 0.0
        self._router = (o.router_ms / 1e3, o.router_ms_per_row / 1e3)
        self._overhead = o

    def verify_s(self, batch: int, tokens_per_row: int, context: int) -> float:
        scale = self._overhead.verify_scale_at(batch, 1 if self.drafts_overlap_verifies else tokens_per_row)
        return self.p.target_forward.at(batch, tokens_per_row) * scale / 1e3

    def prefill_s(self, rows: int, width: int, context: int = 0) -> float:
        return self.p.target_prefill.at(rows * width) * self._overhead.prefill_scale / 1e3

    def draft_s(self, batch: int, k: int, context: int) -> float:
        if not self.draft_is_model or k <= 0:
            return 0.0
        propose_ms = self._overhead.propose_ms(self.p.draft_propose, batch, k)
        if propose_ms is not None:
            return propose_ms / 1e3
        grid = self.p.draft_forward
        assert grid is not None
        batch_scale = grid.at(batch, 1) / grid.at(1, 1)
        if self.per_token_ms > 0:  # measured rounds of the real drafter (its lookup guesses included)
            return (self.fixed_ms + self.per_token_ms * k) * batch_scale / 1e3
        return (grid.at(batch, 2) + (k - 1) * grid.at(batch, 1)) / 1e3

    def draft_prefill_s(self, tokens: int) -> float:
        if not self.draft_is_model or self.p.draft_prefill is None:
            return 0.0
        return self.p.draft_prefill.at(tokens) * self._overhead.draft_prefill_scale / 1e3

    def router_s(self, batch: int) -> float:
        return self._router[0] + self._router[1] * batch


def _forward_s(model: ModelShape, dev: Device, tp: int, eff: Efficiency, rows: int, width: int, context: int) -> float:
    tokens = rows * width
    weights = model.weight_bytes / tp
    kv = rows * (context + width) * model.kv_bytes_per_token / tp
    flops = 2.0 * model.params_b * 1e9 * tokens / tp
    flops += 4.0 * model.layers * model.heads * model.head_dim * tokens * (context + width) / tp
    t_mem = (weights + kv) / (dev.bandwidth_gbs * 1e9 * eff.memory_bandwidth)
    t_flop = flops / (dev.bf16_tflops * 1e12 * eff.compute)
    t = max(t_mem, t_flop) + model.layers * eff.forward_overhead_ms_per_layer / 1e3
    if tp > 1:  # two ring all-reduces of the activations per layer
        act = tokens * model.hidden * 2.0
        ring = 2.0 * (tp - 1) / tp * act / (dev.link_gbs * 1e9) + eff.allreduce_latency_us / 1e6
        t += 2 * model.layers * ring
    return t


def memory_needed_gb(model: ModelShape, tp: int, batch: int, context: int) -> float:
    """Per device: weights and the KV cache of ``batch`` sequences of ``context`` tokens, plus 10 %
    for activations and the runtime."""
    return 1.1 * (model.weight_bytes + batch * context * model.kv_bytes_per_token) / tp / 1e9


def fits(model: ModelShape, dev: Device, tp: int, batch: int, context: int) -> bool:
    return memory_needed_gb(model, tp, batch, context) <= 0.9 * dev.memory_gb


@dataclass
class RooflineCosts(Costs):
    """A target group (``target`` at TP ``tp`` on ``target_dev``) and a draft model on ``draft_dev``
    (TP 1), from datasheet peaks and the catalog's efficiencies."""

    target: ModelShape
    target_dev: Device
    tp: int
    draft: ModelShape | None
    draft_dev: Device | None
    catalog: Catalog

    def __post_init__(self) -> None:
        net = self.catalog.network
        self.draft_is_model = self.draft is not None
        self.verify_rpc_s = net.get("verify_rpc_ms", 0.5) / 1e3
        self.draft_rpc_s = net.get("draft_rpc_ms", 0.5) / 1e3 if self.draft_is_model else 0.0
        self._router = (net.get("router_ms", 0.5) / 1e3, net.get("router_ms_per_row", 0.02) / 1e3)

    def verify_s(self, batch: int, tokens_per_row: int, context: int) -> float:
        eff = self.catalog.efficiency
        return _forward_s(self.target, self.target_dev, self.tp, eff, batch, tokens_per_row, context)

    def prefill_s(self, rows: int, width: int, context: int = 0) -> float:
        eff = self.catalog.efficiency
        return _forward_s(self.target, self.target_dev, self.tp, eff, rows, width, context)

    def draft_s(self, batch: int, k: int, context: int) -> float:
        if self.draft is None or self.draft_dev is None or k <= 0:
            return 0.0
        eff = self.catalog.efficiency
        step = _forward_s(self.draft, self.draft_dev, 1, eff, batch, 1, context)
        first = _forward_s(self.draft, self.draft_dev, 1, eff, batch, 2, context)  # it catches up one token
        return first + (k - 1) * step

    def draft_prefill_s(self, tokens: int) -> float:
        if self.draft is None or self.draft_dev is None:
            return 0.0
        return _forward_s(self.draft, self.draft_dev, 1, self.catalog.efficiency, 1, tokens, 0)

    def router_s(self, batch: int) -> float:
        return self._router[0] + self._router[1] * batch
