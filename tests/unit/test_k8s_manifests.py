"""The Kubernetes deployment (k8s/): every rendered manifest validates and agrees with
configs/cluster.yaml (broken copies fail these checks: tests/unit/test_k8s_broken_manifests.py;
the image: tests/unit/test_dockerfile.py).

* Rendering: the Helm chart k8s/specdec with each overlay, through Helm's own engine
  (helm-python-sdk, scripts/render_k8s.py), offline.
* Core kinds: kubernetes-validate in strict mode (unknown fields are errors) for Kubernetes
  K8S_VERSIONS: the chart's floor and the newest kubernetes-validate ships.
* Monitoring kinds (monitoring.coreos.com/v1 ServiceMonitor, PodMonitor, PrometheusRule): their
  CRDs are not in kubernetes-validate, nor vendored here, so a minimal structural schema of the
  fields the chart sets (unknown fields are errors); the agreement checks do the rest.
* RayCluster: the openAPIV3Schema of KubeRay 1.7.0's CRD (../shared/schemas/kuberay/, beside the
  clone), made strict like the API server's strict field validation; its two CEL rules concern
  fields the chart does not set. Its pod templates also validate as core PodTemplates.
* Agreement: the Ray resource names and the router's ports of configs/cluster.yaml (the one
  source) in the serve config, worker groups, container ports, probes, Service and scrape
  annotations; Ray's metrics ports named `metrics`; the monitors select the router's Service and
  the Ray pods; the PrometheusRule and the dashboard ConfigMap are the chart's files unchanged;
  GPUs, threads and pool sizes fit the pods; Ray's own KubeRay autoscaler code sees a node type
  with room for every pool's actors; the GPU overlay is cluster.yaml.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from cluster.config import ServeConfig
from tests.ray_resources import actor_demand

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "k8s"
CLUSTER_YAML = REPO / "configs" / "cluster.yaml"
KUBERAY_CRD = REPO.parent / "shared" / "schemas" / "kuberay" / "ray.io_rayclusters.yaml"
K8S_VERSIONS = ("1.30.0", "1.37.0")
HEALTH_SERVICE = "specdec.v1.Generation"

OVERLAYS = {  # name: (values file, overrides)
    "defaults": (None, {}),
    "cpu-demo": (K8S / "values-cpu-demo.yaml", {}),
    "cpu-demo-no-draft": (K8S / "values-cpu-demo.yaml", {"serve": {"draft": None}}),  # Helm: null drops a key
    "gpu": (K8S / "values-gpu.yaml", {}),
    "gpu-pvc": (K8S / "values-gpu.yaml", {"models": {"existingClaim": "specdec-models"}}),
    "gpu-ray-auth-off": (K8S / "values-gpu.yaml", {"rayAuth": {"mode": "disabled"}}),
    # the public API's TLS (mTLS) and bearer tokens, health not exempt; Ray's token from a Secret of yours
    "gpu-api-tls-tokens": (
        K8S / "values-gpu.yaml",
        {
            "router": {
                "tls": {"secretName": "specdec-api-tls", "clientCASecretName": "specdec-api-client-ca"},
                "tokensSecretName": "specdec-api-tokens",
            },
            "serve": {"security": {"exempt": []}},
            "rayAuth": {"secretName": "my-ray-token"},
        },
    ),
    "cpu-demo-api-tls": (K8S / "values-cpu-demo.yaml", {"router": {"tls": {"secretName": "specdec-api-tls"}}}),
    "cpu-demo-api-tokens": (K8S / "values-cpu-demo.yaml", {"router": {"tokensSecretName": "specdec-api-tokens"}}),
    "gpu-monitoring": (
        K8S / "values-gpu.yaml",
        {
            "monitoring": {
                "serviceMonitor": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}},
                "podMonitor": {"enabled": True},
                "prometheusRule": {"enabled": True},
                "dashboard": {"enabled": True},
            },
        },
    ),
}
MONITORING_KINDS = {"ServiceMonitor", "PodMonitor", "PrometheusRule"}
CHART_FILES = K8S / "specdec" / "files"


def _load_renderer():
    spec = importlib.util.spec_from_file_location("render_k8s", REPO / "scripts" / "render_k8s.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


render_k8s = _load_renderer()


@functools.cache
def _rendered(name: str) -> tuple[dict, ...]:
    values, overrides = OVERLAYS[name]
    return tuple(render_k8s.render(values, overrides))


def rendered(name: str, **overrides) -> list[dict]:
    """The overlay's manifests (a fresh copy; ``overrides`` are values on top of the overlay)."""
    if overrides:
        values, base = OVERLAYS[name]
        return render_k8s.render(values, render_k8s.merge_values(base, overrides))
    return copy.deepcopy(list(_rendered(name)))


