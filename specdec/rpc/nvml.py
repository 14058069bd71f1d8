"""One GPU read through NVML (nvidia-ml-py, or the fake of :mod:`specdec.rpc.fake_nvml`).

Signals (docs/design.md, Telemetry): ``nvmlDeviceGetUtilizationRates`` gives the share of the last
sample period in which *any* kernel ran (``gpu``) and the memory controller's busy share
(``memory``); a tiny kernel running all the time reads 100 %. Where the driver offers GPM
(Hopper and later), ``sm_active`` (share of SMs busy) and ``sm_occupancy`` (active warps vs the
maximum) say how much of the GPU the kernels actually used. Both kinds are reported; the
rebalancer picks the one that fits (router/draft_depth.py).

No NVML at all (no driver, no library: every CPU machine) is the normal CPU case: :meth:`open`
returns None and the sampler reports the worker's own accounting. A call that fails later is
logged once per function and its fields are listed as missing in the record.
"""

from __future__ import annotations

import logging
import os
from typing import Any

log = logging.getLogger(__name__)

__all__ = ["NvmlDevice", "physical_index"]


def physical_index(device: str, visible: str | None = None) -> tuple[int | None, str | None]:
    """(NVML index, UUID) of torch device ``device`` ("cuda", "cuda:N") under CUDA_VISIBLE_DEVICES.

    NVML numbers all GPUs of the machine; torch (and Ray, which sets CUDA_VISIBLE_DEVICES for an
    actor) numbers the visible ones. Exactly one of the two is set.
    """
    ordinal = int(device.split(":", 1)[1]) if ":" in device else 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES") if visible is None else visible
    if not visible:
        return ordinal, None
    entries = [e.strip() for e in visible.split(",") if e.strip()]
    if ordinal >= len(entries):
        raise ValueError(f"device {device!r}: CUDA_VISIBLE_DEVICES={visible!r} shows {len(entries)} GPU(s)")
    entry = entries[ordinal]
    return (int(entry), None) if entry.isdigit() else (None, entry)


class NvmlDevice:
    """Reads one device; every read returns what it got and which fields failed."""

    def __init__(self, nvml: Any, handle: Any, name: str):
        self.nvml = nvml
        self.handle = handle
        self.name = name
        self._warned: set[str] = set()
        self._gpm = self._gpm_samples()
        self._gpm_prev: Any = None

    @classmethod
    def open(cls, device: str, nvml: Any = None) -> NvmlDevice | None:
        """The device behind torch device ``device``, or None when NVML is not there."""
        if nvml is None:
            try:
                import pynvml as nvml
            except ImportError:
                log.info("telemetry: nvidia-ml-py is not installed; reporting the worker's own accounting")
                return None
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as exc:
            log.info("telemetry: no NVML on this machine (%s); reporting the worker's own accounting", exc)
            return None
        try:
            index, uuid = physical_index(device)
            handle = nvml.nvmlDeviceGetHandleByIndex(index) if uuid is None else nvml.nvmlDeviceGetHandleByUUID(uuid)
            name = nvml.nvmlDeviceGetName(handle)
        except (nvml.NVMLError, ValueError) as exc:
            log.warning("telemetry: NVML cannot open %s (%s); reporting the worker's own accounting", device, exc)
            nvml.nvmlShutdown()
            return None
        return cls(nvml, handle, name.decode() if isinstance(name, bytes) else str(name))

    def close(self) -> None:
        for s in self._gpm or ():
            try:
                self.nvml.nvmlGpmSampleFree(s)
            except self.nvml.NVMLError:
                pass
        try:
            self.nvml.nvmlShutdown()
        except self.nvml.NVMLError:
            pass

    # ---- reading -------------------------------------------------------------------------------
    def _call(self, fn: str, *args, fields: tuple[str, ...], missing: list[str]):
        try:
            return getattr(self.nvml, fn)(*args)
        except self.nvml.NVMLError as exc:
            if fn not in self._warned:
                self._warned.add(fn)
                log.warning("telemetry: %s failed (%s); reporting %s as missing", fn, exc, ", ".join(fields))
            missing.extend(fields)
            return None

    def _gpm_samples(self) -> list | None:
        """Two GPM sample buffers when the device offers GPM, else None (not offered: no warning)."""
        try:
            if not self.nvml.nvmlGpmQueryDeviceSupport(self.handle).isSupportedDevice:
                return None
            return [self.nvml.nvmlGpmSampleAlloc(), self.nvml.nvmlGpmSampleAlloc()]
        except (self.nvml.NVMLError, AttributeError):
            return None

    def read(self) -> tuple[dict[str, float | int], list[str]]:
        """One sample: {field: value} in the units of DeviceSample, and the fields that failed."""
        h = self.handle
        out: dict[str, float | int] = {}
        missing: list[str] = []
        u = self._call(
            "nvmlDeviceGetUtilizationRates", h, fields=("utilization", "memory_utilization"), missing=missing
        )
        if u is not None:
            out["utilization"] = u.gpu / 100.0
            out["memory_utilization"] = u.memory / 100.0
        mem = self._call(
            "nvmlDeviceGetMemoryInfo", h, fields=("memory_used_bytes", "memory_total_bytes"), missing=missing
        )
        if mem is not None:
            out["memory_used_bytes"], out["memory_total_bytes"] = int(mem.used), int(mem.total)
        p = self._call("nvmlDeviceGetPowerUsage", h, fields=("power_w",), missing=missing)
        if p is not None:
            out["power_w"] = p / 1000.0
        lim = self._call("nvmlDeviceGetEnforcedPowerLimit", h, fields=("power_limit_w",), missing=missing)
        if lim is not None:
            out["power_limit_w"] = lim / 1000.0
        if self._gpm is not None:
            out.update(self._read_gpm(missing))
        return out, missing

    def _read_gpm(self, missing: list[str]) -> dict[str, float]:
        """SM activity and occupancy between the previous sample and this one (nothing on the first)."""
        nv = self.nvml
        cur = self._gpm[1] if self._gpm_prev is self._gpm[0] else self._gpm[0]
        fields = ("sm_active", "sm_occupancy")
        if self._call("nvmlGpmSampleGet", self.handle, cur, fields=fields, missing=missing) is None:
            self._gpm_prev = None
            return {}
        prev, self._gpm_prev = self._gpm_prev, cur
        if prev is None:
            return {}
        mg = nv.c_nvmlGpmMetricsGet_t()
        mg.version = nv.NVML_GPM_METRICS_GET_VERSION
        mg.numMetrics = 2
        mg.sample1, mg.sample2 = prev, cur
        mg.metrics[0].metricId = nv.NVML_GPM_METRIC_SM_UTIL
        mg.metrics[1].metricId = nv.NVML_GPM_METRIC_SM_OCCUPANCY
        if self._call("nvmlGpmMetricsGet", mg, fields=fields, missing=missing) is None:
            return {}
        out = {}
        for name, m in zip(fields, mg.metrics[:2]):
            if m.nvmlReturn == 0:
                out[name] = m.value / 100.0
            else:
                missing.append(name)
        return out
