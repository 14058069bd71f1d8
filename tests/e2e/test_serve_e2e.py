"""`specdec serve` as a real subprocess: embedded Ray, SmolLM2-135M workers, third-party clients.

The service is started from a YAML config on free ports with JSON logs; grpcurl (a third-party
client) lists the services through reflection, calls Generate, Tokenize, ListModels and the health
check, and sees an error's google.rpc details (the README's API section shows these calls);
`specdec generate --server` must print the same JSON (text, token_ids, finish_reason, usage) as the
local `specdec generate`; /metrics shows specdec_ series; the access log has a JSON line per request;
every socket the service and its Ray cluster listen on is on the loopback interface, the workers
refuse calls without the secret made for this start (which no log shows), and Ray refuses a wrong
token; SIGTERM ends it cleanly (exit code 0).
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.conftest import SMOLLM
from tests.e2e.serve_process import REPO, SPECDEC, cli_env, free_port, serve_process, wait_serving
from tests.grpc_helpers import run_grpcurl

PROMPT = "def fibonacci(n):"
GENERATION = "specdec.v1.Generation"


@pytest.fixture(scope="module")
def served(smollm_path, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    port, metrics_port, http_port = free_port(), free_port(), free_port()
    worker = {"model": SMOLLM, "dtype": "float32", "num_slots": 4, "max_len": 1024, "threads": 1}
    config = {
        "ray": {"num_cpus": 2},
        "target": dict(worker),
        "draft": dict(worker),  # SmolLM2 drafting for itself: a smoke configuration
        "router": {
            "port": port,
            "metrics_port": metrics_port,
            "http_port": http_port,
            "k_policy": {"k": 3, "adaptive": False},
            # a fixed draft deadline: scaled by the measured verify time, a loaded machine's noise
            # can make every draft late, and the checks that requests speculated would see none
            "draft_deadline_factor": 0.0,
        },
    }
    address = f"127.0.0.1:{port}"
    with serve_process(config, tmp) as (proc, log):
        wait_serving(proc, address, log, timeout=240)
        yield dict(
            proc=proc,
            address=address,
            metrics_port=metrics_port,
            http_port=http_port,
            log=log,
            log_path=tmp / "serve.log",
        )


def test_grpcurl_lists_services_calls_generate_and_health(served):
    address = served["address"]
    out = run_grpcurl("-plaintext", address, "list")
    assert out.returncode == 0, out.stderr
    assert set(out.stdout.split()) == {GENERATION, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"}
    out = run_grpcurl("-plaintext", address, "list", GENERATION)
    assert out.stdout.split() == [f"{GENERATION}.{m}" for m in ("Generate", "GenerateStream", "ListModels", "Tokenize")]

    body = {
        "request_id": "curl-1",
        "prompt": PROMPT,
        "max_tokens": 12,
        "speculation": {"mode": "SPECULATION_MODE_DRAFT"},
    }
    out = run_grpcurl("-plaintext", "-d", json.dumps(body), address, f"{GENERATION}/Generate", timeout=120)
    assert out.returncode == 0, out.stderr
    resp = json.loads(out.stdout)
    assert resp["request_id"] == "curl-1" and resp["finish_reason"] in ("stop", "length")
    assert len(resp["token_ids"]) == resp["usage"]["completion_tokens"] <= 12 and resp["text"]
    assert int(resp["speculation"]["drafted"]) > 0

    out = run_grpcurl(
        "-plaintext",
        "-d",
        json.dumps({"prompt": PROMPT, "max_tokens": 4}),
        address,
        f"{GENERATION}/GenerateStream",
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.count('"finishReason"') + out.stdout.count('"finish_reason"') == 1

    out = run_grpcurl("-plaintext", "-d", json.dumps({"prompt": PROMPT, "top_p": 2}), address, f"{GENERATION}/Generate")
    assert out.returncode != 0 and "InvalidArgument" in out.stdout + out.stderr and "top_p" in out.stdout + out.stderr
    # the details, as a program in any language reads them
    assert '"@type":"type.googleapis.com/google.rpc.BadRequest"' in out.stdout + out.stderr
    assert '"field_violations":[{"field":"top_p"' in out.stdout + out.stderr
    body = json.dumps({"prompt": "x", "model": "gpt-9"})
    out = run_grpcurl("-plaintext", "-d", body, address, f"{GENERATION}/Generate")
    assert "NotFound" in out.stdout + out.stderr and SMOLLM in out.stdout + out.stderr

    # Tokenize: what Generate runs (its usage.prompt_tokens), with and without the chat template
    out = run_grpcurl("-plaintext", "-d", json.dumps({"prompt": PROMPT}), address, f"{GENERATION}/Tokenize")
    assert out.returncode == 0, out.stderr
    tok = json.loads(out.stdout)
    assert tok["count"] == len(tok["token_ids"]) == resp["usage"]["prompt_tokens"]
    body = json.dumps({"prompt": PROMPT, "chat": True})
    out = run_grpcurl("-plaintext", "-d", body, address, f"{GENERATION}/Tokenize")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["count"] > tok["count"]  # the template adds the turn markers

    for service in ("", GENERATION):
        out = run_grpcurl("-plaintext", "-d", json.dumps({"service": service}), address, "grpc.health.v1.Health/Check")
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout) == {"status": "SERVING"}

    out = run_grpcurl("-plaintext", "-d", "{}", address, f"{GENERATION}/ListModels")
    models = json.loads(out.stdout)["models"]
    assert [(m["name"], m["role"], m.get("ready")) for m in models] == [
        (SMOLLM, "target", True),
        (SMOLLM, "draft", True),
    ]
    assert models[0]["vocab_size"] == 49152 and models[0]["eos_token_ids"] and models[0]["has_chat_template"]

    # the access log: one JSON line for the Generate above, without its text
    lines = [json.loads(x) for x in served["log_path"].read_text().splitlines() if x.startswith("{")]
    (access,) = [x for x in lines if x["logger"] == "specdec.access" and x["request_id"] == "curl-1"]
    assert access["status"] == "OK" and access["completion_tokens"] == resp["usage"]["completion_tokens"]
    assert access["total_ms"] >= access["ttft_ms"] > 0 and PROMPT not in json.dumps(access)


def test_generate_server_json_matches_local(served):
    flags = ["--target", SMOLLM, "--prompt", PROMPT, "--max-tokens", "24", "--json"]
    remote = subprocess.run(
        [*SPECDEC, "generate", *flags, "--server", served["address"]],
        cwd=REPO,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert remote.returncode == 0, remote.stderr
    local = subprocess.run(
        [*SPECDEC, "generate", *flags, "--draft", "none", "--dtype", "float32"],
        cwd=REPO,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert local.returncode == 0, local.stderr
    r, loc = json.loads(remote.stdout), json.loads(local.stdout)
    for key in ("text", "token_ids", "finish_reason", "usage"):
        assert r[key] == loc[key], key
    assert set(r["stats"]) == set(loc["stats"])  # the same JSON shape
    assert r["stats"]["drafted"] > 0 and r["stats"]["rounds"] < 24

    bad = subprocess.run(
        [*SPECDEC, "generate", *flags, "--top-p", "0", "--server", served["address"]],
        cwd=REPO,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 1 and "INVALID_ARGUMENT" in bad.stderr and "top_p" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_metrics_endpoint(served):
    text = urllib.request.urlopen(f"http://127.0.0.1:{served['metrics_port']}/metrics", timeout=10).read().decode()
    samples = {
        line.split(" ")[0]: float(line.split(" ")[-1])
        for line in text.splitlines()
        if line.startswith("specdec_") and " " in line
    }
    assert samples.get("specdec_generated_tokens_total", 0) > 0
    assert samples.get("specdec_rounds_total", 0) > 0
    assert samples.get("specdec_drafted_tokens_total", 0) > 0
    assert any(k.startswith("specdec_requests_total{") and 'outcome="invalid_argument"' in k for k in samples)
    assert 'specdec_worker_up{role="target",worker="target-0"} 1.0' in text


def test_the_openai_api_is_served_beside_grpc(served):
    """The gateway process `specdec serve` started: OpenAI's routes on the HTTP port, over the router."""
    url = f"http://127.0.0.1:{served['http_port']}"
    assert json.load(urllib.request.urlopen(url + "/health", timeout=30)) == {"status": "ok"}
    models = json.load(urllib.request.urlopen(url + "/v1/models", timeout=30))
    assert [m["id"] for m in models["data"]] == [SMOLLM]
    body = json.dumps({"model": SMOLLM, "prompt": PROMPT, "max_tokens": 4, "temperature": 0}).encode()
    req = urllib.request.Request(url + "/v1/completions", body, {"content-type": "application/json"})
    out = json.load(urllib.request.urlopen(req, timeout=120))
    assert out["object"] == "text_completion" and out["usage"]["completion_tokens"] >= 1


