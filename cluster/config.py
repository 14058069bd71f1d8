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

:class:`ServeConfig` is the one typed model of a file: pydantic validates the mapping against these
dataclasses (specdec/rpc/config_model.py). A file names only what differs from the model's
defaults; unknown keys and wrong types are refused with their path, every problem at once
(tests/unit/test_config_model.py). ``specdec config schema`` prints its JSON Schema.

Torch-free and Ray-free: the CLI parses and validates a config before starting anything.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, ClassVar

import yaml
from pydantic import Field

from router.config import RebalanceConfig, RouterConfig, move_legacy_keys
from specdec.rpc.api_security import SecurityConfig
from specdec.rpc.config_model import ConfigError, json_schema, validate
from specdec.rpc.worker_config import WorkerConfig, strict_from_dict

__all__ = [
    "PoolConfig",
    "RayConfig",
    "ServeConfig",
    "ConfigError",
    "load_config",
    "read_config",
    "schema",
    "DEFAULT_CONFIG",
    "DEFAULT_TARGET_MODEL",
    "default_threads",
]

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "default.yaml"
DEFAULT_TARGET_MODEL = "qwen2.5-coder-1.5b-instruct"  # the target of configs/default.yaml

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
    """A target or draft pool. In the file its worker's keys sit beside the pool's own
    (``__flat_field__``: specdec.rpc.config_model)."""

    __flat_field__: ClassVar[str] = "worker"

    worker: WorkerConfig
    replicas: Annotated[int, Field(ge=1)] = 1
    placement: dict | None = None
    name: str | None = None  # the model name clients use (default: worker.model)
    tokenizer: str | None = None  # target only: a local tokenizer.json folder (default: the worker sends it)
    # Target only: ranks per worker (one placement-group bundle each, all on one node); they split
    # the worker's threads. A collective waiting longer than tp_timeout_s restarts the group.
    tensor_parallel: Annotated[int, Field(ge=1)] = 1
    tp_timeout_s: Annotated[float, Field(gt=0)] = 60.0

    @property
    def model_name(self) -> str:
        return self.name or self.worker.model

    @property
    def actors(self) -> int:
        """Worker processes the pool runs (each takes one bundle of ``placement``)."""
        return self.replicas * self.tensor_parallel

    @classmethod
    def from_dict(cls, d: dict[str, Any], role: str, pipelined: bool = False) -> PoolConfig:
        pool = validate(cls, _nested(d), role)
        pool.check_role(role)
        pool.fill_threads(role, pipelined)
        return pool

    def check_role(self, role: str) -> None:
        if role == "target" and self.worker.model.lower() == "ngram":
            raise ValueError("target.model: a target needs a model, not 'ngram'")
        if role != "target" and self.tensor_parallel != 1:
            raise ValueError(f"{role}.tensor_parallel: only the target pool is tensor-parallel (drafters run at 1)")

    def fill_threads(self, role: str, pipelined: bool) -> None:
        """``threads`` left unset (or "auto"): :func:`default_threads` for the router's mode."""
        if self.worker.threads is None:
            self.worker.threads = default_threads(role, pipelined=pipelined)

    def to_dict(self) -> dict[str, Any]:
        out = self.worker.to_dict()
        out.update(replicas=self.replicas, placement=self.placement, name=self.name, tokenizer=self.tokenizer)
        if self.tensor_parallel != 1:
            out.update(tensor_parallel=self.tensor_parallel, tp_timeout_s=self.tp_timeout_s)
        return out