def cluster_yaml() -> dict:
    return yaml.safe_load(CLUSTER_YAML.read_text())


def _strict(schema):
    """Unknown fields become errors, as with the API server's strict field validation."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _strict(v) for k, v in schema.items()}
    if (
        "properties" in schema
        and "additionalProperties" not in schema
        and not schema.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


@functools.cache
def raycluster_validator() -> jsonschema.Draft7Validator:
    if not KUBERAY_CRD.is_file():
        pytest.fail(
            f"KubeRay CRD schema not found at {KUBERAY_CRD}: the tests expect shared/ beside the "
            "repository clone (../shared/schemas/kuberay/ray.io_rayclusters.yaml)"
        )
    with KUBERAY_CRD.open() as f:
        crd = yaml.load(f, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema = _strict(v1["schema"]["openAPIV3Schema"])
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


def _closed(properties: dict, required: tuple[str, ...] = ()) -> dict:
    return {"type": "object", "properties": properties, "required": list(required), "additionalProperties": False}


_STR = {"type": "string"}
_LABELS = {"type": "object", "additionalProperties": _STR}
_METADATA = {"type": "object", "required": ["name"], "properties": {"name": _STR, "labels": _LABELS}}
_SELECTOR = _closed(
    {
        "matchLabels": _LABELS,
        "matchExpressions": {
            "type": "array",
            "items": _closed(
                {
                    "key": _STR,
                    "operator": {"enum": ["In", "NotIn", "Exists", "DoesNotExist"]},
                    "values": {"type": "array"},
                },
                ("key", "operator"),
            ),
        },
    }
)
_ENDPOINTS = {
    "type": "array",
    "minItems": 1,
    "items": _closed({"port": _STR, "path": _STR, "interval": _STR}, ("port",)),
}
_RULE = _closed(
    {
        "alert": _STR,
        "record": _STR,
        "expr": _STR,
        "for": _STR,
        "labels": _LABELS,
        "annotations": _LABELS,
    },
    ("expr",),
)
_GROUPS = {
    "type": "array",
    "minItems": 1,
    "items": _closed({"name": _STR, "interval": _STR, "rules": {"type": "array", "items": _RULE}}, ("name", "rules")),
}
# The fields of prometheus-operator's CRDs (monitoring.coreos.com/v1) that the chart sets.
MONITORING_SCHEMAS = {
    kind: _closed(
        {
            "apiVersion": {"const": "monitoring.coreos.com/v1"},
            "kind": {"const": kind},
            "metadata": _METADATA,
            "spec": spec,
        },
        ("apiVersion", "kind", "metadata", "spec"),
    )
    for kind, spec in {
        "ServiceMonitor": _closed({"selector": _SELECTOR, "endpoints": _ENDPOINTS}, ("selector", "endpoints")),
        "PodMonitor": _closed(
            {"selector": _SELECTOR, "podMetricsEndpoints": _ENDPOINTS}, ("selector", "podMetricsEndpoints")
        ),
        "PrometheusRule": _closed({"groups": _GROUPS}, ("groups",)),
    }.items()
}


# --------------------------------------------------------------------------- the checks


def pod_templates(rc: dict) -> dict[str, dict]:
    spec = rc["spec"]
    return {
        "head": spec["headGroupSpec"]["template"],
        **{g["groupName"]: g["template"] for g in spec["workerGroupSpecs"]},
    }


def check_schemas(doc: dict) -> None:
    """Core kinds: kubernetes-validate --strict; RayCluster: the CRD schema; anything else fails."""
    if doc["apiVersion"] == "ray.io/v1" and doc["kind"] == "RayCluster":
        errors = sorted(raycluster_validator().iter_errors(doc), key=lambda e: list(e.absolute_path))
        if errors:
            raise AssertionError(
                "RayCluster does not match the KubeRay CRD:\n"
                + "\n".join(f"  {'.'.join(map(str, e.absolute_path))}: {e.message}" for e in errors)
            )
        for name, template in pod_templates(doc).items():
            check_schemas({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": name}, "template": template})
        return
    if doc["apiVersion"] == "monitoring.coreos.com/v1" and doc["kind"] in MONITORING_SCHEMAS:
        jsonschema.validate(doc, MONITORING_SCHEMAS[doc["kind"]])
        return
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(doc, version, strict=True)  # SchemaNotFoundError for unknown kinds


def _one(docs: list[dict], kind: str) -> dict:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


def _service(docs: list[dict], http: bool = False) -> dict:
    """The gRPC Service, or (``http``) the gateway's."""
    (svc,) = [d for d in docs if d["kind"] == "Service" and d["metadata"]["name"].endswith("-http") == http]
    return svc


