"""The chart's per-group pod hooks (values head, gateway, draft, target: nodeSelector, tolerations,
affinity, topologySpreadConstraints, priorityClassName, serviceAccountName, extraEnv, extraVolumes,
extraVolumeMounts) reach the group's pod spec and every specdec container of it, and the result
still validates (kubernetes-validate --strict, the KubeRay CRD)."""

from __future__ import annotations

import pytest

from tests.unit.test_k8s_manifests import _one, check_schemas, rendered

HOOKS = {
    "nodeSelector": {"pool": "specdec"},
    "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "specdec", "effect": "NoSchedule"}],
    "affinity": {
        "podAntiAffinity": {
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {
                    "weight": 100,
                    "podAffinityTerm": {
                        "topologyKey": "kubernetes.io/hostname",
                        "labelSelector": {"matchLabels": {"app.kubernetes.io/name": "specdec"}},
                    },
                }
            ]
        }
    },
    "topologySpreadConstraints": [
        {
            "maxSkew": 1,
            "topologyKey": "topology.kubernetes.io/zone",
            "whenUnsatisfiable": "ScheduleAnyway",
            "labelSelector": {"matchLabels": {"app.kubernetes.io/name": "specdec"}},
        }
    ],
    "priorityClassName": "inference-high",
    "serviceAccountName": "specdec-runner",
    "extraEnv": [{"name": "NCCL_DEBUG", "value": "WARN"}],
    "extraVolumes": [{"name": "certs", "configMap": {"name": "corp-ca"}}],
    "extraVolumeMounts": [{"name": "certs", "mountPath": "/etc/corp-ca", "readOnly": True}],
}
POD_FIELDS = ("nodeSelector", "tolerations", "affinity", "topologySpreadConstraints", "priorityClassName")


def _pod(docs: list[dict], group: str) -> dict:
    if group == "gateway":
        (d,) = [d for d in docs if d["kind"] == "Deployment"]
        return d["spec"]["template"]["spec"]
    spec = _one(docs, "RayCluster")["spec"]
    if group == "head":
        return spec["headGroupSpec"]["template"]["spec"]
    (g,) = [g for g in spec["workerGroupSpecs"] if g["groupName"] == group]
    return g["template"]["spec"]


def check_hooks(pod: dict, hooks: dict) -> None:
    for field in POD_FIELDS:
        assert pod.get(field) == hooks[field], field
    assert pod.get("serviceAccountName") == hooks["serviceAccountName"]
    assert hooks["extraVolumes"][0] in pod["volumes"]
    for c in [*pod.get("initContainers", []), *pod["containers"]]:
        assert hooks["extraEnv"][0] in c["env"], c["name"]
        assert hooks["extraVolumeMounts"][0] in c["volumeMounts"], c["name"]


@pytest.mark.parametrize("group", ["head", "gateway", "draft", "target"])
def test_hooks_reach_the_group(group):
    docs = rendered("cpu-demo", **{group: HOOKS})  # no node selectors of its own: Helm merges maps
    check_hooks(_pod(docs, group), HOOKS)
    for doc in docs:
        check_schemas(doc)
    other = "draft" if group != "draft" else "target"
    with pytest.raises(AssertionError):  # another group's pods are left alone
        check_hooks(_pod(docs, other), HOOKS)
