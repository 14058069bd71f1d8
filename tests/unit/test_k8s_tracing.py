"""The chart's tracing values: the OTLP variables reach the router and every Ray pod only when a
collector is named (docs/design.md, Telemetry)."""

from __future__ import annotations

from tests.unit.test_k8s_manifests import _env, _one, rendered


def _otel_env(docs: list[dict]) -> dict[str, dict]:
    """The OTEL_* variables of every specdec container of the RayCluster (head, router, workers)."""
    spec = _one(docs, "RayCluster")["spec"]
    pods = [spec["headGroupSpec"]["template"], *(g["template"] for g in spec["workerGroupSpecs"])]
    return {
        c["name"]: {k: e.get("value") for k, e in _env(c).items() if k.startswith("OTEL_")}
        for pod in pods
        for c in pod["spec"]["containers"]
        if "SPECDEC_CACHE" in _env(c)
    }


def test_tracing_env_only_when_a_collector_is_named():
    """tracing.otlpEndpoint sets the OTLP variables on the router and every Ray pod (the worker actors
    inherit them); unset, no container gets any (traces are off)."""
    assert not any(_otel_env(rendered("gpu")).values())
    on = _otel_env(rendered("gpu", tracing={"otlpEndpoint": "http://collector:4317", "sampleRatio": 0.25}))
    assert "router" in on and len(on) >= 3, sorted(on)
    for name, env in on.items():
        assert env == {
            "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317",
            "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
            "OTEL_TRACES_SAMPLER_ARG": "0.25",
        }, name
    plain = _otel_env(rendered("cpu-demo", tracing={"otlpEndpoint": "http://collector:4317"}))
    assert all(env == {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"} for env in plain.values()), plain
