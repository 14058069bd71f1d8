"""The chart's NetworkPolicies (templates/networkpolicy.yaml), evaluated as the API server's rules
read them: the API and metrics ports from the configured sources, everything else of the
release's pods (Ray's ports, the workers' gRPC ports) from the release's own pods only.

A connection is (source pod labels, source namespace labels, destination pod, port); a pod that no
policy selects takes any connection, so turning the policies off fails the same checks.
"""

from __future__ import annotations

import pytest

from tests.unit.test_k8s_manifests import OVERLAYS, pod_templates, rendered

NAMESPACE = {"kubernetes.io/metadata.name": "default"}  # the release's namespace (render_k8s default)
OUTSIDE_NS = {"kubernetes.io/metadata.name": "elsewhere"}
MONITORING_NS = {"kubernetes.io/metadata.name": "monitoring"}
GCS, DASHBOARD, WORKER_PORT, API, METRICS, RAY_METRICS, HTTP = 6379, 8265, 10005, 50051, 9400, 8080, 8000


def _matches(selector: dict, labels: dict) -> bool:
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for e in selector.get("matchExpressions", []):
        present, value = e["key"] in labels, labels.get(e["key"])
        ok = {
            "In": present and value in e.get("values", []),
            "NotIn": not present or value not in e.get("values", []),
            "Exists": present,
            "DoesNotExist": not present,
        }[e["operator"]]
        if not ok:
            return False
    return True


def _peer_matches(peer: dict, labels: dict, ns_labels: dict) -> bool:
    if "ipBlock" in peer:
        return False  # pods are addressed by selectors here
    ns_ok = _matches(peer["namespaceSelector"], ns_labels) if "namespaceSelector" in peer else ns_labels == NAMESPACE
    pod_ok = _matches(peer["podSelector"], labels) if "podSelector" in peer else True
    return ns_ok and pod_ok


def allowed(docs: list[dict], dest: dict, port: int, src: dict, src_ns: dict = NAMESPACE) -> bool:
    """Whether a pod labelled ``src`` in a namespace labelled ``src_ns`` may connect to ``port`` of
    the pod labelled ``dest``."""
    policies = [
        d
        for d in docs
        if d["kind"] == "NetworkPolicy"
        and "Ingress" in d["spec"].get("policyTypes", ["Ingress"])
        and _matches(d["spec"]["podSelector"], dest)
    ]
    if not policies:
        return True
    for policy in policies:
        for rule in policy["spec"].get("ingress", []):
            ports = rule.get("ports")
            if ports is not None and port not in [p["port"] for p in ports]:
                continue
            peers = rule.get("from")
            if peers is None or any(_peer_matches(p, src, src_ns) for p in peers):
                return True
    return False


def check_network_policy(docs: list[dict], api_from_anywhere: bool = True) -> None:
    labels = {name: t["metadata"]["labels"] for name, t in pod_templates(_rc(docs)).items()}
    own = labels["head"]
    stranger = {"app": "something-else"}
    head = labels["head"]
    for name, dest in labels.items():
        for port in (GCS, DASHBOARD, WORKER_PORT):
            assert allowed(docs, dest, port, own), f"{name}:{port} closed to the release's own pods"
            assert not allowed(docs, dest, port, stranger), f"{name}:{port} open to other pods"
            assert not allowed(docs, dest, port, stranger, OUTSIDE_NS), f"{name}:{port} open to other namespaces"
    assert allowed(docs, head, API, stranger, OUTSIDE_NS) == api_from_anywhere, "the API's sources"
    for dest in labels.values():
        assert allowed(docs, dest, RAY_METRICS, {"app": "prometheus"}, MONITORING_NS), "Ray's metrics closed"
    assert allowed(docs, head, METRICS, {"app": "prometheus"}, MONITORING_NS), "the router's metrics closed"


def _rc(docs: list[dict]) -> dict:
    (rc,) = [d for d in docs if d["kind"] == "RayCluster"]
    return rc


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policy(overlay):
    check_network_policy(rendered(overlay))


def test_sources_from_values():
    """apiFrom and metricsFrom narrow who may call the API and scrape; the gateway follows apiFrom."""
    ingress_ns = {"kubernetes.io/metadata.name": "ingress"}
    docs = rendered(
        "gpu",
        networkPolicy={
            "apiFrom": [{"namespaceSelector": {"matchLabels": ingress_ns}}],
            "metricsFrom": [{"namespaceSelector": {"matchLabels": MONITORING_NS}}],
        },
    )
    check_network_policy(docs, api_from_anywhere=False)
    head = pod_templates(_rc(docs))["head"]["metadata"]["labels"]
    (gateway,) = [d["spec"]["template"]["metadata"]["labels"] for d in docs if d["kind"] == "Deployment"]
    assert allowed(docs, head, API, {}, ingress_ns) and allowed(docs, gateway, HTTP, {}, ingress_ns)
    assert not allowed(docs, gateway, HTTP, {}, OUTSIDE_NS)
    assert not allowed(docs, head, METRICS, {}, OUTSIDE_NS)
    assert not allowed(docs, gateway, GCS, head), "nothing but HTTP of the gateway is open"


def test_policies_off_fail_the_check():
    with pytest.raises(AssertionError, match="open to other"):
        check_network_policy(rendered("gpu", networkPolicy={"enabled": False}))


def test_policy_without_own_pods_rule_fails_the_check():
    docs = rendered("gpu")
    for d in docs:
        if d["kind"] == "NetworkPolicy" and d["metadata"]["name"].endswith("-workers"):
            d["spec"]["ingress"].pop(0)
    with pytest.raises(AssertionError, match="closed to the release"):
        check_network_policy(docs)
