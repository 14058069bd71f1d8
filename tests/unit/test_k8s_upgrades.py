"""`helm upgrade` rolls what changed (k8s/README.md, "Upgrades"): the chart renders twice, before
and after a change, and the difference must reach the pods.

* An image tag change changes every pod template; a serve-config change changes the ConfigMap and,
  through its checksum annotation, the head's pod template (the router reads the config only at
  start). KubeRay replaces the pods of a changed template only with `upgradeStrategy: Recreate`.
* Autoscaled groups render no `replicas` (an upgrade would reset the autoscaler's count).
* No disruption budget blocks a node drain: none on the single head pod, and every budget lets one
  pod go.
* Broken variants fail: upgradeStrategy None, a config change that does not reach the head's template,
  a head budget of minAvailable 1.
"""

from __future__ import annotations

import difflib

import pytest
import yaml

from tests.unit.test_k8s_manifests import OVERLAYS, _one, pod_templates, render_k8s, rendered


def _templates(docs: list[dict]) -> dict[str, dict]:
    out = dict(pod_templates(_one(docs, "RayCluster")))
    out.update({d["metadata"]["name"]: d["spec"]["template"] for d in docs if d["kind"] == "Deployment"})
    return out


def _configmaps(docs: list[dict]) -> dict[str, dict]:
    return {d["metadata"]["name"]: d["data"] for d in docs if d["kind"] == "ConfigMap"}


def check_rolls(before: list[dict], after: list[dict]) -> set[str]:
    """The pod templates that change; a changed serve config must change the head's."""
    assert _one(after, "RayCluster")["spec"].get("upgradeStrategy") == {"type": "Recreate"}, (
        "without upgradeStrategy Recreate KubeRay leaves running pods alone"
    )
    old, new = _templates(before), _templates(after)
    changed = {name for name in new if old.get(name) != new[name]}
    config_changed = {n for n, data in _configmaps(after).items() if _configmaps(before).get(n) != data}
    if any(n.endswith("-serve") for n in config_changed):
        assert "head" in changed, "the serve config changed but the head's pod template did not: nothing rolls"
    return changed


def rendered_diff(before: list[dict], after: list[dict]) -> list[str]:
    """A unified diff of the two renders (the README shows an excerpt)."""
    a, b = (yaml.dump_all(docs, Dumper=render_k8s._Dumper, sort_keys=False).splitlines() for docs in (before, after))
    return [
        line
        for line in difflib.unified_diff(a, b, lineterm="", n=0)
        if line[:1] in "+-" and not line.startswith(("---", "+++"))
    ]


def test_image_change_rolls_every_pod():
    before, after = rendered("gpu"), rendered("gpu", image={"tag": "0.1.1"})
    assert check_rolls(before, after) == set(_templates(after)), "every pod runs the image"
    diff = rendered_diff(before, after)
    assert [line for line in diff if "image:" in line and line.startswith("+")], diff


def test_config_change_rolls_the_head():
    before, after = rendered("gpu"), rendered("gpu", serve={"router": {"max_queue": 512}})
    changed = check_rolls(before, after)
    assert "head" in changed
    diff = rendered_diff(before, after)
    assert any(line.startswith("+") and "checksum/serve-config" in line for line in diff), diff
    assert any(line.startswith("+") and "max_queue: 512" in line for line in diff), diff


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_autoscaled_groups_render_no_replicas(overlay):
    for group in _one(rendered(overlay), "RayCluster")["spec"]["workerGroupSpecs"]:
        assert "replicas" not in group, group["groupName"]


def check_drains(docs: list[dict]) -> None:
    """Every PodDisruptionBudget allows at least one eviction of the pods it selects."""
    labels = {n: t["metadata"]["labels"] for n, t in pod_templates(_one(docs, "RayCluster")).items()}
    groups = {g["groupName"]: g for g in _one(docs, "RayCluster")["spec"]["workerGroupSpecs"]}
    for pdb in (d for d in docs if d["kind"] == "PodDisruptionBudget"):
        (name,) = [n for n, lab in labels.items() if pdb["spec"]["selector"]["matchLabels"].items() <= lab.items()]
        pods = 1 if name == "head" else groups[name]["minReplicas"]
        spec = pdb["spec"]
        if "minAvailable" in spec:
            assert int(spec["minAvailable"]) < pods, f"{pdb['metadata']['name']}: blocks draining {pods} pod(s)"
        else:
            assert int(spec["maxUnavailable"]) >= 1, f"{pdb['metadata']['name']}: blocks every drain"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_no_budget_blocks_a_drain(overlay):
    docs = rendered(overlay)
    assert not [d for d in docs if d["kind"] == "PodDisruptionBudget" and d["metadata"]["name"].endswith("-head")]
    check_drains(docs)


def test_broken_rollouts_fail():
    before = rendered("gpu")
    with pytest.raises(AssertionError, match="Recreate"):
        check_rolls(before, rendered("gpu", upgradeStrategy="None", image={"tag": "0.1.1"}))
    after = rendered("gpu", serve={"router": {"max_queue": 512}})
    _one(after, "RayCluster")["spec"]["headGroupSpec"]["template"] = _templates(before)["head"]
    with pytest.raises(AssertionError, match="nothing rolls"):
        check_rolls(before, after)
    with pytest.raises(AssertionError, match="blocks"):
        check_drains(rendered("gpu", disruptionBudgets={"head": {"minAvailable": 1}}))
