"""Router settings: queue and batch sizes, the k policy, pipelining, fail-open deadlines, ports,
and one section per policy decision, each defined beside the decision it configures:

* ``drafter_choice``: which drafter serves a request (router/drafter_choice.py);
* ``draft_depth``: how deep to draft (router/draft_depth.py);
* ``speculation_off``: when speculation switches off under load (router/speculation_off.py);
* ``target_choice``: which target gets a request (router/target_choice.py);
* ``scaling``: how big each pool is (router/pool_size.py);
* ``rebalance``: whether the router rebalances at all, and how often it re-plans (here).

A plain dataclass (no torch, no Ray): `cluster/` builds it from the YAML config's ``router``
section, tests build it directly.
"""

from __future__ import annotations

import dataclasses
from dataclasses import InitVar, dataclass, field
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt, StrictBool, StrictInt

from router.draft_depth import DraftDepthConfig
from router.drafter_choice import DrafterChoiceConfig
from router.pool_size import PoolSizeConfig
from router.speculation_off import SpeculationOffConfig
from router.target_choice import TargetChoiceConfig
from specdec.core.prefill_plan import DEFAULT_BUDGET, DEFAULT_CHUNK
from specdec.core.request_state import KPolicy
from specdec.rpc.config_model import Port, check_fields
from specdec.rpc.grpc_options import DEFAULT_MAX_MESSAGE_BYTES, ConnectionLimits
from specdec.rpc.worker_config import strict_from_dict

__all__ = ["RouterConfig", "RebalanceConfig", "LEGACY_KEYS", "kpolicy_from_dict", "move_legacy_keys"]

# Keys of the ``rebalance`` section before it was split by decision, and where each lives now
# (section, key): configurations that still write them keep working.
LEGACY_KEYS: dict[str, tuple[str, str]] = {
    "latency_weight": ("drafter_choice", "latency_weight"),
    "stale_s": ("drafter_choice", "stale_s"),
    "forget_s": ("drafter_choice", "forget_s"),
    "move_margin": ("drafter_choice", "move_margin"),
    "move_cooldown_s": ("drafter_choice", "move_cooldown_s"),
    "util_weight": ("drafter_choice", "util_weight"),
    "hot_utilization": ("drafter_choice", "hot_utilization"),
    "low_utilization": ("draft_depth", "low_utilization"),
    "high_utilization": ("draft_depth", "high_utilization"),
    "band": ("draft_depth", "band"),
    "growth_saturated": ("draft_depth", "growth_saturated"),
    "depth_samples": ("draft_depth", "samples"),
    "depth_cooldown_s": ("draft_depth", "cooldown_s"),
    "deep_wait_share": ("draft_depth", "deep_wait_share"),
    "deep_extra_k": ("draft_depth", "deep_extra_k"),
    "deep_cost_scale": ("draft_depth", "deep_cost_scale"),
    "spec_off_margin": ("speculation_off", "off_margin"),
    "spec_on_margin": ("speculation_off", "on_margin"),
    "spec_min_evidence": ("speculation_off", "min_evidence"),
    "spec_cooldown_s": ("speculation_off", "cooldown_s"),
    "saturated_penalty": ("target_choice", "saturated_penalty"),
}
_SECTIONS = {
    "drafter_choice": DrafterChoiceConfig,
    "draft_depth": DraftDepthConfig,
    "speculation_off": SpeculationOffConfig,
    "target_choice": TargetChoiceConfig,
}


@dataclass(frozen=True)
class RebalanceConfig:
    """The router config's ``rebalance`` section: whether the router rebalances, and how often.

    enabled: False = static pairing (each target drafts on its own drafter, depth by acceptance
      only, no goodput switch): what the router did before the rebalancer.
    period_s: how often the router polls worker telemetry and re-plans depth and pool sizes.

    The section's older keys (``move_margin``, ``spec_off_margin``, ...) are still accepted: the
    router config moves each into its decision's section (:data:`LEGACY_KEYS`).
    """

    # suggested for a typo'd older key (specdec.rpc.config_model); the keys themselves: move_legacy_keys
    __moved_keys__: ClassVar[dict[str, str]] = {old: f"router.{sec}.{key}" for old, (sec, key) in LEGACY_KEYS.items()}

    enabled: StrictBool = True
    period_s: PositiveFloat = 1.0

    def __post_init__(self) -> None:
        check_fields(self, "router.rebalance")

    @classmethod
    def from_dict(cls, d: dict | RebalanceConfig | None) -> RebalanceConfig:
        return d if isinstance(d, cls) else strict_from_dict(cls, d, "router.rebalance")


