"""Models from anywhere, the chart's side (templates/_models.tpl; k8s/README.md, "Models"): each
pool's `model` value reaches `specdec models prepare` verbatim in the init containers, with what
that kind of SOURCE needs, and nothing more:

* a pack name: offline (HF_HUB_OFFLINE=1), as the demos are;
* a path on the source volume (a PVC, an image volume, a hostPath): the volume mounted read-only at
  models.source.mountPath in every container that prepares or loads the model;
* a hub id ORG/NAME@REVISION: HF_HUB_OFFLINE=0 and HF_TOKEN from the Secret, in the init
  containers only (the serving containers stay offline and never see the token).

Every variant validates (kubernetes-validate --strict, the KubeRay CRD; the image volume on the
newest Kubernetes only, as 1.30 has none). Broken variants fail: two source kinds at once, a token
leaking into a serving container, a hostPath (or an image volume) under Pod Security restricted.
"""

from __future__ import annotations

import jsonschema
import kubernetes_validate
import pytest
from helm_python.errors import HelmError

from tests.unit.test_k8s_manifests import K8S_VERSIONS, _env, _one, check_schemas, raycluster_validator, rendered
from tests.unit.test_k8s_pod_security import check_restricted

HUB_ID = "Qwen/Qwen2.5-Coder-1.5B-Instruct@2e1fd397ee46e1388853d2af2c993145b0f1098a"
SOURCES = {  # case: (values on top of the CPU demo, the target's SOURCE)
    "pack": ({}, "smollm2-135m-instruct"),
    "hf folder on a claim": (
        {"models": {"source": {"existingClaim": "team-models"}}},
        "/model-source/SmolLM2-135M-Instruct",
    ),
    "gguf in an image volume": (
        {"models": {"source": {"image": "registry.example/models/smollm2:q8"}}},
        "/model-source/smollm2-135m-instruct-q8_0.gguf",
    ),
    "hub id with a token": ({"models": {"hfToken": {"secretName": "hf-token", "key": "token"}}}, HUB_ID),
}


def _render(case: str) -> list[dict]:
    values, source = SOURCES[case]
    return rendered("cpu-demo", serve={"target": {"model": source}}, **values)


def _pods(docs: list[dict]) -> dict[str, dict]:
    spec = _one(docs, "RayCluster")["spec"]
    return {
        "head": spec["headGroupSpec"]["template"]["spec"],
        **{g["groupName"]: g["template"]["spec"] for g in spec["workerGroupSpecs"]},
    }


def check_models(docs: list[dict], source: str, hub: bool, volume: str | None) -> None:
    pods = _pods(docs)
    for name in ("head", "target"):  # the router reads the target's model too
        pod = pods[name]
        (init,) = [c for c in pod["initContainers"] if c["name"] == "prepare-models"]
        assert init["command"] == ["specdec", "models", "prepare", "--quiet"] and source in init["args"], name
        env = _env(init)
        assert env["HF_HUB_OFFLINE"]["value"] == ("0" if hub else "1"), f"{name}: hub access"
        assert ("HF_TOKEN" in env) == hub, f"{name}: HF_TOKEN"
        # pack wheels go to $SPECDEC_CACHE/.wheels by themselves (tests/unit/test_pack_wheels.py): no pip env
        assert env["SPECDEC_CACHE"]["value"] == "/models" and not {"PIP_TARGET", "PYTHONPATH"} & set(env), name
        if hub:
            assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf-token", "key": "token"}
        loaders = [init, *(c for c in pod["containers"] if c["name"] in ("router", "ray-worker"))]
        for c in loaders:
            mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
            assert "/models" in mounts, f"{name}/{c['name']}: the cache"
            if volume:
                assert mounts.get("/model-source", {}).get("readOnly") is True, f"{name}/{c['name']}: source"
        if volume:
            (vol,) = [v for v in pod["volumes"] if v["name"] == "model-source"]
            assert volume in vol, f"{name}: {vol}"
    for name, pod in pods.items():
        for c in pod["containers"]:
            env = _env(c)
            assert "HF_TOKEN" not in env, f"{name}/{c['name']}: the token is for the init containers"
            if "SPECDEC_CACHE" in env:
                assert env["HF_HUB_OFFLINE"]["value"] == "1", f"{name}/{c['name']}: serving is offline"


def _validate(docs: list[dict], newest_only: bool) -> None:
    if not newest_only:
        for doc in docs:
            check_schemas(doc)
        return
    for doc in docs:  # image volumes: not in Kubernetes 1.30's schema
        if doc["kind"] == "RayCluster":
            errors = list(raycluster_validator().iter_errors(doc))
            assert not errors, errors[0].message
            for template in _pods(docs).values():
                pt = {
                    "apiVersion": "v1",
                    "kind": "PodTemplate",
                    "metadata": {"name": "t"},
                    "template": {"spec": template},
                }
                kubernetes_validate.validate(pt, K8S_VERSIONS[-1], strict=True)
        elif doc["apiVersion"] != "monitoring.coreos.com/v1":
            kubernetes_validate.validate(doc, K8S_VERSIONS[-1], strict=True)


@pytest.mark.parametrize("case", SOURCES)
def test_model_sources(case):
    docs = _render(case)
    volume = {"hf folder on a claim": "persistentVolumeClaim", "gguf in an image volume": "image"}.get(case)
    check_models(docs, SOURCES[case][1], hub=case.startswith("hub"), volume=volume)
    _validate(docs, newest_only=volume == "image")
    if volume == "image":  # Pod Security's restricted volume list has no image volumes (baseline allows them)
        with pytest.raises(AssertionError, match="model-source"):
            check_restricted(docs)
    else:
        check_restricted(docs)


def test_image_volume_needs_a_newer_kubernetes():
    """Why the image-volume case validates on the newest version only: 1.30 rejects it."""
    rc = _one(_render("gguf in an image volume"), "RayCluster")
    template = rc["spec"]["workerGroupSpecs"][0]["template"]
    pt = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": template}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(pt, K8S_VERSIONS[0], strict=True)


def test_hostpath_source_is_not_restricted():
    docs = rendered(
        "cpu-demo", models={"source": {"hostPath": "/srv/models"}}, serve={"target": {"model": "/model-source/x"}}
    )
    check_models(docs, "/model-source/x", hub=False, volume="hostPath")
    with pytest.raises(AssertionError, match="restricted"):
        check_restricted(docs)


def test_two_source_kinds_fail_the_render():
    with pytest.raises(HelmError, match="one of"):
        rendered("cpu-demo", models={"source": {"existingClaim": "a", "image": "b"}})


def test_broken_variants_fail():
    docs = _render("hub id with a token")
    router = next(c for c in _pods(docs)["head"]["containers"] if c["name"] == "router")
    router["env"].append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token"}}})
    with pytest.raises(AssertionError, match="init containers"):
        check_models(docs, HUB_ID, hub=True, volume=None)
    offline = _render("pack")  # a hub id needs the hub: a pack's offline init container is wrong for it
    with pytest.raises(AssertionError, match="hub access"):
        check_models(offline, "smollm2-135m-instruct", hub=True, volume=None)
    with pytest.raises((jsonschema.ValidationError, AssertionError, kubernetes_validate.ValidationError)):
        _validate(_render("gguf in an image volume"), newest_only=False)
