"""Device telemetry of a worker: what its device is doing, sampled every ``period_s``.

Both workers use this (they must not import each other). A :class:`TelemetrySampler` samples on
a daemon thread; ``Info`` returns the latest :class:`DeviceSample` in ``WorkerInfo.telemetry``,
which the router polls (router/telemetry_loop.py) for the rebalancer and for Prometheus.

* GPU (``device`` cuda, NVML present): utilization, memory-controller utilization, memory,
  power, GPM SM activity/occupancy where offered (:mod:`specdec.rpc.nvml`).
* Every device, CPU included: the worker's own accounting: ``busy`` = time spent computing (inside
  :meth:`WorkerMeter.compute`) / wall time over the window, the process's RSS and thread count.
  On a CPU device ``busy`` is the utilization signal.

:class:`WorkerMeter` is what a servicer holds: the busy clock, the latest telemetry for ``Info``,
and a test/benchmark knob (``bench_step_delay_s``) that makes every model step slower.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from specdec.rpc import worker_pb2

log = logging.getLogger(__name__)

__all__ = [
    "COMPUTE_METADATA_KEY",
    "report_compute",
    "TelemetryConfig",
    "DeviceSample",
    "WorkerMeter",
    "TelemetrySampler",
    "sample_to_proto",
    "sample_from_proto",
]

# Trailing metadata a worker attaches to an answer: its own compute time in seconds (the router
# splits a call's wall time into compute and RPC with it: the "rpc" round phase).
COMPUTE_METADATA_KEY = "specdec-compute-seconds"


def report_compute(context, seconds: float) -> None:
    """Attach ``seconds`` of compute to the answer of the call ``context`` serves."""
    if context is not None:
        context.set_trailing_metadata(((COMPUTE_METADATA_KEY, f"{seconds:.6f}"),))


# Fields of DeviceSample that are optional measurements (None = not measured / not offered).
MEASURED = (
    "utilization",
    "memory_utilization",
    "sm_active",
    "sm_occupancy",
    "memory_used_bytes",
    "memory_total_bytes",
    "power_w",
    "power_limit_w",
    "busy",
    "rss_bytes",
    "threads",
)


@dataclass
class TelemetryConfig:
    """A worker config's ``telemetry`` section.

    period_s: seconds between two samples (and the window ``busy`` is measured over).
    enabled: False = no sampler thread (Info carries no telemetry).
    fake_nvml: TEST KNOB: a :class:`specdec.rpc.fake_nvml.FakeNvml` script (a list of steps, or
      {"script": [...], "gpm": bool, ...}) used instead of the real NVML, whatever the device.
    """

    period_s: float = 1.0
    enabled: bool = True
    fake_nvml: list | dict | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.period_s, int | float) or not 0.01 <= float(self.period_s) <= 3600:
            raise ValueError(f"telemetry.period_s must be in [0.01, 3600] seconds (got {self.period_s!r})")
        if self.fake_nvml is not None and not isinstance(self.fake_nvml, list | dict):
            raise ValueError("telemetry.fake_nvml must be a script (list) or {'script': [...], ...}")

    @classmethod
    def from_dict(cls, d: dict | TelemetryConfig | None) -> TelemetryConfig:
        if isinstance(d, TelemetryConfig):
            return d
        d = dict(d or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"telemetry: unknown keys {unknown} (known: {sorted(known)})")
        return cls(**d)


@dataclass
class DeviceSample:
    """One telemetry record. Shares are in [0, 1]; None = not measured (not offered, or missing)."""

    device: str  # "cuda:0", "cpu"
    source: str  # "nvml" or "process" (the worker's own accounting only)
    time: float  # unix time of the sample
    window_s: float  # the window ``busy`` covers
    name: str = ""  # GPU product name
    utilization: float | None = None  # GPU: a kernel ran (NVML); CPU: None (see busy)
    memory_utilization: float | None = None  # memory controller busy (NVML)
    sm_active: float | None = None  # GPM: share of SMs busy
    sm_occupancy: float | None = None  # GPM: active warps vs the maximum
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    power_w: float | None = None
    power_limit_w: float | None = None
    busy: float | None = None  # the worker's compute time / wall time over the window
    rss_bytes: int | None = None
    threads: int | None = None
    missing: list[str] = field(default_factory=list)  # fields whose NVML call failed at run time

    @property
    def load(self) -> float | None:
        """The device's busy share: NVML utilization on a GPU, the worker's busy fraction otherwise."""
        return self.utilization if self.utilization is not None else self.busy


def sample_to_proto(s: DeviceSample) -> worker_pb2.DeviceTelemetry:
    m = worker_pb2.DeviceTelemetry(
        device=s.device, source=s.source, name=s.name, time=s.time, window_s=s.window_s, missing=s.missing
    )
    for f in MEASURED:
        v = getattr(s, f)
        if v is not None:
            setattr(m, f, v)
    return m


def sample_from_proto(m: worker_pb2.DeviceTelemetry) -> DeviceSample:
    s = DeviceSample(
        device=m.device, source=m.source, time=m.time, window_s=m.window_s, name=m.name, missing=list(m.missing)
    )
    for f in MEASURED:
        if m.HasField(f):
            setattr(s, f, getattr(m, f))
    return s


def _process_memory_and_threads() -> tuple[int | None, int | None]:
    """(RSS bytes, OS threads) of this process from /proc; (None, active Python threads) elsewhere."""
    try:
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        threads = len(os.listdir("/proc/self/task"))
        return rss, threads
    except (OSError, ValueError, IndexError):
        return None, threading.active_count()


class WorkerMeter:
    """A servicer's own accounting: time spent computing, and the latest telemetry for ``Info``.

    bench_step_delay_s: TEST/BENCHMARK KNOB, not for production: every :meth:`compute` section
      sleeps this many seconds per model step (a draft token, a verify call), counted as busy, to
      emulate a slower device (tests of the rebalancer, `specdec bench rebalance`).
    """

    def __init__(self, bench_step_delay_s: float = 0.0, clock: Callable[[], float] = time.monotonic):
        self.bench_step_delay_s = float(bench_step_delay_s)
        self.clock = clock  # seconds; a test's manual clock makes busy fractions exact
        self.sampler: TelemetrySampler | None = None
        self._lock = threading.Lock()
        self._active = 0
        self._since = 0.0
        self._busy = 0.0

    @contextlib.contextmanager
    def compute(self, steps: int = 1) -> Iterator[None]:
        """Time a model call (sections may nest or overlap: their union counts once)."""
        with self._lock:
            if self._active == 0:
                self._since = self.clock()
            self._active += 1
        try:
            if self.bench_step_delay_s > 0 and steps > 0:
                time.sleep(self.bench_step_delay_s * steps)
            yield
        finally:
            with self._lock:
                self._active -= 1
                if self._active == 0:
                    self._busy += self.clock() - self._since

    def busy_seconds(self) -> float:
        """Seconds spent computing since start, the section running now included."""
        with self._lock:
            return self._busy + (self.clock() - self._since if self._active else 0.0)

    def telemetry(self) -> worker_pb2.DeviceTelemetry | None:
        """The latest sample as the proto ``Info`` returns (None before the first, or without a sampler)."""
        s = self.sampler.latest if self.sampler is not None else None
        return sample_to_proto(s) if s is not None else None


class TelemetrySampler:
    """Samples ``device`` every ``config.period_s`` on a daemon thread; :attr:`latest` is the last record.

    ``nvml``: a module with nvidia-ml-py's names to use instead of ``pynvml`` (a fake in tests);
    NVML is opened only for cuda devices or when such a module is given.
    """

    def __init__(self, device: str, meter: WorkerMeter, config: TelemetryConfig | None = None, nvml: Any = None):
        from specdec.rpc.nvml import NvmlDevice

        self.config = config or TelemetryConfig()
        self.device = device if device != "cuda" else "cuda:0"
        self.meter = meter
        if nvml is None and self.config.fake_nvml is not None:
            from specdec.rpc.fake_nvml import FakeNvml

            nvml = FakeNvml.from_config(self.config.fake_nvml)
        self.gpu = NvmlDevice.open(self.device, nvml) if (nvml is not None or device.startswith("cuda")) else None
        self.latest: DeviceSample | None = None
        self._last = (meter.clock(), meter.busy_seconds())
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self) -> DeviceSample:
        """Take one sample now (the window runs from the previous one)."""
        now, busy = self.meter.clock(), self.meter.busy_seconds()
        t0, b0 = self._last
        self._last = (now, busy)
        window = max(now - t0, 1e-9)
        rss, threads = _process_memory_and_threads()
        s = DeviceSample(
            device=self.device,
            source="nvml" if self.gpu is not None else "process",
            time=time.time(),
            window_s=window,
            name=self.gpu.name if self.gpu is not None else "",
            busy=min(1.0, max(0.0, (busy - b0) / window)),
            rss_bytes=rss,
            threads=threads,
        )
        if self.gpu is not None:
            values, missing = self.gpu.read()
            for k, v in values.items():
                setattr(s, k, v)
            s.missing = missing
        self.latest = s
        return s

    def start(self) -> TelemetrySampler:
        self.sample()
        self._thread = threading.Thread(target=self._run, name="specdec-telemetry", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.config.period_s):
            try:
                self.sample()
            except Exception:  # noqa: BLE001 - telemetry must never take the worker down
                log.exception("telemetry sample failed")

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self.gpu is not None:
            self.gpu.close()
            self.gpu = None
