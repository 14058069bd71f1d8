"""Device telemetry (specdec/rpc/telemetry.py, nvml.py) with the FAKE NVML of specdec/rpc/fake_nvml.py
(no test needs a GPU), the CPU accounting, the wire form, and the router's Prometheus series."""

from __future__ import annotations

import logging
import socket
import time

import pytest

from specdec.rpc import telemetry
from specdec.rpc.fake_nvml import FakeNvml
from specdec.rpc.nvml import NvmlDevice, physical_index
from specdec.rpc.placement import device_placement
from specdec.rpc.telemetry import (
    DeviceSample,
    TelemetryConfig,
    TelemetrySampler,
    WorkerMeter,
    sample_from_proto,
    sample_to_proto,
)
from specdec.rpc.worker_config import WorkerConfig

SCRIPT = [
    {"gpu": 30, "memory": 10, "used": 2 << 30, "total": 80 << 30, "power_mw": 150_000, "limit_mw": 700_000},
    {"gpu": 90, "memory": 60, "used": 3 << 30, "power_mw": 500_000, "sm_active": 40, "sm_occupancy": 25},
    {"gpu": 95, "fail": ["nvmlDeviceGetPowerUsage"], "sm_active": 70, "sm_occupancy": 50},
    {"gpu": 96, "fail": ["nvmlDeviceGetPowerUsage"]},
    {"gpu": 20, "power_mw": 120_000},
]


def sampler(script=SCRIPT, **fake_kw) -> TelemetrySampler:
    fake = FakeNvml(script, **fake_kw)
    return TelemetrySampler("cuda:0", WorkerMeter(), TelemetryConfig(period_s=0.05), nvml=fake)


def test_fake_nvml_values_reach_the_record_in_its_units():
    s = sampler(gpm=True)
    first = s.sample()
    assert first.source == "nvml" and first.device == "cuda:0" and "fake" in first.name
    assert first.utilization == pytest.approx(0.30) and first.memory_utilization == pytest.approx(0.10)
    assert first.memory_used_bytes == 2 << 30 and first.memory_total_bytes == 80 << 30
    assert first.power_w == pytest.approx(150.0) and first.power_limit_w == pytest.approx(700.0)
    assert first.sm_active is None  # GPM needs two samples: nothing yet
    second = s.sample()
    assert second.utilization == pytest.approx(0.90) and second.power_w == pytest.approx(500.0)
    assert second.sm_active == pytest.approx(0.40) and second.sm_occupancy == pytest.approx(0.25)
    assert second.load == pytest.approx(0.90)  # kernel time: the load signal; SM activity is separate
    assert second.missing == []
    s.stop()


def test_a_failing_call_is_logged_once_and_marked_missing(caplog):
    s = sampler(gpm=True)
    s.sample(), s.sample()
    with caplog.at_level(logging.WARNING, logger="specdec.rpc.nvml"):
        third, fourth = s.sample(), s.sample()
    assert third.power_w is None and third.missing == ["power_w"] and third.utilization == pytest.approx(0.95)
    # a GPM metric the device did not return this time is missing too
    assert fourth.missing == ["power_w", "sm_active", "sm_occupancy"] and fourth.sm_active is None
    warnings = [r for r in caplog.records if "nvmlDeviceGetPowerUsage" in r.getMessage()]
    assert len(warnings) == 1  # once, not every period
    assert s.sample().power_w == pytest.approx(120.0)  # back when the call works again
    s.stop()


def test_no_gpm_offered_means_absent_not_missing():
    s = sampler(gpm=False)
    s.sample()
    second = s.sample()
    assert second.sm_active is None and second.sm_occupancy is None and second.missing == []
    assert second.load == second.utilization  # the policy's load signal is NVML utilization
    s.stop()


def test_no_nvml_is_the_normal_cpu_case(caplog):
    with caplog.at_level(logging.WARNING):
        s = sampler(init_error=True)
        rec = s.sample()
    assert rec.source == "process" and rec.utilization is None and rec.power_w is None and rec.missing == []
    assert rec.load == rec.busy  # the worker's own busy fraction is the CPU's utilization signal
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    # the real nvidia-ml-py: on this machine either a GPU opens, or (no driver) None, never an error
    dev = NvmlDevice.open("cuda:0")
    if dev is not None:
        values, _ = dev.read()
        assert 0.0 <= values["utilization"] <= 1.0
        dev.close()
    # a CPU device never touches NVML
    cpu = TelemetrySampler("cpu", WorkerMeter(), TelemetryConfig())
    assert cpu.gpu is None and cpu.sample().source == "process"


class ManualClock:
    """A clock the test moves: busy fractions come out exact."""

    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_busy_fraction_rss_threads_and_the_bench_delay_knob(monkeypatch):
    clock = ManualClock()
    meter = WorkerMeter(clock=clock)
    s = TelemetrySampler("cpu", meter, TelemetryConfig(period_s=10))
    s.sample()
    with meter.compute():
        clock.t += 0.2
        assert meter.busy_seconds() == pytest.approx(0.2)  # the running section counts
    clock.t += 0.6
    rec = s.sample()
    assert rec.window_s == pytest.approx(0.8) and rec.busy == pytest.approx(0.25), rec
    assert rec.rss_bytes > 10 << 20 and rec.threads >= 1
    # nested and overlapping sections count once
    with meter.compute():
        clock.t += 0.1
        with meter.compute():
            clock.t += 0.1
        clock.t += 0.1
    assert meter.busy_seconds() == pytest.approx(0.5)
    clock.t += 0.7
    assert s.sample().busy == pytest.approx(0.3)
    # TEST/BENCHMARK KNOB: each step sleeps bench_step_delay_s inside the section (counted as busy)
    real = WorkerMeter(bench_step_delay_s=0.05)
    t1 = time.monotonic()
    with real.compute(steps=3):
        pass
    assert time.monotonic() - t1 >= 0.15 and real.busy_seconds() >= 0.15  # sleep never returns early
    slept: list[float] = []
    monkeypatch.setattr(telemetry.time, "sleep", slept.append)
    with real.compute(steps=2):
        pass
    with real.compute(steps=0):  # a draft prefill: no steps, no delay
        pass
    assert slept == [pytest.approx(0.1)]


