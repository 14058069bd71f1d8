"""The router's Prometheus series that PromQL needs as counters and labels (router/metrics.py)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from router.metrics import Metrics


def _types(m: Metrics) -> dict[str, str]:
    return {f.name: f.type for f in text_string_to_metric_families(m.text().decode())}


def test_evictions_counter_grows_by_each_reported_delta_and_survives_a_worker_restart():
    m = Metrics()
    lab = {"role": "target", "worker": "target-0"}
    m.record_evicted("target", "target-0", 0)
    assert m.sample("specdec_worker_evictions_total", lab) == 0  # the series exists before any eviction
    m.record_evicted("target", "target-0", 3)
    m.record_evicted("target", "target-0", 3)
    m.record_evicted("target", "target-0", 5)
    assert m.sample("specdec_worker_evictions_total", lab) == 5
    m.record_evicted("target", "target-0", 2)  # a new worker process counts from 0 again
    assert m.sample("specdec_worker_evictions_total", lab) == 7
    assert m.sample("specdec_worker_evicted", lab) == 2  # the old gauge still shows the worker's own count


def test_acceptance_and_evictions_are_counters_and_the_old_gauge_stays_a_gauge():
    types = _types(Metrics())
    for name in (
        "specdec_drafted_tokens",
        "specdec_accepted_tokens",
        "specdec_drafted_tokens_by_position",
        "specdec_accepted_tokens_by_position",
        "specdec_worker_evictions",
        "specdec_requests",
    ):
        assert types[name] == "counter", name
    assert types["specdec_worker_evicted"] == "gauge"
    for name in (
        "specdec_queue_time_seconds",
        "specdec_prompt_tokens_per_request",
        "specdec_generation_tokens_per_request",
        "specdec_time_to_first_token_seconds",
    ):
        assert types[name] == "histogram", name


def test_build_info_names_the_installed_versions_without_importing_torch():
    import sys

    torch_loaded = "torch" in sys.modules
    m = Metrics()
    [family] = [f for f in text_string_to_metric_families(m.text().decode()) if f.name == "specdec_build_info"]
    [s] = family.samples
    assert s.value == 1
    assert set(s.labels) == {"version", "python", "grpc", "torch"}
    assert s.labels["version"] and s.labels["python"].count(".") == 2
    assert ("torch" in sys.modules) == torch_loaded


def test_request_series_carry_the_model_and_sample_sums_the_labels_not_given():
    m = Metrics()
    m.requests.labels("stop", "a").inc()
    m.requests.labels("stop", "b").inc(2)
    m.requests.labels("length", "b").inc()
    m.queue_time.labels("a").observe(0.002)
    assert m.sample("specdec_requests_total", {"outcome": "stop"}) == 3
    assert m.sample("specdec_requests_total", {"outcome": "stop", "model": "b"}) == 2
    assert m.sample("specdec_requests_total") == 4
    assert m.sample("specdec_queue_time_seconds_count", {"model": "a"}) == 1
    assert m.sample("specdec_requests_total", {"outcome": "error"}) is None
