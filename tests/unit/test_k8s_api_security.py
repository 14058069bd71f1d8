"""The chart's public-API security (k8s/specdec/templates/_security.tpl): TLS, mTLS and bearer-token
Secrets mounted into the router container and named in its serve config, and probes that still
reach a router behind them.

* Off by default: no `security` files, no Secret volumes, the kubelet's own gRPC probes.
* On: every file the serve config names lies in a Secret mounted read-only into the router; with
  TLS (or a token on health) no probe is a kubelet gRPC probe (plaintext only), each is an exec of
  specdec.rpc.health_probe whose files are mounted too. The rendered probe commands are run against
  a real gRPC server configured from the rendered serve config (SecurityConfig, as `specdec serve`
  builds it) over certificates laid out like the Secrets: SERVING, and refused with a wrong token.
* Broken copies fail: a grpc probe on a TLS port, a file outside the mounts, a misspelt field.
"""

from __future__ import annotations

import copy
from pathlib import Path

import jsonschema
import pytest
import yaml

from specdec.rpc.api_security import EXEMPT_PREFIXES, SecurityConfig
from specdec.rpc.auth import PUBLIC_HEADER, server_interceptor
from specdec.rpc.health_probe import main as health_probe
from specdec.rpc.server import start_server, stop_server
from tests.pki import make_pki
from tests.unit.test_k8s_manifests import HEALTH_SERVICE, _container, _one, check_schemas, rendered

PROBES = ("startupProbe", "readinessProbe", "livenessProbe")
FILE_KEYS = ("tls_cert", "tls_key", "tls_client_ca", "tokens_file")
PROBE_FILE_FLAGS = ("--ca", "--cert", "--key", "--token-file")
SECURED = ("gpu-api-tls-tokens", "cpu-demo-api-tokens")


def _parts(docs: list[dict]) -> tuple[SecurityConfig, dict, dict, dict]:
    """The serve config's security section, the router container, its pod spec and the Service."""
    serve = yaml.safe_load(_one(docs, "ConfigMap")["data"]["serve.yaml"])
    head = _one(docs, "RayCluster")["spec"]["headGroupSpec"]["template"]
    return (
        SecurityConfig.from_dict(serve.get("security")),
        _container(head, "router"),
        head["spec"],
        _router_service(docs),
    )


def _router_service(docs: list[dict]) -> dict:
    """The router's Service (the gateway, when enabled, has its own)."""
    (svc,) = [
        d for d in docs if d["kind"] == "Service" and d["spec"]["selector"]["app.kubernetes.io/component"] == "head"
    ]
    return svc


def _secret_dirs(router: dict, pod: dict) -> dict[str, str]:
    """Mount path -> Secret name, for the Secret volumes mounted read-only into the router."""
    secrets = {v["name"]: v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v}
    return {
        m["mountPath"]: secrets[m["name"]] for m in router["volumeMounts"] if m["name"] in secrets and m.get("readOnly")
    }


def _in_a_secret(path: str, dirs: dict[str, str]) -> bool:
    return any(Path(path).parent == Path(d) for d in dirs)


def check_api_security(docs: list[dict]) -> None:
    sec, router, pod, svc = _parts(docs)
    dirs = _secret_dirs(router, pod)
    for key in FILE_KEYS:
        path = getattr(sec, key)
        assert path is None or _in_a_secret(path, dirs), (
            f"security.{key}: {path} is in no Secret mounted into the router"
        )
    token_on_health = sec.token_auth and "health" not in sec.exempt
    for name in PROBES:
        probe = router[name]
        if not (sec.tls or token_on_health):
            assert "grpc" in probe, f"{name}: the kubelet's grpc probe will do (no TLS, health open)"
            continue
        assert "grpc" not in probe, f"{name}: the kubelet's grpc probe speaks plaintext only"
        command = probe["exec"]["command"]
        assert command[:3] == ["python", "-m", "specdec.rpc.health_probe"], command
        files = [a.split("=", 1)[1] for a in command[3:] if a.split("=", 1)[0] in PROBE_FILE_FLAGS]
        assert all(_in_a_secret(f, dirs) for f in files), f"{name}: {files} not all mounted"
        assert sec.tls == any(a.startswith("--ca=") for a in command), f"{name}: TLS without a CA"
        assert bool(sec.tls_client_ca) == any(a.startswith("--cert=") for a in command), f"{name}: mTLS"
        assert not token_on_health or any(a.startswith("--token-file=") for a in command), f"{name}: no token"
    (grpc_port,) = [p for p in svc["spec"]["ports"] if p["name"] == "grpc"]
    assert (grpc_port["appProtocol"] == "kubernetes.io/h2c") != sec.tls, "the Service's appProtocol: h2c is plaintext"


def test_api_security_is_off_by_default():
    sec, router, pod, _ = _parts(rendered("gpu"))
    # off, and said so: the router binds 0.0.0.0 behind the chart's ClusterIP Service
    assert sec == SecurityConfig(allow_insecure=True) and _secret_dirs(router, pod) == {}
    check_api_security(rendered("gpu"))