def _listening(pid: int) -> list[tuple[str, str, int]]:
    """(process, address, port) of every listening TCP socket of ``pid`` and its descendants."""
    import psutil

    root = psutil.Process(pid)
    out = []
    for p in [root, *root.children(recursive=True)]:
        try:
            name = f"{p.name()} {' '.join(p.cmdline())[:80]}"
            out += [(name, c.laddr.ip, c.laddr.port) for c in p.net_connections("inet") if c.status == "LISTEN"]
        except psutil.Error:  # it ended meanwhile
            pass
    return out


def _worker_addresses(log_path: Path) -> list[tuple[str, str]]:
    """(role, address) of the workers, from the launcher's "<role> workers ready at ..." lines. A
    line may start with output of Ray's workers written to the same stream without its newline, so
    the JSON record is read from its first brace."""
    found = []
    for line in log_path.read_text().splitlines():
        if "workers ready at" in line and "{" in line:
            message = json.JSONDecoder().raw_decode(line, line.index("{"))[0]["message"]
            found += [(message.split()[0], a) for a in message.split(" at ", 1)[1].split(", ")]
    return found


def test_only_loopback_sockets_and_internal_calls_need_secrets(served):
    """The embedded deployment binds nothing but 127.0.0.1 (router, metrics, workers, and Ray's GCS,
    raylet, agents and workers: cluster/local_ray.py); the workers refuse a caller without this
    start's secret; Ray refuses a wrong token; the secret is in no log."""
    import psutil

    from cluster.local_ray import is_loopback
    from specdec.rpc import worker_pb2, worker_pb2_grpc
    from specdec.rpc.auth import INTERNAL_HEADER

    sockets = _listening(served["proc"].pid)
    ports = {port for _, _, port in sockets}
    workers = _worker_addresses(served["log_path"])
    assert [r for r, _ in workers] == ["target", "draft"] and {int(a.rsplit(":", 1)[1]) for _, a in workers} <= ports
    assert {int(served["address"].rsplit(":", 1)[1]), served["metrics_port"], served["http_port"]} <= ports
    exposed = [s for s in sockets if not is_loopback(s[1])]
    assert not exposed, exposed
    assert any("gcs_server" in name for name, _, _ in sockets) and any("raylet" in name for name, _, _ in sockets)
    # and from this machine's other addresses, every one of those ports is closed
    outside = [
        a.address
        for addrs in psutil.net_if_addrs().values()
        for a in addrs
        if a.family == socket.AF_INET and not is_loopback(a.address)
    ]
    for host in outside:
        for _, _, port in sockets:
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection((host, port), timeout=5).close()

    for role, address in workers:
        stub_cls = worker_pb2_grpc.TargetServiceStub if role == "target" else worker_pb2_grpc.DraftServiceStub
        with grpc.insecure_channel(address) as ch:
            for metadata in (None, [(INTERNAL_HEADER, "not-the-secret-" + "0" * 20)]):
                with pytest.raises(grpc.RpcError) as err:
                    stub_cls(ch).Info(worker_pb2.InfoRequest(), metadata=metadata, timeout=10)
                assert err.value.code() is grpc.StatusCode.UNAUTHENTICATED, role

    # Ray's own token auth: a client with the wrong token is refused by the GCS (the variable keeps
    # Ray from swapping 127.0.0.1 for this machine's address, where nothing listens)
    gcs = next(f"127.0.0.1:{port}" for name, _, port in sockets if "gcs_server" in name)
    env = dict(cli_env(), RAY_AUTH_MODE="token", RAY_AUTH_TOKEN="f" * 64, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    status = subprocess.run(
        [sys.executable, "-m", "ray.scripts.scripts", "status", "--address", gcs],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert status.returncode != 0 and "InvalidAuthToken" in status.stdout + status.stderr, status.stderr[-2000:]

    # the secret made for this start: in the environment of the processes started after it (/proc
    # shows a process's environment as it started), in no log (ours or Ray's)
    raylet = next(p for p in psutil.Process(served["proc"].pid).children(recursive=True) if "raylet" in p.name())
    secret = raylet.environ()["SPECDEC_WORKER_SECRET"]
    assert len(secret) >= 32 and secret not in served["log_path"].read_text()
    log_dir = Path(next(a.split("=", 1)[1] for a in raylet.cmdline() if a.startswith("--log_dir=")))
    assert log_dir.is_dir()
    for f in log_dir.rglob("*"):
        if f.is_file():
            assert secret.encode() not in f.read_bytes(), f


def test_sigterm_shuts_down_cleanly(served):
    proc, log = served["proc"], served["log"]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(90) == 0
    log.seek(0)
    text = log.read()
    assert "received SIGTERM" in text and "specdec stopped" in text
    assert "Traceback" not in text
    with grpc.insecure_channel(served["address"]) as ch:
        with pytest.raises(grpc.RpcError):
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2)
    with pytest.raises(ConnectionRefusedError):  # the gateway went with it
        socket.create_connection(("127.0.0.1", served["http_port"]), timeout=5).close()