def _nested(section: dict[str, Any]) -> dict[str, Any]:
    """A pool section as the file writes it (worker keys beside the pool's) -> PoolConfig's shape."""
    d = dict(section)
    if d.get("threads") == "auto":
        d["threads"] = None
    pool = {k: d.pop(k) for k in list(d) if k in _POOL_KEYS}
    return {**pool, "worker": d}


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
    """The whole serve configuration: the typed model every config file is validated against
    (``specdec config check``; ``specdec config schema`` prints its JSON Schema)."""

    target: PoolConfig = field(default_factory=lambda: PoolConfig(WorkerConfig(DEFAULT_TARGET_MODEL)))
    draft: PoolConfig | None = None
    router: RouterConfig = field(default_factory=RouterConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)

    def __post_init__(self) -> None:
        """The rules across sections (they run inside the model's validation, after each section's own)."""
        self.target.check_role("target")
        if self.draft is not None:
            self.draft.check_role("draft")
        k_max = self.router.k_policy.k_max
        for role, pool in (("target", self.target), ("draft", self.draft)):
            if pool is None:
                continue
            pool.fill_threads(role, self.router.pipelined)
            if pool.worker.max_k < k_max:
                raise ValueError(
                    f"{role}.max_k ({pool.worker.max_k}) is below router.k_policy.k_max ({k_max}): "
                    "the workers would refuse the router's own drafts"
                )

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> ServeConfig:
        """A config file's mapping through the model: keys it leaves out take the model's defaults
        (``target.model``: :data:`DEFAULT_TARGET_MODEL`; no ``draft``: no draft pool); every problem
        is reported at once (a :class:`specdec.rpc.config_model.ConfigError`)."""
        d = copy.deepcopy(d or {})
        if not isinstance(d, dict):
            raise ConfigError([f"config: expected a mapping, got {type(d).__name__}"])
        for key in ("router", "ray", "security"):  # an empty section (`ray:` alone in YAML) is null
            if key in d and d[key] is None:
                del d[key]
        target = d.get("target")
        if target is None or isinstance(target, dict):
            d["target"] = target = {"model": DEFAULT_TARGET_MODEL} | (target or {})
        draft = d.get("draft")
        if isinstance(draft, dict) and str(draft.get("model", "")).lower() in ("", "none", "off"):
            d["draft"] = draft = None  # `model: none` is the same as `draft: null`
        k_max = _k_max(d.get("router"))
        for key in ("target", "draft"):
            section = d.get(key)
            if isinstance(section, dict):
                if section.get("max_k") is None:  # the workers refuse drafts longer than any the router asks for
                    section["max_k"] = k_max
                d[key] = _nested(section)
        if isinstance(d.get("router"), dict):
            d["router"] = move_legacy_keys(d["router"])
        return validate(cls, d)

    def to_dict(self) -> dict[str, Any]:
        return {
            "ray": dataclasses.asdict(self.ray),
            "target": self.target.to_dict(),
            "draft": self.draft.to_dict() if self.draft else None,
            "router": self.router.to_dict() | {"k_policy": dataclasses.asdict(self.router.k_policy)},
            "security": self.security.to_dict(),
        }


def _k_max(router: Any) -> int:
    """The router's ``k_policy.k_max`` as written, else its default (a wrong one is reported by the model)."""
    k_policy = router.get("k_policy") if isinstance(router, dict) else None
    k_max = k_policy.get("k_max") if isinstance(k_policy, dict) else None
    return k_max if isinstance(k_max, int) and not isinstance(k_max, bool) else RouterConfig().k_policy.k_max


def schema() -> dict[str, Any]:
    """The JSON Schema of a serve config file (for editors and ``specdec config check``)."""
    out = json_schema(ServeConfig, "specdec serve configuration")
    pool = out["$defs"]["PoolConfig"]
    pool["properties"]["threads"] = {
        "anyOf": [{"type": "integer", "minimum": 1}, {"const": "auto"}, {"type": "null"}],
        "default": None,
        "description": "torch threads per worker; null or auto: cluster.config.default_threads",
    }
    pool["properties"]["max_k"]["description"] = "null (the default): router.k_policy.k_max"
    pool["properties"]["max_k"]["anyOf"] = [{"type": "integer", "minimum": 1}, {"type": "null"}]
    pool["properties"]["max_k"].pop("type", None)
    pool.pop("required", None)  # target.model: DEFAULT_TARGET_MODEL; a draft without one: no draft pool
    # the older keys still read (router.config.move_legacy_keys), flagged for editors
    for section in (RebalanceConfig, RouterConfig):
        props = out["$defs"][section.__name__]["properties"]
        for key, now in section.__moved_keys__.items():
            props[key] = {"deprecated": True, "description": f"older name of {now}"}
    return out


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
    """Read the YAML (default ``configs/default.yaml``) and apply command-line overrides. What the
    file leaves out takes the model's defaults (:meth:`ServeConfig.from_dict`); a
    :class:`ConfigError` names the file and lists every problem.

    ``draft`` "none" removes the draft pool (the router can still draft with n-grams); ``dtype``
    applies to both pools; ``address`` sets ``ray.address``; ``tensor_parallel`` the target's ranks;
    ``security`` keys replace the section's.
    """
    path = Path(path) if path is not None else DEFAULT_CONFIG
    raw = read_config(path)
    raw["target"] = raw.get("target") or {}
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
    try:
        return ServeConfig.from_dict(raw)
    except ConfigError as exc:
        raise ConfigError(exc.problems, f"config {path}") from None


def read_config(path: str | Path) -> dict[str, Any]:
    """A config file's mapping (YAML; JSON is YAML too), before the model reads it."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except OSError as exc:
        raise ConfigError([f"cannot read config {path}: {exc.strerror}"]) from None
    except yaml.YAMLError as exc:
        raise ConfigError([f"config {path} is not valid YAML: {exc}"]) from None
    if not isinstance(raw, dict):
        raise ConfigError([f"expected a mapping at the top level, got {type(raw).__name__}"], f"config {path}")
    return raw