def test_sampler_thread_keeps_the_latest_and_info_carries_it():
    meter, fake = WorkerMeter(), FakeNvml(SCRIPT)
    s = TelemetrySampler("cuda:0", meter, TelemetryConfig(period_s=0.02), nvml=fake)
    meter.sampler = s.start()
    t_end = time.monotonic() + 10
    while (s.latest is None or s.latest.utilization != pytest.approx(0.20)) and time.monotonic() < t_end:
        time.sleep(0.02)
    assert s.latest.utilization == pytest.approx(0.20)  # the script's last step repeats
    msg = meter.telemetry()
    assert msg.utilization == pytest.approx(0.20) and msg.source == "nvml"
    s.stop()
    assert fake.calls[-1] == "nvmlShutdown" and not fake.initialized


def test_wire_form_keeps_absent_fields_absent():
    rec = DeviceSample(device="cpu", source="process", time=1.5, window_s=1.0, busy=0.25, rss_bytes=123, threads=7)
    msg = sample_to_proto(rec)
    assert not msg.HasField("utilization") and msg.HasField("busy")
    assert sample_from_proto(msg) == rec
    full = DeviceSample(
        device="cuda:1", source="nvml", time=2.0, window_s=1.0, utilization=0.0, power_w=0.0, missing=["sm_active"]
    )
    back = sample_from_proto(sample_to_proto(full))
    assert back == full and back.utilization == 0.0  # zero is a value, not "absent"


def test_physical_index_follows_cuda_visible_devices():
    assert physical_index("cuda", "") == (0, None)
    assert physical_index("cuda:1", "") == (1, None)
    assert physical_index("cuda:1", "3,5") == (5, None)
    assert physical_index("cuda:0", "GPU-abc,GPU-def") == (None, "GPU-abc")
    with pytest.raises(ValueError, match="CUDA_VISIBLE_DEVICES"):
        physical_index("cuda:2", "3,5")


def test_worker_config_telemetry_section_and_knob_are_checked():
    cfg = WorkerConfig(model="m", telemetry={"period_s": 0.5, "fake_nvml": [{"gpu": 10}]}, bench_step_delay_s=0.01)
    assert WorkerConfig.from_dict(cfg.to_dict()) == cfg  # survives the dict form Ray actors get
    with pytest.raises(ValueError, match="unknown keys"):
        WorkerConfig(model="m", telemetry={"period": 1})
    with pytest.raises(ValueError, match="period_s"):
        WorkerConfig(model="m", telemetry={"period_s": 0})
    with pytest.raises(ValueError, match="bench_step_delay_s"):
        WorkerConfig(model="m", bench_step_delay_s=-1)
    # a fake NVML from the config is used instead of the real one, whatever the device
    s = TelemetrySampler("cpu", WorkerMeter(), TelemetryConfig.from_dict(cfg.telemetry))
    assert s.sample().utilization == pytest.approx(0.10)
    s.stop()


def test_router_metrics_series_from_a_sample():
    from router.metrics import Metrics

    m = Metrics()
    rec = DeviceSample(
        device="cuda:0", source="nvml", time=0, window_s=1, utilization=0.5, sm_active=0.3, power_w=200.0, busy=0.4
    )
    m.record_device("draft-0", "draft", rec)
    lab = {"worker": "draft-0", "role": "draft", "device": "cuda:0"}
    assert m.sample("specdec_device_utilization", {**lab, "signal": "kernel"}) == 0.5
    assert m.sample("specdec_device_utilization", {**lab, "signal": "sm_active"}) == 0.3
    assert m.sample("specdec_device_utilization", {**lab, "signal": "busy"}) == 0.4
    assert m.sample("specdec_device_power_watts", lab) == 200.0
    assert m.sample("specdec_device_memory_used_bytes", lab) is None  # not measured: no series
    rec.power_w = None  # the call failed this time: the series goes away rather than lying
    m.record_device("draft-0", "draft", rec)
    assert m.sample("specdec_device_power_watts", lab) is None


def test_a_placement_names_the_host_and_the_physical_device():
    """Two workers share a device when their placements are equal (the router then charges the
    target its drafter's prefill): every CPU worker of a host shares its cores, and two GPU workers
    share one GPU even where CUDA_VISIBLE_DEVICES numbers it differently in each process."""
    host = socket.gethostname()
    assert device_placement("cpu") == f"{host}/cpu"
    assert device_placement("cuda:0", visible="3,1") == device_placement("cuda:1", visible="2,3") == f"{host}/gpu3"
    assert device_placement("cuda:0", visible="1") != device_placement("cuda:0", visible="3")
    assert device_placement("cuda", visible="GPU-8f2e") == f"{host}/GPU-8f2e"
    assert device_placement("cuda:0", visible="") == f"{host}/gpu0"