def move_legacy_keys(d: dict[str, Any]) -> dict[str, Any]:
    """A ``router`` section with the older keys (``rebalance``'s flat ones, :data:`LEGACY_KEYS`, and
    the top-level ``auto_off_batch``) moved into their decision's section; one written under both
    names is refused. The sections may be mappings or built sections."""
    d = dict(d)
    moves: list[tuple[str, str, str, Any]] = []
    rebalance = d.get("rebalance")
    if isinstance(rebalance, dict):
        rebalance = dict(rebalance)
        for old in [k for k in rebalance if k in LEGACY_KEYS]:
            moves.append((f"router.rebalance.{old}", *LEGACY_KEYS[old], rebalance.pop(old)))
        d["rebalance"] = rebalance
    if d.get("auto_off_batch") is not None:
        moves.append(("router.auto_off_batch", "speculation_off", "auto_off_batch", d["auto_off_batch"]))
    d.pop("auto_off_batch", None)
    for old, section, key, value in moves:
        sec = d.get(section)
        if sec is None or isinstance(sec, dict):
            sec = dict(sec or {})
            if key in sec:
                raise ValueError(f"{old} and router.{section}.{key} are the same setting: write it once")
            sec[key] = value
        elif dataclasses.is_dataclass(sec):
            sec = dataclasses.replace(sec, **{key: value})
        else:
            continue  # not a section at all: the model says so
        d[section] = sec
    return d


def kpolicy_from_dict(d: dict | KPolicy | None) -> KPolicy:
    if d is None:
        return KPolicy(k=4, adaptive=True, k_min=1, k_max=12)
    if isinstance(d, KPolicy):
        return d
    return strict_from_dict(KPolicy, d, "router.k_policy")