@pytest.mark.parametrize("overlay", SECURED)
def test_api_security_on_mounts_and_probes_agree(overlay):
    docs = rendered(overlay)
    check_api_security(docs)
    sec, router, pod, _ = _parts(docs)
    assert set(_secret_dirs(router, pod).values()) >= {"specdec-api-tokens"}
    assert sec.tokens_file and sec.exempt == (["health"] if overlay.startswith("cpu") else [])


def test_mtls_without_tls_is_refused_by_the_chart():
    with pytest.raises(Exception, match="needs router.tls.secretName"):
        rendered("gpu", router={"tls": {"clientCASecretName": "ca-only"}})


def _lay_out(docs: list[dict], root: Path) -> tuple[SecurityConfig, dict[str, Path]]:
    """The Secrets' files under ``root`` (certificates for the name the probes check) and the serve
    config's security with its paths moved there; (that config, mount path -> its directory)."""
    sec, router, pod, _ = _parts(docs)
    dirs = _secret_dirs(router, pod)
    command = router["readinessProbe"]["exec"]["command"]
    name = next(a.split("=", 1)[1] for a in command if a.startswith("--server-name="))
    (root / "pki").mkdir()
    pki = make_pki(root / "pki", name)
    moved = {d: root / Path(d).name for d in dirs}
    files = {"tls.crt": pki["server.crt"], "tls.key": pki["server.key"], "ca.crt": pki["ca.crt"]}
    for d, secret in dirs.items():
        moved[d].mkdir()
        if secret == "specdec-api-tokens":
            (moved[d] / "tokens").write_text(f"# current\n{'k' * 40}\n")
        else:
            for key in ("ca.crt",) if "client-ca" in secret else ("tls.crt", "tls.key", "ca.crt"):
                (moved[d] / key).write_bytes(files[key].read_bytes())

    def move(path: str) -> str:
        return next((str(moved[d] / Path(path).name) for d in dirs if Path(path).parent == Path(d)), path)

    raw = {k: (move(v) if k in FILE_KEYS and v else v) for k, v in sec.to_dict().items()}
    return SecurityConfig.from_dict(raw), moved


def test_rendered_probes_pass_against_a_real_tls_router(tmp_path):
    docs = rendered("gpu-api-tls-tokens")
    sec, moved = _lay_out(docs, tmp_path)
    assert sec.tls and sec.tls_client_ca and sec.token_auth and sec.exempt == []
    exempt = tuple(EXEMPT_PREFIXES[e] for e in sec.exempt)
    server, port = start_server(
        [(lambda servicer, server: None, None, HEALTH_SERVICE)],
        credentials=sec.server_credentials(),
        interceptors=[server_interceptor(sec.tokens(), PUBLIC_HEADER, exempt)],
    )
    router = _parts(docs)[1]

    def run(probe: dict) -> int:
        args = []
        for a in probe["exec"]["command"][3:]:
            flag, _, value = a.partition("=")
            value = f"127.0.0.1:{port}" if flag == "--address" else value
            for d, local in moved.items():
                value = value.replace(d, str(local))
            args.append(f"{flag}={value}")
        return health_probe([*args, "--timeout=5"])

    try:
        assert [run(router[name]) for name in PROBES] == [0, 0, 0]
        (moved["/etc/specdec-tokens"] / "tokens").write_text("w" * 40 + "\n")  # not the token the server read
        assert run(router["livenessProbe"]) == 1
    finally:
        stop_server(server, 0)


# --------------------------------------------------------------------------- broken copies


def _router_of(docs: list[dict]) -> dict:
    return _container(_one(docs, "RayCluster")["spec"]["headGroupSpec"]["template"], "router")


def _serve_security(docs: list[dict], **changes) -> None:
    cm = _one(docs, "ConfigMap")
    serve = yaml.safe_load(cm["data"]["serve.yaml"])
    serve["security"].update(changes)
    cm["data"]["serve.yaml"] = yaml.safe_dump(serve)


BROKEN = {
    "a kubelet grpc probe on the TLS port": lambda d: _router_of(d).update(livenessProbe={"grpc": {"port": 50051}}),
    "the certificate outside the mounts": lambda d: _serve_security(d, tls_cert="/etc/specdec/tls.crt"),
    "the tokens Secret not mounted": lambda d: _router_of(d).update(
        volumeMounts=[m for m in _router_of(d)["volumeMounts"] if m["name"] != "api-tokens"]
    ),
    "the probe's CA not mounted": lambda d: _router_of(d)["readinessProbe"]["exec"]["command"].append(
        "--ca=/etc/ssl/ca.crt"
    ),
}


@pytest.mark.parametrize("case", BROKEN)
def test_broken_api_security_fails(case):
    docs = rendered("gpu-api-tls-tokens")
    BROKEN[case](docs)
    with pytest.raises(AssertionError):
        check_api_security(docs)


def test_misspelt_secret_volume_fails_validation():
    rc = copy.deepcopy(_one(rendered("gpu-api-tls-tokens"), "RayCluster"))
    volumes = rc["spec"]["headGroupSpec"]["template"]["spec"]["volumes"]
    (tls,) = [v for v in volumes if v["name"] == "api-tls"]
    tls["secret"]["secretname"] = tls["secret"].pop("secretName")
    with pytest.raises((AssertionError, jsonschema.ValidationError)):
        check_schemas(rc)
