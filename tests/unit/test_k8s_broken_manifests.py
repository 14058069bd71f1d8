"""Broken manifests fail the chart's checks (tests/unit/test_k8s_manifests.py): each case edits one
rendered object as a typo or a drift would, and the schema or the agreement check must refuse it."""

from __future__ import annotations

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.unit.test_k8s_manifests import _container, check_agreement, check_schemas, cluster_yaml, rendered


def _break(kind: str, edit, overlay: str = "gpu-monitoring") -> tuple[list[dict], dict]:
    """The overlay's manifests with ``edit`` applied to the first of ``kind`` (``Kind:suffix``: the
    first whose name ends so); (docs, that doc). The default overlay is the GPU one with monitoring."""
    docs = rendered(overlay)
    kind, _, suffix = kind.partition(":")
    doc = next(d for d in docs if d["kind"] == kind and d["metadata"]["name"].endswith(suffix))
    edit(doc)
    return docs, doc


BROKEN_SCHEMA = {
    "Service: unknown field": ("Service", lambda d: d["spec"]["ports"][0].update(targetPortt=50051)),
    "Service: type is not a string": ("Service", lambda d: d["spec"].update(type=["ClusterIP"])),
    "PDB: misspelt matchLabels": (
        "PodDisruptionBudget",
        lambda d: d["spec"]["selector"].update(matchLabel=d["spec"]["selector"].pop("matchLabels")),
    ),
    "RayCluster: misspelt maxReplicas": (
        "RayCluster",
        lambda d: d["spec"]["workerGroupSpecs"][0].update(
            maxReplica=d["spec"]["workerGroupSpecs"][0].pop("maxReplicas")
        ),
    ),
    "RayCluster: upscaling mode not in the enum": (
        "RayCluster",
        lambda d: d["spec"]["autoscalerOptions"].update(upscalingMode="Fast"),
    ),
    "ServiceMonitor: misspelt endpoints": (
        "ServiceMonitor",
        lambda d: d["spec"].update(endpoint=d["spec"].pop("endpoints")),
    ),
    "PodMonitor: endpoint without a port": ("PodMonitor", lambda d: d["spec"]["podMetricsEndpoints"][0].pop("port")),
    "PrometheusRule: a rule with no expression": (
        "PrometheusRule",
        lambda d: d["spec"]["groups"][0]["rules"][0].pop("expr"),
    ),
    "pod template: named port in a gRPC probe": (
        "RayCluster",
        lambda d: _container(d["spec"]["headGroupSpec"]["template"], "router")["livenessProbe"]["grpc"].update(
            port="grpc"
        ),
    ),
    # the CRD embeds a newer PodSpec: only the core check knows 1.30 has no pod-level resources
    "pod template: pod-level resources on 1.30": (
        "RayCluster",
        lambda d: d["spec"]["headGroupSpec"]["template"]["spec"].update(resources={"limits": {"cpu": "4"}}),
    ),
}


@pytest.mark.parametrize("case", BROKEN_SCHEMA)
def test_broken_manifest_fails_validation(case):
    _, doc = _break(*BROKEN_SCHEMA[case])
    with pytest.raises((AssertionError, jsonschema.ValidationError)):
        check_schemas(doc)


def test_unknown_kind_fails_validation():
    widget = {"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "x"}}
    with pytest.raises(kubernetes_validate.SchemaNotFoundError):
        check_schemas(widget)


def _router(d):
    return _container(d["spec"]["headGroupSpec"]["template"], "router")


def _edit_serve(cm: dict, edit) -> None:
    serve = yaml.safe_load(cm["data"]["serve.yaml"])
    edit(serve)
    cm["data"]["serve.yaml"] = yaml.safe_dump(serve)


BROKEN_AGREEMENT = {
    "Service port": ("Service", lambda d: d["spec"]["ports"][0].update(port=50052)),
    "router metrics port": ("RayCluster", lambda d: _router(d)["ports"][1].update(containerPort=9401)),
    "probe port": ("RayCluster", lambda d: _router(d)["readinessProbe"]["grpc"].update(port=8080)),
    "scrape annotation": (
        "RayCluster",
        lambda d: d["spec"]["headGroupSpec"]["template"]["metadata"]["annotations"].update(
            {"prometheus.io/port": "8080"}
        ),
    ),
    "target pod GPUs": (
        "RayCluster",
        lambda d: d["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["resources"]["limits"].update(
            {"nvidia.com/gpu": "2"}
        ),
    ),
    "draft group's Ray resource": (
        "RayCluster",
        lambda d: d["spec"]["workerGroupSpecs"][1].update(resources={"draft_gpus": "1"}),
    ),
    "serve config resource": (
        "ConfigMap",
        lambda d: _edit_serve(d, lambda cfg: cfg["target"]["placement"].update(resources={"target_gpus": 1})),
    ),
    # what configs/cluster.yaml asks under `ray up`: KubeRay's autoscaler never offers it
    "accelerator_type in a placement": (
        "ConfigMap",
        lambda d: _edit_serve(d, lambda cfg: cfg["target"]["placement"].update(accelerator_type="A100")),
    ),
    "gateway's router address": (
        "Deployment",
        lambda d: d["spec"]["template"]["spec"]["containers"][0]["args"].__setitem__(0, "--router=elsewhere:50051"),
    ),
    "gateway's HTTP port": (
        "Deployment",
        lambda d: d["spec"]["template"]["spec"]["containers"][0]["args"].__setitem__(2, "--port=8001"),
    ),
    "gateway started by the router too": (
        "ConfigMap",
        lambda d: _edit_serve(d, lambda cfg: cfg["router"].update(http_port=8000)),
    ),
    "Ray's metrics port name": (
        "RayCluster",
        lambda d: d["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["ports"][0].update(
            name="ray-metrics"
        ),
    ),
    "ServiceMonitor selecting the gateway": (
        "ServiceMonitor",
        lambda d: d["spec"]["selector"]["matchLabels"].pop("app.kubernetes.io/component"),
    ),
    "PodMonitor leaving out the workers": (
        "PodMonitor",
        lambda d: d["spec"]["selector"]["matchExpressions"][0].update(values=["head"]),
    ),
    "PrometheusRule edited in the chart": (
        "PrometheusRule",
        lambda d: d["spec"]["groups"][0]["rules"][0].update(expr="vector(1)"),
    ),
    "dashboard without the sidecar label": (
        "ConfigMap:-dashboard",
        lambda d: d["metadata"]["labels"].pop("grafana_dashboard"),
    ),
    "PDB selector": (
        "PodDisruptionBudget",
        lambda d: d["spec"]["selector"]["matchLabels"].update({"app.kubernetes.io/component": "router"}),
    ),
}


@pytest.mark.parametrize("case", BROKEN_AGREEMENT)
def test_broken_manifest_fails_agreement(case):
    docs, _ = _break(*BROKEN_AGREEMENT[case])
    with pytest.raises(AssertionError):
        check_agreement(docs, cluster_yaml())
