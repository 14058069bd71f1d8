"""Every pod the chart renders passes Pod Security "restricted", and the chart's own hardening holds
(k8s/README.md, "Hardening").

* The restricted profile's checks (Kubernetes' Pod Security Standards, baseline and restricted,
  latest version) implemented over each rendered pod spec of every overlay: the RayCluster's head
  and worker templates (with the autoscaler sidecar KubeRay adds to the head, whose security
  context is the chart's autoscalerOptions.securityContext; KubeRay's wait-gcs-ready init
  container copies the Ray container's) and the gateway's Deployment.
* The chart's own rules on top: no service-account token but on the head (its autoscaler scales the
  groups through the API), a read-only root filesystem with /tmp on a volume, /dev/shm as a memory
  volume on target pods.
* Broken variants fail: a hostPath volume or a privileged pod set through values, and hand edits of
  the rendered pods (seccomp Unconfined or missing, root, added capabilities, privilege escalation).
"""

from __future__ import annotations

import copy

import pytest

from tests.unit.test_k8s_manifests import OVERLAYS, _one, rendered

# Pod Security Standards (kubernetes.io/docs/concepts/security/pod-security-standards/)
BASELINE_CAPABILITIES = {
    "AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD", "NET_BIND_SERVICE",
    "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT",
}  # fmt: skip
RESTRICTED_VOLUME_TYPES = {
    "configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected", "secret",
}  # fmt: skip
SAFE_SYSCTLS = {
    "kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
    "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
    "net.ipv4.tcp_keepalive_probes",
}  # fmt: skip
SELINUX_TYPES = {"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}
GOOD_SECCOMP = {"RuntimeDefault", "Localhost"}


def pods(docs: list[dict]) -> dict[str, dict]:
    """name -> pod spec, the autoscaler sidecar added to the head as KubeRay adds it."""
    out = {}
    rc = _one(docs, "RayCluster")["spec"]
    head = copy.deepcopy(rc["headGroupSpec"]["template"]["spec"])
    opts = rc["autoscalerOptions"]
    head["containers"].append(
        {"name": "autoscaler", "securityContext": opts.get("securityContext"), "volumeMounts": opts.get("volumeMounts")}
    )
    out["head"] = head
    for group in rc["workerGroupSpecs"]:
        out[group["groupName"]] = group["template"]["spec"]
    for d in docs:
        if d["kind"] == "Deployment":
            out[d["metadata"]["name"]] = d["spec"]["template"]["spec"]
    return out


def _containers(spec: dict) -> list[dict]:
    return [*spec.get("initContainers", []), *spec["containers"], *spec.get("ephemeralContainers", [])]


def restricted_violations(spec: dict) -> list[str]:
    """What in a pod spec breaks Pod Security "restricted" (which includes baseline)."""
    bad = []
    psc = spec.get("securityContext") or {}
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(key):
            bad.append(f"{key}")
    for v in spec.get("volumes", []):
        kinds = set(v) - {"name"}
        if "hostPath" in kinds or not kinds <= RESTRICTED_VOLUME_TYPES:
            bad.append(f"volume {v['name']}: {sorted(kinds)}")
    for s in psc.get("sysctls", []):
        if s["name"] not in SAFE_SYSCTLS:
            bad.append(f"sysctl {s['name']}")
    pod_seccomp = (psc.get("seccompProfile") or {}).get("type")
    if pod_seccomp is not None and pod_seccomp not in GOOD_SECCOMP:
        bad.append(f"pod seccompProfile {pod_seccomp}")
    if psc.get("runAsUser") == 0:
        bad.append("pod runAsUser 0")
    for ctx in [psc, *((c.get("securityContext") or {}) for c in _containers(spec))]:
        se = ctx.get("seLinuxOptions") or {}
        if se.get("type", "") not in SELINUX_TYPES or se.get("user") or se.get("role"):
            bad.append(f"seLinuxOptions {se}")
        if (ctx.get("appArmorProfile") or {}).get("type") == "Unconfined":
            bad.append("appArmorProfile Unconfined")
        if (ctx.get("windowsOptions") or {}).get("hostProcess"):
            bad.append("hostProcess")
    for c in _containers(spec):
        name, sc = c["name"], c.get("securityContext") or {}
        if sc.get("privileged"):
            bad.append(f"{name}: privileged")
        if any(p.get("hostPort") for p in c.get("ports", [])):
            bad.append(f"{name}: hostPort")
        if sc.get("procMount", "Default") != "Default":
            bad.append(f"{name}: procMount")
        if sc.get("allowPrivilegeEscalation") is not False:
            bad.append(f"{name}: allowPrivilegeEscalation not false")
        if sc.get("runAsNonRoot") is False or not (sc.get("runAsNonRoot") or psc.get("runAsNonRoot")):
            bad.append(f"{name}: runAsNonRoot not true")
        if sc.get("runAsUser") == 0:
            bad.append(f"{name}: runAsUser 0")
        seccomp = (sc.get("seccompProfile") or {}).get("type")
        if (seccomp or pod_seccomp) not in GOOD_SECCOMP:
            bad.append(f"{name}: seccompProfile {seccomp or pod_seccomp}")
        caps = sc.get("capabilities") or {}
        if "ALL" not in caps.get("drop", []):
            bad.append(f"{name}: capabilities do not drop ALL")
        added = set(caps.get("add", []))
        if added - {"NET_BIND_SERVICE"}:
            bad.append(f"{name}: adds {sorted(added)}")
        if added - BASELINE_CAPABILITIES:
            bad.append(f"{name}: adds beyond baseline {sorted(added - BASELINE_CAPABILITIES)}")
    return bad


def check_restricted(docs: list[dict]) -> None:
    found = {name: restricted_violations(spec) for name, spec in pods(docs).items()}
    found = {name: bad for name, bad in found.items() if bad}
    assert not found, f'Pod Security "restricted" violations: {found}'


def _mounted_from(spec: dict, container: dict, path: str) -> dict | None:
    """The volume mounted at ``path`` in the container, or None."""
    names = [m["name"] for m in container.get("volumeMounts") or [] if m["mountPath"] == path]
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    return volumes.get(names[0], {}) if names else None


def check_hardening(docs: list[dict]) -> None:
    for name, spec in pods(docs).items():
        token = spec.get("automountServiceAccountToken")
        if name == "head":
            assert token is not False, "head: the autoscaler needs its service-account token"
        else:
            assert token is False, f"{name}: mounts a service-account token it does not use"
        for c in _containers(spec):
            assert (c.get("securityContext") or {}).get("readOnlyRootFilesystem") is True, f"{name}/{c['name']}"
            tmp = _mounted_from(spec, c, "/tmp")
            assert tmp is not None and "emptyDir" in tmp, f"{name}/{c['name']}: /tmp is not a volume"
        if name == "target":
            shm = _mounted_from(spec, spec["containers"][0], "/dev/shm")
            assert shm and shm["emptyDir"].get("medium") == "Memory", "target: /dev/shm is no memory volume"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_pod_passes_restricted(overlay):
    check_restricted(rendered(overlay))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_hardening(overlay):
    check_hardening(rendered(overlay))


# --------------------------------------------------------------------------- broken variants


def _head(spec):
    return spec["headGroupSpec"]["template"]["spec"]


def _target(spec):
    return spec["workerGroupSpecs"][0]["template"]["spec"]


def _sc(container: dict) -> dict:
    return container["securityContext"]


BROKEN_EDITS = {
    "container seccomp Unconfined": lambda s: _sc(_target(s)["containers"][0]).update(
        seccompProfile={"type": "Unconfined"}
    ),
    "no seccomp anywhere": lambda s: [
        _target(s)["securityContext"].pop("seccompProfile"),
        *(_sc(c).pop("seccompProfile") for c in _containers(_target(s))),
    ],
    "init container may escalate": lambda s: _sc(_target(s)["initContainers"][0]).pop("allowPrivilegeEscalation"),
    "capabilities not dropped": lambda s: _sc(_head(s)["containers"][1]).pop("capabilities"),
    "SYS_ADMIN added": lambda s: _sc(_head(s)["containers"][0])["capabilities"].update(add=["SYS_ADMIN"]),
    "root user": lambda s: _target(s)["securityContext"].update(runAsUser=0),
    "runAsNonRoot false on a container": lambda s: _sc(_target(s)["containers"][0]).update(runAsNonRoot=False),
    "autoscaler without a security context": lambda s: s["autoscalerOptions"].pop("securityContext"),
    "host network": lambda s: _head(s).update(hostNetwork=True),
    "host port": lambda s: _head(s)["containers"][0]["ports"][0].update(hostPort=6379),
}


@pytest.mark.parametrize("case", BROKEN_EDITS)
def test_broken_pod_fails_restricted(case):
    docs = rendered("gpu")
    BROKEN_EDITS[case](_one(docs, "RayCluster")["spec"])
    with pytest.raises(AssertionError, match="restricted"):
        check_restricted(docs)


@pytest.mark.parametrize(
    "values",
    [
        {"target": {"extraVolumes": [{"name": "data", "hostPath": {"path": "/data"}}]}},
        {"gateway": {"extraVolumes": [{"name": "data", "hostPath": {"path": "/data"}}]}},
    ],
    ids=["hostPath on target", "hostPath on gateway"],
)
def test_values_breaking_restricted_fail(values):
    with pytest.raises(AssertionError, match="restricted"):
        check_restricted(rendered("gpu", **values))


BROKEN_HARDENING = {
    "worker mounts a token": lambda s: _target(s).pop("automountServiceAccountToken"),
    "writable root": lambda s: _sc(_head(s)["containers"][1]).update(readOnlyRootFilesystem=False),
    "no /tmp volume": lambda s: _head(s)["containers"][0]["volumeMounts"].pop(0),
}


@pytest.mark.parametrize("case", BROKEN_HARDENING)
def test_broken_pod_fails_hardening(case):
    docs = rendered("gpu")
    BROKEN_HARDENING[case](_one(docs, "RayCluster")["spec"])
    with pytest.raises(AssertionError):
        check_hardening(docs)


def test_target_without_shm_fails_hardening():
    with pytest.raises(AssertionError, match="shm"):
        check_hardening(rendered("gpu", target={"shmSize": ""}))