@dataclass
class RouterConfig:
    """How the router serves.

    host / port: the public gRPC ``specdec.v1.Generation`` endpoint (port 0 = any free port).
    metrics_host / metrics_port: Prometheus ``/metrics`` over HTTP (port 0 = any free port,
      None = no HTTP endpoint; the registry is still there).
    http_port: the OpenAI-compatible HTTP API on ``host`` (0 or None = off). Served by its own
      process (``gateway/``), which ``specdec serve`` starts beside the router; the router itself
      never serves HTTP but /metrics.
    max_queue: requests waiting for a batch slot, per target worker; beyond it RESOURCE_EXHAUSTED.
    max_batch: requests decoded together per target worker (0 = the target's KV slots).
    default_max_tokens: used when a request leaves max_tokens at 0 (capped by the context).
    max_prompt_bytes: the largest prompt text accepted, in UTF-8 bytes, checked before it is
      tokenized; 0 = 32 bytes per token of the model's context (router.validate).
    k_policy: draft length: fixed k, or adaptive per request within [k_min, k_max] (the core's
      AdaptiveK); a request's own ``speculation.k`` is capped at ``k_policy.k_max``.
    default_mode: what SPECULATION_MODE_AUTO / UNSPECIFIED means: "draft" (the draft worker;
      n-gram when the deployment has none), "ngram" or "off".
    auto_off_batch: still accepted here: ``speculation_off.auto_off_batch``.
    micro_batches: pipelining lanes per target: with 2, while the target verifies one micro-batch
      the drafter drafts for the other. 1 = no micro-batching.
    split_min_batch: split into micro-batches only with at least this many running requests
      (below it one batch: splitting a small, memory-bound batch only doubles target steps).
    predraft: while the target verifies round r, the drafter drafts round r+1 on the guess that
      all of round r is accepted (PEARL); used when the guess proves right, discarded otherwise.
    draft_deadline_s / draft_deadline_factor / draft_deadline_min_s: a round waits for its drafts
      at most factor x (k + 1) recent Verify times (a draft slower than that cannot pay for
      itself), clamped to [min, draft_deadline_s] (factor 0: always draft_deadline_s). A later
      draft fails open: the round verifies with k = 0; while the drafter is still busy with the
      late draft, rounds fail open without waiting, and speculation resumes when it has caught up.
    max_batched_tokens: the token budget of a plain round: the running requests' verify rows (k + 1
      each) first, then prompt chunks (specdec.core.prefill_plan); a speculative round's is this
      times the tokens a request commits per round (prefill_plan.round_budget); <= 0 turns the
      budget off (a prompt is cached whole in its first round).
    prefill_chunk: prompts are cached in chunks whose boundaries are multiples of this size,
      whatever the load, so a prompt's KV (and, in bf16, its output) never depends on other traffic.
    rpc_timeout_s: timeout of one Verify / Prefill / Tokenize call to a worker.
    recovery_timeout_s: how long requests wait for a restarted target before UNAVAILABLE.
    ngram_max / ngram_min: window of the router's local n-gram drafter.
    grace_s: on shutdown, time given to running requests before they end UNAVAILABLE.
    rebalance: :class:`RebalanceConfig` fields: ``enabled: false`` = static pairing; the period.
    drafter_choice: :class:`router.drafter_choice.DrafterChoiceConfig` fields: the shared drafter pool.
    draft_depth: :class:`router.draft_depth.DraftDepthConfig` fields: depth by device load.
    speculation_off: :class:`router.speculation_off.SpeculationOffConfig` fields: the batch-size gate
      and speculation off by goodput.
    target_choice: :class:`router.target_choice.TargetChoiceConfig` fields: routing by load.
    scaling: :class:`router.pool_size.PoolSizeConfig` fields: pool sizes (off unless ``enabled``).
    fair_share: each client (its bearer token, else its address, as for max_inflight_per_client)
      gets its share of the batch slots and of each round's prefill budget while other clients
      wait: a free slot goes to the waiting client with the fewest requests running, and clients
      take turns at the round's prompt chunks (router.batching.next_admission,
      specdec.core.prefill_plan). A client alone still gets everything. False = first come first
      served by request.
    max_inflight_per_client: Generation calls one client (its bearer token, else its address) may
      have running at once; beyond it RESOURCE_EXHAUSTED with a RetryInfo (router.client_limit).
      0 = no limit. Raise it when one backend fronts many users without tokens of their own.
    max_message_bytes: the largest request (and reply) on the public port, in bytes.
    keepalive_time_s / keepalive_timeout_s: the public server pings each connection this often
      and drops it when a ping goes unanswered this long (a frozen or vanished client): its calls
      are cancelled and their KV slots freed (specdec.rpc.grpc_options).
    stream_write_timeout_s: a stream chunk the client does not take within this long (it stopped
      reading: gRPC's flow-control window stays full) ends the call as CANCELLED and frees its KV
      slots, whatever keepalive does (docs/design.md, "API").
    max_connection_idle_s: a connection without a call this long is closed (None: never).
    max_connection_age_s / max_connection_age_grace_s: every connection is told to go away after
      this long, and its running calls are cut after the grace (None: never): the bound on a call
      whose client keeps the connection alive but never reads.
    """

    host: str = "127.0.0.1"
    port: Port = 50051
    metrics_host: str = "127.0.0.1"
    metrics_port: Port | None = 9400
    http_port: Port | None = 8000
    max_queue: PositiveInt = 64
    max_batch: NonNegativeInt = 0
    default_max_tokens: PositiveInt = 256
    max_prompt_bytes: NonNegativeInt = 0
    k_policy: KPolicy = field(default_factory=lambda: KPolicy(k=4, adaptive=True, k_min=1, k_max=12))
    default_mode: Literal["draft", "ngram", "off"] = "draft"
    auto_off_batch: InitVar[int | None] = None
    micro_batches: PositiveInt = 2
    split_min_batch: PositiveInt = 4
    predraft: StrictBool = False
    draft_deadline_s: PositiveFloat = 5.0
    draft_deadline_factor: NonNegativeFloat = 2.0  # 0 = a fixed deadline
    draft_deadline_min_s: PositiveFloat = 0.05
    max_batched_tokens: StrictInt = DEFAULT_BUDGET
    prefill_chunk: PositiveInt = DEFAULT_CHUNK
    rpc_timeout_s: PositiveFloat = 120.0
    recovery_timeout_s: PositiveFloat = 300.0
    ngram_max: PositiveInt = 3
    ngram_min: PositiveInt = 1
    grace_s: NonNegativeFloat = 5.0
    rebalance: RebalanceConfig = field(default_factory=RebalanceConfig)
    drafter_choice: DrafterChoiceConfig = field(default_factory=DrafterChoiceConfig)
    draft_depth: DraftDepthConfig = field(default_factory=DraftDepthConfig)
    speculation_off: SpeculationOffConfig = field(default_factory=SpeculationOffConfig)
    target_choice: TargetChoiceConfig = field(default_factory=TargetChoiceConfig)
    scaling: PoolSizeConfig = field(default_factory=PoolSizeConfig)
    fair_share: StrictBool = True
    max_inflight_per_client: NonNegativeInt = 32
    max_message_bytes: Annotated[int, Field(ge=1024)] = DEFAULT_MAX_MESSAGE_BYTES
    keepalive_time_s: PositiveFloat = 30.0
    keepalive_timeout_s: PositiveFloat = 10.0
    stream_write_timeout_s: PositiveFloat = 30.0
    # None: no limit
    max_connection_idle_s: PositiveFloat | None = 600.0
    max_connection_age_s: PositiveFloat | None = 3600.0
    max_connection_age_grace_s: PositiveFloat | None = 600.0

    __moved_keys__: ClassVar[dict[str, str]] = {"auto_off_batch": "router.speculation_off.auto_off_batch"}

    @property
    def pipelined(self) -> bool:
        """Drafting overlaps the verify (pre-drafts, or micro-batches): the draft and the target
        worker then compute at the same time."""
        return self.predraft or self.micro_batches > 1

    def __post_init__(self, auto_off_batch: int | None) -> None:
        self.k_policy = kpolicy_from_dict(self.k_policy)
        if isinstance(self.rebalance, dict) or auto_off_batch is not None:  # built directly, as tests do
            sections = ("rebalance", *_SECTIONS)
            moved = move_legacy_keys({s: getattr(self, s) for s in sections} | {"auto_off_batch": auto_off_batch})
            for s in sections:
                setattr(self, s, moved[s])
        self.rebalance = RebalanceConfig.from_dict(self.rebalance)
        for name, cls in _SECTIONS.items():
            setattr(self, name, cls.from_dict(getattr(self, name)))
        self.scaling = PoolSizeConfig.from_dict(self.scaling)
        check_fields(self, "router")  # the fields' types above: as the model checks a file's
        if self.k_policy.k < 0 or self.k_policy.k_max < 0:
            raise ValueError("router.k_policy: k and k_max must be >= 0")

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> RouterConfig:
        """The ``router`` section through its typed model (:mod:`specdec.rpc.config_model`), after
        the older keys are moved to their sections."""
        return strict_from_dict(cls, move_legacy_keys(d or {}), "router")

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        return out

    def connection_limits(self) -> ConnectionLimits:
        """What the public server allows each connection (specdec.rpc.grpc_options)."""
        return ConnectionLimits(
            max_message_bytes=self.max_message_bytes,
            keepalive_time_s=self.keepalive_time_s,
            keepalive_timeout_s=self.keepalive_timeout_s,
            max_connection_idle_s=self.max_connection_idle_s,
            max_connection_age_s=self.max_connection_age_s,
            max_connection_age_grace_s=self.max_connection_age_grace_s,
            # No HTTP/2 stream limit: gRPC refuses streams past it with a bare UNAVAILABLE ("Stream
            # removed", no RetryInfo) before the handler runs; the per-client limit and the queue
            # bound answer a burst instead, RESOURCE_EXHAUSTED with RetryInfo (test_api.py).
            max_concurrent_streams=None,
        )
