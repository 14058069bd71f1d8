"""The deployment config of ``specdec serve``: Ray, the target and draft pools, the router.

YAML (see ``configs/default.yaml``)::

    ray:      {address: null | "auto" | "host:port", namespace, num_cpus, resources}
    target:   {model, name, tokenizer, replicas, tensor_parallel, dtype, device, num_slots, max_len, threads,
               placement, ...}
    draft:    {model | "ngram", replicas, dtype, ..., placement}   # or null: no draft pool
    router:   router.config.RouterConfig fields (host, port, metrics_port, k_policy, ...)
    security: specdec.rpc.api_security.SecurityConfig fields (TLS, bearer tokens, worker secret)

``ray.address`` null starts an embedded local Ray cluster in the serving process (logical CPUs
and the custom resources ``draft_gpu`` / ``target_gpu`` sized for the pools); "auto" joins the
running cluster (``ray up`` / ``ray start``). Worker keys other than replicas / placement / name /
tokenizer / tensor_parallel / tp_timeout_s go to :class:`specdec.rpc.worker_config.WorkerConfig`.

Torch-free and Ray-free: the CLI parses and validates a config before starting anything.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from router.config import RouterConfig
from specdec.rpc.api_security import SecurityConfig
from specdec.rpc.worker_config import WorkerConfig, strict_from_dict

__all__ = ["PoolConfig", "RayConfig", "ServeConfig", "load_config", "DEFAULT_CONFIG", "default_threads"]

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "default.yaml"

# Target keys a draft pool made from the target section (``--draft`` without one) does not copy.
_DRAFT_SKIPS = ("name", "tokenizer", "placement", "threads", "replicas", "tensor_parallel", "tp_timeout_s")
_POOL_KEYS = {"replicas", "placement", "name", "tokenizer", "tensor_parallel", "tp_timeout_s"}


def default_threads(role: str, cores: int | None = None, pipelined: bool = False) -> int:
    """Torch threads per worker when the config leaves ``threads`` unset.

    The draft and the target worker are separate processes on one machine (the embedded default).
    When rounds alternate (no pre-drafting, one micro-batch: the default), only one of them computes
    at a time, so each gets every core (faster than splitting them: docs/results.md, "Small costs
    behind rules in the code"). When drafting overlaps the verify (``router.predraft`` or
    ``router.micro_batches`` > 1) the cores are split instead, never oversubscribed, since two OpenMP
    teams on the same cores wait on each other's descheduled threads: the drafter gets 1 core (2
    above 4 cores), the target the rest. Set ``threads`` in the config to override, e.g. for several
    replicas on one machine.
    """
    cores = cores or os.cpu_count() or 1
    if not pipelined:
        return cores
    draft = 1 if cores <= 4 else 2
    if role == "draft":
        return draft
    return max(1, cores - draft)


@dataclass
class PoolConfig:
    worker: WorkerConfig
    replicas: int = 1
    placement: dict | None = None
    name: str | None = None  # the model name clients use (default: worker.model)
    tokenizer: str | None = None  # target only: a local tokenizer.json folder (default: the worker sends it)
    # Target only: ranks per worker (one placement-group bundle each, all on one node); they split
    # the worker's threads. A collective waiting longer than tp_timeout_s restarts the group.
    tensor_parallel: int = 1
    tp_timeout_s: float = 60.0

    @property
    def model_name(self) -> str:
        return self.name or self.worker.model

    @property
    def actors(self) -> int:
        """Worker processes the pool runs (each takes one bundle of ``placement``)."""
        return self.replicas * self.tensor_parallel

    @classmethod
    def from_dict(cls, d: dict[str, Any], role: str, pipelined: bool = False) -> PoolConfig:
        d = dict(d)
        pool = {k: d.pop(k) for k in list(d) if k in _POOL_KEYS}
        if "model" not in d:
            raise ValueError(f"{role}: 'model' is required")
        if d.get("threads") in (None, "auto"):
            d["threads"] = default_threads(role, pipelined=pipelined)
        try:
            worker = WorkerConfig.from_dict(d)
        except ValueError as exc:
            raise ValueError(f"{role}: {exc}") from None
        replicas = pool.get("replicas", 1)
        if not isinstance(replicas, int) or replicas < 1:
            raise ValueError(f"{role}.replicas must be an integer >= 1 (got {replicas!r})")
        if role == "target" and worker.model.lower() == "ngram":
            raise ValueError("target.model: a target needs a model, not 'ngram'")
        tp = pool.get("tensor_parallel", 1)
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise ValueError(f"{role}.tensor_parallel must be an integer >= 1 (got {tp!r})")
        if role != "target" and tp != 1:
            raise ValueError(f"{role}.tensor_parallel: only the target pool is tensor-parallel (drafters run at 1)")
        timeout = pool.get("tp_timeout_s", 60.0)
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0:
            raise ValueError(f"{role}.tp_timeout_s must be a number of seconds > 0 (got {timeout!r})")
        return cls(
            worker=worker,
            replicas=replicas,
            placement=pool.get("placement"),
            name=pool.get("name"),
            tokenizer=pool.get("tokenizer"),
            tensor_parallel=tp,
            tp_timeout_s=float(timeout),
        )

    def to_dict(self) -> dict[str, Any]:
        out = self.worker.to_dict()
        out.update(replicas=self.replicas, placement=self.placement, name=self.name, tokenizer=self.tokenizer)
        if self.tensor_parallel != 1:
            out.update(tensor_parallel=self.tensor_parallel, tp_timeout_s=self.tp_timeout_s)
        return out


@dataclass
class RayConfig:
    address: str | None = None  # None: embedded local cluster; "auto": join the running one
    namespace: str = "specdec"
    num_cpus: int | None = None  # embedded only; default max(cores, workers)
    resources: dict[str, float] | None = None  # embedded only; default sized for the pools
    include_dashboard: bool = False
    # Embedded only. Ray starts worker processes at niceness 15 by default; the workers are this
    # service's compute, so on a shared machine they would lose every core to anything else
    # running. 0 = the same priority as the serving process.
    worker_niceness: int | None = 0

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> RayConfig:
        return strict_from_dict(cls, d, "ray")


@dataclass
class ServeConfig:
    target: PoolConfig
    draft: PoolConfig | None
    router: RouterConfig = field(default_factory=RouterConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ServeConfig:
        d = copy.deepcopy(d or {})
        unknown = sorted(set(d) - {"target", "draft", "router", "ray", "security"})
        if unknown:
            raise ValueError(f"config: unknown sections {unknown} (known: ray, target, draft, router, security)")
        if not d.get("target"):
            raise ValueError("config: a 'target' section with a model is required")
        router = RouterConfig.from_dict(d.get("router") or {})
        pipelined = router.pipelined
        draft_d = d.get("draft")
        has_draft = bool(draft_d) and str(draft_d.get("model", "")).lower() not in ("", "none", "off")
        for section in [d["target"]] + ([draft_d] if has_draft else []):
            # the workers refuse drafts longer than any the router asks for
            if section.get("max_k") is None:
                section["max_k"] = router.k_policy.k_max
        target = PoolConfig.from_dict(d["target"], "target", pipelined)
        draft = PoolConfig.from_dict(draft_d, "draft", pipelined) if has_draft else None
        for role, pool in (("target", target), ("draft", draft)):
            if pool is not None and pool.worker.max_k < router.k_policy.k_max:
                raise ValueError(
                    f"{role}.max_k ({pool.worker.max_k}) is below router.k_policy.k_max ({router.k_policy.k_max}): "
                    "the workers would refuse the router's own drafts"
                )
        return cls(
            target=target,
            draft=draft,
            router=router,
            ray=RayConfig.from_dict(d.get("ray")),
            security=SecurityConfig.from_dict(d.get("security")),
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "ray": dataclasses.asdict(self.ray),
            "target": self.target.to_dict(),
            "draft": self.draft.to_dict() if self.draft else None,
            "router": self.router.to_dict() | {"k_policy": dataclasses.asdict(self.router.k_policy)},
            "security": self.security.to_dict(),
        }


def _set_model(section: dict, model: str) -> None:
    section["model"] = model
    section.pop("name", None)  # the new model is named by its own spec
    section.pop("tokenizer", None)


def load_config(
    path: str | Path | None = None,
    *,
    target: str | None = None,
    draft: str | None = None,
    dtype: str | None = None,
    port: int | None = None,
    metrics_port: int | None = None,
    http_port: int | None = None,
    address: str | None = None,
    tensor_parallel: int | None = None,
    security: dict[str, Any] | None = None,
) -> ServeConfig:
    """Read the YAML (default ``configs/default.yaml``) and apply command-line overrides.

    ``draft`` "none" removes the draft pool (the router can still draft with n-grams); ``dtype``
    applies to both pools; ``address`` sets ``ray.address``; ``tensor_parallel`` the target's ranks;
    ``security`` keys replace the section's.
    """
    path = Path(path) if path is not None else DEFAULT_CONFIG
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except OSError as exc:
        raise ValueError(f"cannot read config {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"config {path} is not valid YAML: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"config {path}: expected a mapping at the top level")
    raw.setdefault("target", {})
    raw.setdefault("router", {})
    raw.setdefault("ray", {})
    if target is not None:
        _set_model(raw["target"], target)
    if draft is not None:
        if draft.lower() in ("none", "off", ""):
            raw["draft"] = None
        else:
            if not raw.get("draft"):  # no draft pool in the file: size it like the target
                raw["draft"] = {k: v for k, v in raw["target"].items() if k not in _DRAFT_SKIPS}
            _set_model(raw["draft"], draft)
    if dtype is not None:
        for section in ("target", "draft"):
            if raw.get(section):
                raw[section]["dtype"] = dtype
    if tensor_parallel is not None:
        raw["target"]["tensor_parallel"] = tensor_parallel
    if port is not None:
        raw["router"]["port"] = port
    if metrics_port is not None:
        raw["router"]["metrics_port"] = None if metrics_port < 0 else metrics_port
    if http_port is not None:
        raw["router"]["http_port"] = http_port
    if address is not None:
        raw["ray"]["address"] = None if address in ("", "local", "embedded") else address
    if security:
        raw["security"] = {**(raw.get("security") or {}), **security}
    return ServeConfig.from_dict(raw)
