"""The device and model catalog of `specdec plan` (``catalog.yaml`` next to this file, or a file of
the same form): datasheet peaks, prices, roofline efficiencies, network overheads, model shapes."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import yaml

__all__ = ["CatalogError", "Device", "ModelShape", "Efficiency", "Catalog", "DEFAULT_CATALOG", "load_catalog"]

DEFAULT_CATALOG = Path(__file__).with_name("catalog.yaml")


class CatalogError(ValueError):
    """A catalog that cannot be used, or a name it lacks; the message says what to fix."""


@dataclass(frozen=True)
class Device:
    name: str
    memory_gb: float
    bandwidth_gbs: float
    bf16_tflops: float
    price_per_hour: float
    link_gbs: float = 32.0
    max_tp: int = 8


@dataclass(frozen=True)
class ModelShape:
    name: str
    params_b: float
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    bytes_per_param: float = 2.0

    @property
    def weight_bytes(self) -> float:
        return self.params_b * 1e9 * self.bytes_per_param

    @property
    def kv_bytes_per_token(self) -> float:
        """Keys and values of one token over all layers (bf16 cache)."""
        return 2.0 * self.layers * self.kv_heads * self.head_dim * 2.0

    def tp_degrees(self, max_tp: int) -> list[int]:
        """TP degrees that split this model's heads evenly (whole heads per rank)."""
        return [t for t in (1, 2, 4, 8, 16) if t <= max_tp and self.heads % t == 0 and self.kv_heads % t == 0]


@dataclass(frozen=True)
class Efficiency:
    memory_bandwidth: float = 0.7
    compute: float = 0.5
    forward_overhead_ms_per_layer: float = 0.01
    allreduce_latency_us: float = 10.0


def _checked_efficiency(values: dict[str, Any], where: str) -> Efficiency:
    """An :class:`Efficiency` from ``values`` (the fields it names; the rest keep their defaults),
    or a :class:`CatalogError` naming the bad key or value."""
    if not isinstance(values, dict):
        raise CatalogError(f"{where}: efficiency: expected a mapping")
    known = {f.name for f in fields(Efficiency)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise CatalogError(f"{where}: unknown efficiency key(s) {unknown} (known: {sorted(known)})")
    for key, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise CatalogError(f"{where}: efficiency {key}: expected a number, got {value!r}")
        if key in ("memory_bandwidth", "compute") and not 0 < value <= 1:
            raise CatalogError(f"{where}: efficiency {key}: a fraction of the datasheet peak, in (0, 1], got {value}")
        if value < 0:
            raise CatalogError(f"{where}: efficiency {key}: must be >= 0, got {value}")
    return Efficiency(**{k: float(v) for k, v in values.items()})


@dataclass
class Catalog:
    devices: dict[str, Device]
    models: dict[str, ModelShape]
    efficiency: Efficiency = field(default_factory=Efficiency)
    network: dict[str, float] = field(default_factory=dict)
    source: str = ""

    def device(self, name: str) -> Device:
        try:
            return self.devices[name]
        except KeyError:
            raise CatalogError(f"unknown device {name!r}; the catalog has {', '.join(self.devices)}") from None

    def with_efficiency(self, overrides: dict[str, float]) -> Catalog:
        """This catalog with some efficiencies replaced (``specdec plan --efficiency``): what an
        answer costs under another assumption, without editing the file."""
        checked = _checked_efficiency(overrides, "--efficiency")
        return replace(self, efficiency=replace(self.efficiency, **{k: getattr(checked, k) for k in overrides}))

    def model(self, name: str) -> ModelShape:
        try:
            return self.models[name]
        except KeyError:
            raise CatalogError(
                f"unknown model {name!r}; the catalog has {', '.join(self.models)} (add its shape to the catalog)"
            ) from None


def _build(cls, name: str, d: Any, where: str):
    if not isinstance(d, dict):
        raise CatalogError(f"{where}: {name}: expected a mapping")
    try:
        obj = cls(name=name, **d)
    except TypeError as exc:
        raise CatalogError(f"{where}: {name}: {exc}") from None
    numbers = [v for k, v in d.items() if k != "name"]
    if any(not isinstance(v, (int, float)) or v <= 0 for v in numbers):
        raise CatalogError(f"{where}: {name}: every value must be a positive number")
    return obj


def load_catalog(path: str | Path | None = None) -> Catalog:
    path = Path(path) if path else DEFAULT_CATALOG
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise CatalogError(f"{path}: no such catalog file") from None
    except yaml.YAMLError as exc:
        raise CatalogError(f"{path}: not valid YAML ({exc})") from None
    if not isinstance(data, dict) or not data.get("devices") or not data.get("models"):
        raise CatalogError(f"{path}: a catalog needs 'devices' and 'models' sections")
    eff = _checked_efficiency(data.get("efficiency") or {}, str(path))
    return Catalog(
        devices={n: _build(Device, n, d, str(path)) for n, d in data["devices"].items()},
        models={n: _build(ModelShape, n, d, str(path)) for n, d in data["models"].items()},
        efficiency=eff,
        network={k: float(v) for k, v in (data.get("network") or {}).items()},
        source=str(path),
    )
