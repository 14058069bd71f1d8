"""A FAKE NVML for tests and CPU benchmarks: nvidia-ml-py's function names, values from a script.

No test may need a GPU (docs/design.md, invariant 6), yet the NVML path of :mod:`specdec.rpc.nvml` must run in tests.
:class:`FakeNvml` is injected where the real ``pynvml`` module would be (the sampler's ``nvml``
argument, or ``telemetry.fake_nvml`` in a worker config, which reaches Ray actors too). It is a
fake, named as one: nothing here reads hardware.

A script is a list of steps, one per sample (the sampler reads utilization once per sample); the
last step repeats. Each step is a dict of any of::

    gpu, memory             utilization percentages (nvmlDeviceGetUtilizationRates)
    used, total             memory bytes (nvmlDeviceGetMemoryInfo)
    power_mw, limit_mw      power draw and enforced limit in milliwatts
    sm_active, sm_occupancy GPM metrics in percent (present only when ``gpm`` is true)
    fail                    names of functions that raise NVMLError at this step
                            (e.g. ["nvmlDeviceGetPowerUsage"]: a call failing at run time)

Constructor options: ``gpm`` (GPM offered), ``init_error`` (nvmlInit raises: no driver),
``device_count``, ``name``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

__all__ = ["FakeNvml", "FakeNVMLError"]

NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_UNKNOWN = 999
NVML_GPM_METRIC_SM_UTIL = 2
NVML_GPM_METRIC_SM_OCCUPANCY = 3
NVML_GPM_METRICS_GET_VERSION = 1


class FakeNVMLError(Exception):
    """Stands in for ``pynvml.NVMLError`` (the sampler catches ``nvml.NVMLError``)."""

    def __init__(self, value: int):
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return f"fake NVML error {self.value}"


@dataclass
class _Handle:
    index: int


@dataclass
class _GpmMetric:
    metricId: int = 0  # noqa: N815 - nvidia-ml-py's field names
    nvmlReturn: int = 0  # noqa: N815
    value: float = 0.0


@dataclass
class _GpmMetricsGet:
    version: int = 0
    numMetrics: int = 0  # noqa: N815
    sample1: Any = None
    sample2: Any = None
    metrics: list[_GpmMetric] = field(default_factory=lambda: [_GpmMetric() for _ in range(8)])


class FakeNvml:
    """The subset of nvidia-ml-py the sampler calls, driven by ``script``."""

    NVMLError = FakeNVMLError
    NVML_GPM_METRIC_SM_UTIL = NVML_GPM_METRIC_SM_UTIL
    NVML_GPM_METRIC_SM_OCCUPANCY = NVML_GPM_METRIC_SM_OCCUPANCY
    NVML_GPM_METRICS_GET_VERSION = NVML_GPM_METRICS_GET_VERSION
    c_nvmlGpmMetricsGet_t = _GpmMetricsGet

    def __init__(
        self,
        script: list[dict[str, Any]] | None = None,
        *,
        gpm: bool = False,
        init_error: bool = False,
        device_count: int = 1,
        name: str = "Fake GPU (fake_nvml)",
    ):
        self.script = list(script or [{}])
        self.gpm = gpm
        self.init_error = init_error
        self.device_count = device_count
        self.name = name
        self.step = -1  # advanced by each nvmlDeviceGetUtilizationRates call
        self.calls: list[str] = []
        self.initialized = False
        self._lock = threading.Lock()

    @classmethod
    def from_config(cls, spec: dict[str, Any] | list) -> FakeNvml:
        """From a worker config's ``telemetry.fake_nvml``: a script list, or {"script": [...], "gpm": ...}."""
        if isinstance(spec, list):
            return cls(spec)
        spec = dict(spec)
        return cls(spec.pop("script", None), **spec)

    # ---- helpers -------------------------------------------------------------------------------
    def _now(self, fn: str) -> dict[str, Any]:
        self.calls.append(fn)
        if not self.initialized:
            raise FakeNVMLError(1)  # NVML_ERROR_UNINITIALIZED
        cur = self.script[min(max(self.step, 0), len(self.script) - 1)]
        if fn in cur.get("fail", ()):
            raise FakeNVMLError(NVML_ERROR_UNKNOWN)
        return cur

    # ---- nvidia-ml-py names --------------------------------------------------------------------
    def nvmlInit(self) -> None:  # noqa: N802
        self.calls.append("nvmlInit")
        if self.init_error:
            raise FakeNVMLError(NVML_ERROR_LIBRARY_NOT_FOUND)
        self.initialized = True

    def nvmlShutdown(self) -> None:  # noqa: N802
        self.calls.append("nvmlShutdown")
        self.initialized = False

    def nvmlDeviceGetCount(self) -> int:  # noqa: N802
        self._now("nvmlDeviceGetCount")
        return self.device_count

    def nvmlDeviceGetHandleByIndex(self, index: int) -> _Handle:  # noqa: N802
        self._now("nvmlDeviceGetHandleByIndex")
        if not 0 <= index < self.device_count:
            raise FakeNVMLError(2)  # NVML_ERROR_INVALID_ARGUMENT
        return _Handle(index)

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> _Handle:  # noqa: N802
        self._now("nvmlDeviceGetHandleByUUID")
        return _Handle(0)

    def nvmlDeviceGetName(self, handle: _Handle) -> str:  # noqa: N802
        self._now("nvmlDeviceGetName")
        return self.name

    def nvmlDeviceGetUtilizationRates(self, handle: _Handle) -> SimpleNamespace:  # noqa: N802
        with self._lock:
            self.step += 1
        cur = self._now("nvmlDeviceGetUtilizationRates")
        return SimpleNamespace(gpu=int(cur.get("gpu", 0)), memory=int(cur.get("memory", 0)))

    def nvmlDeviceGetMemoryInfo(self, handle: _Handle) -> SimpleNamespace:  # noqa: N802
        cur = self._now("nvmlDeviceGetMemoryInfo")
        total = int(cur.get("total", 80 << 30))
        used = int(cur.get("used", 0))
        return SimpleNamespace(total=total, used=used, free=total - used)

    def nvmlDeviceGetPowerUsage(self, handle: _Handle) -> int:  # noqa: N802
        return int(self._now("nvmlDeviceGetPowerUsage").get("power_mw", 100_000))

    def nvmlDeviceGetEnforcedPowerLimit(self, handle: _Handle) -> int:  # noqa: N802
        return int(self._now("nvmlDeviceGetEnforcedPowerLimit").get("limit_mw", 700_000))

    def nvmlGpmQueryDeviceSupport(self, handle: _Handle) -> SimpleNamespace:  # noqa: N802
        self._now("nvmlGpmQueryDeviceSupport")
        return SimpleNamespace(isSupportedDevice=1 if self.gpm else 0)

    def nvmlGpmSampleAlloc(self) -> SimpleNamespace:  # noqa: N802
        self._now("nvmlGpmSampleAlloc")
        return SimpleNamespace(step=None)

    def nvmlGpmSampleFree(self, sample: SimpleNamespace) -> None:  # noqa: N802
        self.calls.append("nvmlGpmSampleFree")

    def nvmlGpmSampleGet(self, handle: _Handle, sample: SimpleNamespace) -> SimpleNamespace:  # noqa: N802
        self._now("nvmlGpmSampleGet")
        sample.step = self.step
        return sample

    def nvmlGpmMetricsGet(self, mg: _GpmMetricsGet) -> _GpmMetricsGet:  # noqa: N802
        cur = self._now("nvmlGpmMetricsGet")
        if not self.gpm:
            raise FakeNVMLError(NVML_ERROR_NOT_SUPPORTED)
        values = {NVML_GPM_METRIC_SM_UTIL: cur.get("sm_active"), NVML_GPM_METRIC_SM_OCCUPANCY: cur.get("sm_occupancy")}
        for m in mg.metrics[: mg.numMetrics]:
            v = values.get(m.metricId)
            m.nvmlReturn, m.value = (0, float(v)) if v is not None else (NVML_ERROR_NOT_SUPPORTED, 0.0)
        return mg
