"""What a draft or target worker is configured with, and the strict dict -> dataclass rule every
config section follows (:mod:`specdec.rpc.config_model`: unknown keys and wrong types are refused,
naming their path)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import Field, PositiveInt

from specdec.core.dtypes import DTYPE_NAMES
from specdec.rpc.config_model import Port, check_fields, validate
from specdec.rpc.telemetry import TelemetryConfig

__all__ = ["WorkerConfig", "strict_from_dict", "NODE_HOST"]

NODE_HOST = "node"  # a worker's host: the node's own address (Ray's node IP)
DType = Literal[DTYPE_NAMES]


def strict_from_dict(cls, d: dict[str, Any] | None, section: str):
    """Build dataclass `cls` from `d` through its typed model; a
    :class:`specdec.rpc.config_model.ConfigError` (a ValueError) lists every problem, paths
    starting with `section`."""
    return validate(cls, d, section)


@dataclass
class WorkerConfig:
    """One worker's configuration; the dict form is what the Ray actors take.

    model: pack name, HF folder, .gguf file, hub id, or "ngram" (draft workers only).
    dtype / device: compute dtype ("float32" | "bfloat16" | "float16") and device ("cpu" | "cuda").
    num_slots / max_len: KV-cache sequences and tokens per sequence.
    host / port: where gRPC binds (port 0 = any free port). "node" binds the node's own address
    (Ray's node IP under Ray: the address the router reaches it at), nothing else. A wildcard host
    ("0.0.0.0", "::") binds every interface and advertises ``advertise_host`` (or the node's
    address under Ray): only when configured so.
    threads: torch.set_num_threads (None = leave as is). grpc_threads: the server's thread pool.
    top_k_sent: ids + probs per draft position in rejection mode (model drafters).
    draft_options: keyword arguments of :class:`specdec.core.draft_options.DraftOptions` (quant, vocab, lookup) for
    model drafters; None = its defaults, the same as ``specdec generate``.
    max_ngram / min_ngram: n-gram drafter window (model "ngram").
    telemetry: :class:`specdec.rpc.telemetry.TelemetryConfig` fields (period_s, enabled, fake_nvml);
      None = its defaults (a sample every second).
    bench_step_delay_s: TEST/BENCHMARK KNOB (0 in production): seconds slept per model step (per
      draft token on a drafter, per Verify / Prefill call on a target), to emulate a slower device;
      changed at run time by the worker's ``set_bench_step_delay``.
    max_k: the most draft tokens one sequence of a call may ask for (Propose ``k``, a Verify's
      draft); more is INVALID_ARGUMENT. ``specdec serve`` sets it to ``router.k_policy.k_max``.
    """

    model: Annotated[str, Field(min_length=1)]
    dtype: DType = "float32"
    device: str = "cpu"
    num_slots: PositiveInt = 8
    max_len: PositiveInt = 2048
    host: str = "127.0.0.1"
    port: Port = 0
    threads: PositiveInt | None = None
    advertise_host: str | None = None
    grpc_threads: PositiveInt = 4
    top_k_sent: PositiveInt = 16
    draft_options: dict | None = None
    max_ngram: PositiveInt = 3
    min_ngram: PositiveInt = 1
    telemetry: dict | None = None
    bench_step_delay_s: Annotated[float, Field(ge=0.0, le=60.0)] = 0.0
    max_k: PositiveInt = 16

    def __post_init__(self) -> None:
        check_fields(self)  # the fields' types above, on a config built directly too
        # "key: why": a config error puts the section's path before it (target.device: ...)
        if not isinstance(self.device, str) or self.device.split(":")[0] not in ("cpu", "cuda"):
            raise ValueError(f"device: must be 'cpu' or 'cuda[:N]' (got {self.device!r})")
        if self.min_ngram > self.max_ngram:
            raise ValueError(f"min_ngram: must be <= max_ngram ({self.max_ngram})")
        if self.telemetry is not None and not isinstance(self.telemetry, dict | TelemetryConfig):
            raise ValueError(f"telemetry: a mapping of telemetry settings or None (got {self.telemetry!r})")
        TelemetryConfig.from_dict(self.telemetry)  # refuses unknown keys and bad values here

    @classmethod
    def from_dict(cls, config: dict | WorkerConfig) -> WorkerConfig:
        if isinstance(config, WorkerConfig):
            return config
        return strict_from_dict(cls, config, "worker")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @property
    def wildcard(self) -> bool:
        return self.host in ("0.0.0.0", "::", "", "[::]")

    @property
    def node_bound(self) -> bool:
        """host "node": bind the node's own address (the one the router dials)."""
        return self.host == NODE_HOST