def _container(template: dict, name: str) -> dict:
    (c,) = [c for c in template["spec"]["containers"] if c["name"] == name]
    return c


def _cpus(quantity: str) -> float:
    q = str(quantity)
    return float(q[:-1]) / 1000 if q.endswith("m") else float(q)


def probe_target(probe: dict) -> tuple[int, str]:
    """(port, health service) a router probe checks: the kubelet's grpc probe, or specdec's exec probe."""
    if "grpc" in probe:
        return probe["grpc"]["port"], probe["grpc"].get("service", "")
    command = probe["exec"]["command"]
    assert command[:3] == ["python", "-m", "specdec.rpc.health_probe"], command
    flags = dict(a[2:].split("=", 1) for a in command[3:])
    return int(flags["address"].rsplit(":", 1)[1]), flags.get("service", "")


def check_autoscaler_can_place(rc: dict, cfg: ServeConfig) -> None:
    """Ray's KubeRay autoscaler (its own code) sees a node type for each pool's actors, and room for them."""
    from ray.autoscaler._private.kuberay.autoscaling_config import _generate_available_node_types_from_ray_cr_spec

    node_types = _generate_available_node_types_from_ray_cr_spec(rc["spec"])
    for role, pool in (("target", cfg.target), ("draft", cfg.draft)):
        if pool is None:
            continue
        demand = actor_demand(pool.placement)
        fits = {name: min(t["resources"].get(k, 0) // v for k, v in demand.items()) for name, t in node_types.items()}
        room = sum(n * node_types[name]["max_workers"] for name, n in fits.items())
        assert room >= pool.replicas, f"{role}: the autoscaler has room for {room} of {pool.replicas} ({demand})"


def check_agreement(docs: list[dict], cluster: dict) -> None:
    """Resource names and ports as configs/cluster.yaml has them, everywhere the manifests use them."""
    port, metrics_port = cluster["router"]["port"], cluster["router"]["metrics_port"]
    names = {role: set(cluster[role]["placement"]["resources"]) for role in ("target", "draft")}

    (cm,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-serve")]
    rc, svc = _one(docs, "RayCluster"), _service(docs)
    serve = yaml.safe_load(cm["data"]["serve.yaml"])
    cfg = ServeConfig.from_dict(serve)  # the same strict parser `specdec serve` uses
    assert serve["ray"]["address"] == "auto"
    assert (cfg.router.port, cfg.router.metrics_port) == (port, metrics_port), "serve config ports"

    spec = rc["spec"]
    assert spec["enableInTreeAutoscaling"] is True and spec["autoscalerOptions"]
    groups = {g["groupName"]: g for g in spec["workerGroupSpecs"]}
    assert not spec["headGroupSpec"].get("resources"), "the head offers no worker resources"
    for role, pool in (("target", cfg.target), ("draft", cfg.draft)):
        if pool is None:
            continue
        wanted = pool.placement["resources"]
        assert set(wanted) == names[role], f"{role} placement asks for {set(wanted)}, cluster.yaml {names[role]}"
        offering = [g for g in groups.values() if set(wanted) <= set(g.get("resources") or {})]
        assert len(offering) == 1, f"{role}: {len(offering)} worker groups offer {sorted(wanted)}"
        group = offering[0]
        assert all(float(group["resources"][k]) >= v for k, v in wanted.items()), f"{role}: one replica per pod"
        assert group["minReplicas"] <= group["maxReplicas"], f"{role} replica bounds"
        assert "replicas" not in group, f"{role}: autoscaled, a rendered count would reset the autoscaler's"
        assert pool.replicas <= group["maxReplicas"], f"{role}: {pool.replicas} replicas cannot fit the group"
        worker = group["template"]["spec"]["containers"][0]
        gpus = int(worker["resources"].get("limits", {}).get("nvidia.com/gpu", 0))
        assert gpus == int(pool.placement.get("num_gpus", 0)), f"{role}: pod GPUs {gpus} != placement"
        assert (gpus > 0) == pool.worker.device.startswith("cuda"), f"{role}: device {pool.worker.device}"
        assert not gpus or group["template"]["spec"].get("nodeSelector"), f"{role}: GPU pods need a node selector"
        assert pool.worker.threads <= _cpus(worker["resources"]["limits"]["cpu"]), f"{role}: threads > CPUs"

    check_autoscaler_can_place(rc, cfg)

    head = spec["headGroupSpec"]["template"]
    router = _container(head, "router")
    assert "specdec serve --address auto --config /etc/specdec/serve.yaml" in " ".join(router["args"])
    (cfg_vol,) = [v for v in head["spec"]["volumes"] if v.get("configMap")]
    assert cfg_vol["configMap"]["name"] == cm["metadata"]["name"]
    assert {"name": cfg_vol["name"], "mountPath": "/etc/specdec", "readOnly": True} in router["volumeMounts"]
    ports = {p["name"]: p["containerPort"] for p in router["ports"]}
    assert ports == {"grpc": port, "router-metrics": metrics_port}, f"router container ports {ports}"
    probes = [probe_target(router[k]) for k in ("startupProbe", "readinessProbe", "livenessProbe")]
    assert all(p == port for p, _ in probes), "probes on the API port"
    assert probes[1][1] == HEALTH_SERVICE, "readiness: the Generation service (NOT_SERVING while draining)"
    assert head["metadata"]["annotations"]["prometheus.io/port"] == str(metrics_port), "scrape annotation"
    assert "prometheus.io/scrape" not in (svc["metadata"].get("annotations") or {}), "scraped twice"
    svc_ports = {p["name"]: (p["port"], p["targetPort"]) for p in svc["spec"]["ports"]}
    assert svc_ports == {"grpc": (port, "grpc"), "metrics": (metrics_port, "router-metrics")}, f"Service {svc_ports}"
    labels = {t: tmpl["metadata"]["labels"] for t, tmpl in pod_templates(rc).items()}
    assert svc["spec"]["selector"].items() <= labels["head"].items(), "the Service selects the head pod"
    for pdb in (d for d in docs if d["kind"] == "PodDisruptionBudget"):
        sel = pdb["spec"]["selector"]["matchLabels"].items()
        assert sum(sel <= lab.items() for lab in labels.values()) == 1, f"{pdb['metadata']['name']} selects no group"
    check_gateway(docs, cfg, cluster, svc)
    check_monitoring(docs, rc, svc)


def _selects(selector: dict, labels: dict) -> bool:
    """A label selector (matchLabels and In expressions, as the chart writes them) against labels."""
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    return all(labels.get(e["key"]) in e["values"] for e in selector.get("matchExpressions", []))


def check_monitoring(docs: list[dict], rc: dict, svc: dict) -> None:
    """Ray's metrics ports as KubeRay names them; the monitors, rules and dashboard when enabled."""
    templates = pod_templates(rc)
    for name, template in templates.items():
        ray = template["spec"]["containers"][0]  # the Ray container: KubeRay's container 0
        assert {"name": "metrics", "containerPort": 8080} in ray["ports"], f"{name}: Ray's metrics port {ray['ports']}"
    for kind in ("ServiceMonitor", "PodMonitor"):
        for m in (d for d in docs if d["kind"] == kind):
            endpoints = m["spec"]["endpoints" if kind == "ServiceMonitor" else "podMetricsEndpoints"]
            assert [e["port"] for e in endpoints] == ["metrics"]
    for sm in (d for d in docs if d["kind"] == "ServiceMonitor"):
        services = [
            d for d in docs if d["kind"] == "Service" and _selects(sm["spec"]["selector"], d["metadata"]["labels"])
        ]
        assert services == [svc], f"the ServiceMonitor selects {[s['metadata']['name'] for s in services]}"
    for pm in (d for d in docs if d["kind"] == "PodMonitor"):
        pods = {n for n, t in templates.items() if _selects(pm["spec"]["selector"], t["metadata"]["labels"])}
        assert pods == set(templates), f"the PodMonitor selects {pods} of {set(templates)}"
        for d in docs:
            if d["kind"] == "Deployment":
                assert not _selects(pm["spec"]["selector"], d["spec"]["template"]["metadata"]["labels"])
    for rule in (d for d in docs if d["kind"] == "PrometheusRule"):
        assert rule["spec"] == yaml.safe_load((CHART_FILES / "alerts.yaml").read_text()), "not files/alerts.yaml"
    for cm in (d for d in docs if d["kind"] == "ConfigMap" and "specdec.json" in d.get("data", {})):
        assert cm["metadata"]["labels"].get("grafana_dashboard") == "1", "the Grafana sidecar's label"
        assert cm["data"]["specdec.json"] == (CHART_FILES / "dashboard.json").read_text().rstrip("\n")


def check_gateway(docs: list[dict], cfg: ServeConfig, cluster: dict, svc: dict) -> None:
    """The HTTP gateway: its own Deployment and Service on cluster.yaml's http_port, dialling the gRPC Service."""
    assert not cfg.router.http_port, "the router's container starts no gateway: the gateway has its own pods"
    deployments = [d for d in docs if d["kind"] == "Deployment"]
    if not deployments:
        assert not any(d["kind"] == "Service" and d["metadata"]["name"].endswith("-http") for d in docs)
        return
    (gw,) = deployments
    http_port, template = cluster["router"]["http_port"], gw["spec"]["template"]
    c = _container(template, "gateway")
    args = dict(a[2:].split("=", 1) for a in c["args"])
    assert args["router"] == f"{svc['metadata']['name']}:{cfg.router.port}", "the gateway dials the gRPC Service"
    assert int(args["port"]) == http_port and c["ports"] == [{"name": "http", "containerPort": http_port}]
    token_on_health = cfg.security.token_auth and "health" not in cfg.security.exempt
    if cfg.security.tls_client_ca or token_on_health:  # the kubelet has no client certificate nor token
        command = c["readinessProbe"]["exec"]["command"]
        assert command[:3] == ["python", "-m", "gateway.health_probe"] and f"--port={http_port}" in command
    else:
        assert c["readinessProbe"]["httpGet"]["path"] == "/health"
    assert gw["spec"]["selector"]["matchLabels"].items() <= template["metadata"]["labels"].items()
    http = _service(docs, http=True)
    assert [(p["name"], p["port"], p["targetPort"]) for p in http["spec"]["ports"]] == [("http", http_port, "http")]
    assert http["spec"]["selector"].items() <= template["metadata"]["labels"].items(), "the Service selects the gateway"
    assert ("tls-cert" in args) == bool(cfg.security.tls), "HTTPS exactly when the gRPC API has TLS"
    mtls = bool(cfg.security.tls_client_ca)
    assert ("tls-client-ca" in args) == ("router-cert" in args) == mtls, "mTLS on both ports, with a certificate"


# --------------------------------------------------------------------------- the tests


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_manifests_validate(overlay):
    docs = rendered(overlay)
    kinds = {d["kind"] for d in docs} - {"Deployment"}
    assert kinds - MONITORING_KINDS == {"ConfigMap", "RayCluster", "Service", "PodDisruptionBudget", "NetworkPolicy"}
    assert (overlay == "gpu-monitoring") == (kinds >= MONITORING_KINDS), "monitoring is off by default"
    for doc in docs:
        check_schemas(doc)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_manifests_agree_with_cluster_yaml(overlay):
    check_agreement(rendered(overlay), cluster_yaml())


def check_gpu_overlay(values_text: str, cluster: dict) -> None:
    """values-gpu.yaml's serve config is configs/cluster.yaml less what the chart fills in."""
    expected = copy.deepcopy(cluster)
    del expected["ray"]
    for role in ("target", "draft"):
        for key in ("placement", "host"):
            expected[role].pop(key)
    for key in ("host", "port", "metrics_host", "metrics_port", "http_port"):
        expected["router"].pop(key)
    serve = yaml.safe_load(values_text)["serve"]
    assert serve == expected, "values-gpu.yaml serve: differs from configs/cluster.yaml"


def test_gpu_overlay_is_cluster_yaml():
    check_gpu_overlay((K8S / "values-gpu.yaml").read_text(), cluster_yaml())


def test_cpu_demo_needs_no_gpu():
    for doc in rendered("cpu-demo"):
        assert "nvidia.com/gpu" not in yaml.safe_dump(doc), doc["kind"]


def _env(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def test_ray_token_auth_is_on_and_reaches_the_router():
    """KubeRay's authOptions (it gives the Ray containers the token); the router gets the same Secret."""
    # "gpu": the Secret KubeRay generates, named like the RayCluster; then one of yours
    for overlay, auth, secret in (
        ("gpu", {"mode": "token"}, "specdec"),
        ("gpu-api-tls-tokens", {"mode": "token", "secretName": "my-ray-token"}, "my-ray-token"),
    ):
        spec = _one(rendered(overlay), "RayCluster")["spec"]
        assert spec["authOptions"] == auth
        head = spec["headGroupSpec"]["template"]
        env = _env(_container(head, "router"))
        assert env["RAY_AUTH_MODE"]["value"] == "token"
        assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": secret, "key": "auth_token"}
        for c in [*head["spec"]["containers"], *head["spec"].get("initContainers", [])]:  # nothing turns it off
            assert "RAY_AUTH_MODE" not in _env(c) or _env(c)["RAY_AUTH_MODE"]["value"] == "token", c["name"]
        assert "RAY_AUTH_MODE" not in _env(spec["autoscalerOptions"])
    off = _one(rendered("gpu-ray-auth-off"), "RayCluster")["spec"]
    assert off["authOptions"] == {"mode": "disabled"}
    assert _env(_container(off["headGroupSpec"]["template"], "router"))["RAY_AUTH_MODE"]["value"] == "disabled"
    assert _env(off["autoscalerOptions"])["RAY_AUTH_MODE"] == {"name": "RAY_AUTH_MODE", "value": "disabled"}


# --------------------------------------------------------------------------- broken copies


def test_router_logs_json_unless_asked_for_text():
    for docs, fmt in ((rendered("gpu"), "json"), (rendered("gpu", router={"logFormat": "text"}), "text")):
        args = " ".join(_router(_one(docs, "RayCluster"))["args"])
        assert f"--config /etc/specdec/serve.yaml --log-format {fmt}" in args, fmt


def _router(d):
    return _container(d["spec"]["headGroupSpec"]["template"], "router")


def test_values_that_disagree_with_cluster_yaml_fail():
    """A chart value (not a hand edit) that renames the draft resource or overfills a pool is caught."""
    with pytest.raises(AssertionError, match="draft placement"):
        check_agreement(rendered("gpu", draft={"rayResource": "draft_gpus"}), cluster_yaml())
    with pytest.raises(AssertionError, match="cannot fit"):
        check_agreement(rendered("gpu", target={"maxReplicas": 1, "minReplicas": 1}), cluster_yaml())


def test_drifted_gpu_overlay_fails():
    text = (K8S / "values-gpu.yaml").read_text()
    assert "num_slots: 32" in text
    with pytest.raises(AssertionError, match="differs"):
        check_gpu_overlay(text.replace("num_slots: 32", "num_slots: 16", 1), cluster_yaml())
