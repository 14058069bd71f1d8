"""OpenTelemetry traces across the service (docs/design.md, Telemetry), against a real OTLP receiver
(tests/otlp_receiver.py: a gRPC TraceService on loopback).

The service without Ray, to stay fast: the target and draft workers started by hand
(``python -m target_worker``, ``python -m draft_worker``: their own processes, which get the OTEL_*
variables as a worker actor does, through their environment), tiny models, the router in this
process (``RouterThread``), and the HTTP gateway process in front of it. With the variables set,
each request is one trace holding the router's request span, one ``round`` span per round the
response reports, and both workers' spans, joined by the ``traceparent`` each call carries; a
caller's trace (gRPC metadata or an HTTP header through the gateway) is kept, and a request through
the gateway has the gateway's HTTP span between the caller's and the router's. Without them nothing
is exported and no SDK provider exists. Worker actors on a joined Ray cluster get the variables
through their runtime_env (the headers excepted).
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import grpc
import httpx
import pytest

from specdec.core.request_state import KPolicy
from specdec.rpc import generate_pb2, generate_pb2_grpc, tracing
from specdec.rpc.api_security import SecurityConfig
from tests.otlp_receiver import ReceivedSpan, otlp_receiver

REPO = Path(__file__).resolve().parents[2]
MODEL = "tiny-llama"
GENERATE = "specdec.v1.Generation/Generate"
STREAM = "specdec.v1.Generation/GenerateStream"
VERIFY = "specdec.v1.TargetService/Verify"
HTTP_COMPLETIONS = "POST /v1/completions"
PROPOSE = "specdec.v1.DraftService/Propose"
DRAFT = generate_pb2.SpeculationOptions(mode=generate_pb2.SPECULATION_MODE_DRAFT, k=3)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _no_otel_env(monkeypatch) -> None:
    for key in [k for k in os.environ if k.startswith("OTEL_")]:
        monkeypatch.delenv(key)


@contextmanager
def _worker(module: str, model: Path, log: Path, port: int = 0) -> Iterator[subprocess.Popen]:
    """A worker process serving ``model`` (stderr to ``log``). SIGTERM at the end: it exports the
    spans it still holds as it exits."""
    cmd = [sys.executable, "-m", module, "--model", str(model), "--port", str(port), "--threads", "1"]
    cmd += ["--max-len", "1024"]
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _address(proc: subprocess.Popen, log: Path) -> str:
    """The worker's address, once it serves (it prints "... serving MODEL on HOST:PORT")."""
    line = proc.stdout.readline()
    assert " serving " in line, (line, log.read_text()[-2000:])
    return line.split()[-1]


@contextmanager
def _service(tiny_paths, tmp: Path, restarts: list | None = None) -> Iterator[tuple[str, str]]:
    """The workers, the router and the gateway; yields (the router's gRPC address, the gateway's URL).
    With ``restarts`` (a list), the target listens on a fixed port and the list gets a function that
    kills it (SIGKILL, as a crash) and starts a new one there, as a supervisor restarts a worker."""
    from cluster.gateway_process import start_gateway
    from router.config import RouterConfig
    from router.server import RouterThread, TargetBinding
    from router.workers import StaticEndpoint

    with ExitStack() as stack:
        target_port = 0 if restarts is None else _free_port()
        # both start at once: loading torch is most of their start
        target = stack.enter_context(_worker("target_worker", tiny_paths["llama"], tmp / "target.log", target_port))
        draft = stack.enter_context(_worker("draft_worker", tiny_paths["llama-draft"], tmp / "draft.log"))
        target_address = _address(target, tmp / "target.log")
        binding = TargetBinding(
            MODEL,
            StaticEndpoint(target_address, "target-0"),
            StaticEndpoint(_address(draft, tmp / "draft.log"), "draft-0"),
            "tiny-llama-draft",
            tokenizer=str(tiny_paths["llama"]),
        )
        # the fixture's router (tests/integration/service_fixture.py): two lanes and pre-drafting
        config = RouterConfig(
            port=0,
            metrics_port=None,
            k_policy=KPolicy(k=3, adaptive=True, k_min=1, k_max=6),
            micro_batches=2,
            split_min_batch=2,
            predraft=True,
            draft_deadline_s=5.0,
        )
        if restarts is not None:

            def restart() -> None:
                target.kill()
                target.wait()
                log = tmp / "target-restarted.log"
                again = stack.enter_context(_worker("target_worker", tiny_paths["llama"], log, target_port))
                assert _address(again, log) == target_address

            restarts.append(restart)
        router = RouterThread([binding], config).start(connect_timeout=120)
        stack.callback(router.stop, 0)  # before the workers go: it flushes the router's spans
        gw_log = stack.enter_context(open(tmp / "gateway.log", "w+"))
        port = _free_port()
        gateway = start_gateway(
            router.address, "127.0.0.1", port, SecurityConfig(), cwd=REPO, stdout=gw_log, stderr=gw_log
        )
        stack.callback(gateway.stop)
        yield router.address, f"http://127.0.0.1:{port}"


def _requests(address: str, url: str, caller: str, http_caller: str) -> dict[str, int]:
    """Three requests one after another (each round then holds one request, whose trace holds the
    workers' spans): Generate with a caller's traceparent, GenerateStream without, and a completion
    through the gateway with a traceparent header. Returns request id -> the rounds it reports."""
    rounds = {}
    with grpc.insecure_channel(address) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        req = generate_pb2.GenerateRequest(
            request_id="traced-a", prompt="def fib(n):", max_tokens=12, ignore_eos=True, speculation=DRAFT
        )
        out = stub.Generate(req, metadata=[("traceparent", caller)], timeout=120)
        rounds["traced-a"] = out.speculation.rounds
        req = generate_pb2.GenerateRequest(
            request_id="traced-b", prompt="hello world, ", max_tokens=12, ignore_eos=True, speculation=DRAFT
        )
        (last,) = [c for c in stub.GenerateStream(req, timeout=120) if c.finish_reason]
        rounds["traced-b"] = last.speculation.rounds
    body = {
        "model": MODEL,
        "prompt": "abcabcabc",
        "max_tokens": 12,
        "ignore_eos": True,
        "speculation": {"mode": "draft"},
    }
    headers = {"traceparent": http_caller, "x-request-id": "traced-c"}
    resp = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=120)
    assert resp.status_code == 200, resp.text
    rounds["traced-c"] = -1  # the OpenAI reply carries no round count: the span's attribute says it
    return rounds


def _request_span(spans: list[ReceivedSpan], request_id: str) -> ReceivedSpan | None:
    found = [s for s in spans if s.name in (GENERATE, STREAM) and s.attributes.get("specdec.request_id") == request_id]
    assert len(found) <= 1, found
    return found[0] if found else None


def _complete(spans: list[ReceivedSpan], ids, http_ids=()) -> bool:
    """Every request's span, and in its trace both workers' (the workers export on their own clock),
    and the gateway's for ``http_ids``."""
    for rid in ids:
        root = _request_span(spans, rid)
        if root is None:
            return False
        names = {s.name for s in spans if s.trace_id == root.trace_id}
        if not {VERIFY, PROPOSE} <= names or (rid in http_ids and HTTP_COMPLETIONS not in names):
            return False
    return True


def _gateway_span(spans: list[ReceivedSpan], request_id: str, caller: tuple[str, str]) -> ReceivedSpan:
    """The gateway's span of an HTTP request: a SERVER span, child of the caller's, whose child is
    the router's request span."""
    root = _request_span(spans, request_id)
    (gw,) = [s for s in spans if s.trace_id == root.trace_id and s.service == "specdec-gateway"]
    assert (gw.name, gw.kind) == (HTTP_COMPLETIONS, 2), gw  # SERVER
    assert (gw.trace_id, gw.parent_id) == caller
    assert root.parent_id == gw.span_id
    assert gw.attributes["http.response.status_code"] == 200
    assert gw.attributes["http.route"] == "/v1/completions"
    assert gw.attributes["specdec.request_id"] == request_id
    return gw


def _trace(spans: list[ReceivedSpan], request_id: str) -> list[ReceivedSpan]:
    root = _request_span(spans, request_id)
    return [s for s in spans if s.trace_id == root.trace_id]


def _check_trace(
    spans: list[ReceivedSpan], request_id: str, rounds: int, caller: tuple[str, str] | None, tokens: int = 12
) -> None:
    root = _request_span(spans, request_id)
    # the router's request span and what hangs under it (the gateway's span above it: _gateway_span)
    mine = [s for s in spans if s.trace_id == root.trace_id and s.service != "specdec-gateway"]
    by_id = {s.span_id: s for s in mine}
    if caller is not None:  # the caller's trace is kept, and its span is the request span's parent
        assert (root.trace_id, root.parent_id) == caller
    else:
        assert root.parent_id == ""
    assert root.attributes["gen_ai.request.model"] == MODEL
    assert root.attributes["rpc.grpc.status_code"] == 0
    assert root.attributes["gen_ai.usage.output_tokens"] == tokens
    assert root.attributes["gen_ai.response.finish_reasons"] == ["length"]
    assert root.attributes["specdec.speculation.mode"] == "draft"
    # one round span per round the response reports, each a child of the request's span (a round
    # a target restart cut short says so, and is not one of them)
    round_spans = [s for s in mine if s.name == "round" and not s.attributes.get("specdec.target_restarted")]
    assert len(round_spans) == root.attributes["specdec.rounds"]
    if rounds >= 0:
        assert len(round_spans) == rounds
    assert all(s.parent_id == root.span_id for s in round_spans)
    # one tree: every span's parent is in this trace (the root's is the caller's)
    assert all(s.parent_id in by_id for s in mine if s is not root), [
        (s.service, s.name) for s in mine if s is not root and s.parent_id not in by_id
    ]
    services = {s.service for s in mine}
    assert services == {"specdec-router", "specdec-target-worker", "specdec-draft-worker"}, services
    # the workers' spans hang under the round's phases: Verify under verify (or its replay)
    for s in mine:
        if s.name == VERIFY:
            assert by_id[s.parent_id].name in ("verify", "replay"), by_id[s.parent_id].name
            assert s.service == "specdec-target-worker" and s.kind == 2  # SERVER
        if s.name == PROPOSE:  # this round's draft, or the next round's pre-draft
            assert by_id[s.parent_id].name in ("draft_wait", "round"), by_id[s.parent_id].name
    verify = [s for s in mine if s.name == "verify" and by_id[s.parent_id] in round_spans]
    assert len(verify) == len(round_spans)


def test_each_request_is_one_trace_over_router_and_workers(tiny_paths, tmp_path, monkeypatch):
    _no_otel_env(monkeypatch)
    caller = (secrets.token_hex(16), secrets.token_hex(8))
    http_caller = (secrets.token_hex(16), secrets.token_hex(8))
    with otlp_receiver() as rx:
        # the standard variables, as a deployment sets them; the worker processes inherit them
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", rx.endpoint)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_INSECURE", "true")
        monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "200")  # ms: export soon, the test waits less
        with _service(tiny_paths, tmp_path) as (address, url):
            assert tracing.active and tracing.tracer() is not None
            rounds = _requests(
                address, url, f"00-{caller[0]}-{caller[1]}-01", f"00-{http_caller[0]}-{http_caller[1]}-01"
            )
        assert not tracing.active and tracing.tracer() is None  # the router's stop ended it
        spans = rx.wait_for(lambda got: _complete(got, rounds, http_ids={"traced-c"}), timeout=90)
    roots = {rid: _request_span(spans, rid) for rid in rounds}
    assert len({r.trace_id for r in roots.values()}) == 3  # one trace per request
    _check_trace(spans, "traced-a", rounds["traced-a"], caller)
    _check_trace(spans, "traced-b", rounds["traced-b"], None)
    # through the gateway: caller -> the gateway's HTTP span -> the router's request span -> workers
    gateway = _gateway_span(spans, "traced-c", http_caller)
    _check_trace(spans, "traced-c", rounds["traced-c"], (http_caller[0], gateway.span_id))
    assert not any(s.service == "specdec-gateway" for rid in ("traced-a", "traced-b") for s in _trace(spans, rid))


def test_a_restarted_target_shows_as_a_replay(tiny_paths, tmp_path, monkeypatch):
    """The target crashes mid-stream and comes back on its address: the request completes, and its
    trace shows the round's wait as a ``replay`` span under the round's phase, holding no call (the
    new process lost the caches the call built on), then the request's tokens cached again in the
    Verify calls the new process served: under ``prefill`` spans (chunks before the last) or the
    next round's ``verify``, that round's span counting them (docs/design.md, Recovery)."""
    _no_otel_env(monkeypatch)
    restarts: list = []
    with otlp_receiver() as rx:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", rx.endpoint)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_INSECURE", "true")
        monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "200")
        with _service(tiny_paths, tmp_path, restarts) as (address, _):
            with grpc.insecure_channel(address) as channel:
                req = generate_pb2.GenerateRequest(
                    request_id="traced-r", prompt="def fib(n):", max_tokens=160, ignore_eos=True, speculation=DRAFT
                )
                chunks = []
                for chunk in generate_pb2_grpc.GenerationStub(channel).GenerateStream(req, timeout=180):
                    if not chunks:
                        restarts[0]()  # the first tokens are out: the rest needs the new target
                    chunks.append(chunk)
        spans = rx.wait_for(lambda got: _complete(got, ["traced-r"]), timeout=90)
    assert chunks[-1].finish_reason == "length" and chunks[-1].usage.completion_tokens == 160
    _check_trace(spans, "traced-r", chunks[-1].speculation.rounds, None, tokens=160)
    mine = _trace(spans, "traced-r")
    by_id = {s.span_id: s for s in mine}
    replays = [s for s in mine if s.name == "replay"]
    assert len(replays) == 1, [s.name for s in mine]
    (replay,) = replays
    assert by_id[replay.parent_id].name in ("verify", "prefill"), by_id[replay.parent_id].name
    assert replay.service == "specdec-router" and replay.attributes["specdec.worker"] == "target-0"
    assert [s for s in mine if s.parent_id == replay.span_id] == [] and replay.status_code != 2
    after = [s for s in mine if s.start_ns > replay.end_ns and s.trace_id == replay.trace_id]
    recached = [s for s in after if s.name == "prefill" or s.attributes.get("specdec.prefill.tokens", 0) > 0]
    assert recached, [(s.name, s.attributes) for s in after]
    ids = {s.span_id for s in recached}
    holders = [s for s in after if s.span_id in ids or (s.parent_id in ids and s.name == "verify")]
    calls = [c for p in holders for c in mine if c.parent_id == p.span_id and c.service == "specdec-target-worker"]
    assert calls and all(c.name == "specdec.v1.TargetService/Verify" for c in calls)


def test_off_without_the_variables(tiny_paths, tmp_path, monkeypatch):
    """No OTEL_* variables: the same service exports nothing and builds no provider; the SDK is not
    even imported. ``OTEL_SDK_DISABLED`` and the ``none`` exporter win over an endpoint."""
    _no_otel_env(monkeypatch)
    with otlp_receiver() as rx:
        with _service(tiny_paths, tmp_path) as (address, url):
            assert not tracing.active and tracing.tracer() is None
            _requests(address, url, f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01", "")
        assert rx.exports == 0 and rx.spans == []
        endpoint = {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": rx.endpoint}
    assert not tracing.wanted({})
    assert tracing.wanted(endpoint) and tracing.wanted({"OTEL_TRACES_EXPORTER": "otlp"})
    assert not tracing.wanted({**endpoint, "OTEL_SDK_DISABLED": "true"})
    assert not tracing.wanted({**endpoint, "OTEL_TRACES_EXPORTER": "none"})
    code = (
        "import sys, router.server, specdec.rpc.worker_host, gateway.app; from specdec.rpc import tracing;"
        "print(tracing.setup('x'), any(m.startswith('opentelemetry.sdk') for m in sys.modules))"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["False", "False"], out.stderr
    # the gateway's app has no span middleware at all while off, and has it once the variables ask
    # (its metrics' middleware, gateway/observe.py, is there either way)
    from gateway.app import GatewayConfig, create_app
    from gateway.http_spans import HttpSpans
    from gateway.observe import Observed

    assert [m.cls for m in create_app(GatewayConfig()).user_middleware] == [Observed]
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://127.0.0.1:4317")
    assert [m.cls for m in create_app(GatewayConfig()).user_middleware] == [HttpSpans, Observed]


@pytest.mark.parametrize(
    "headers, forwarded",
    [
        ({"traceparent": "00-" + "a" * 32 + "-" + "b" * 16 + "-01", "tracestate": "k=v"}, 2),
        ({"traceparent": "00-" + "a" * 32 + "-" + "b" * 16 + "-01"}, 1),
        ({"traceparent": "not a traceparent"}, 0),
        ({"traceparent": "00-" + "a" * 32 + "-" + "b" * 16 + "-01\n"}, 1),  # trimmed
        ({"tracestate": "k=v"}, 0),  # no parent: nothing to join
    ],
)
def test_gateway_forwards_only_wellformed_trace_headers(headers, forwarded):
    assert len(tracing.forwarded(headers)) == forwarded


def test_worker_actors_get_the_variables_but_not_the_headers(monkeypatch):
    """A joined cluster's raylets were started elsewhere: the actors' runtime_env carries the OTEL_*
    variables, never the exporter's headers (credentials; Ray logs a runtime_env), and a
    placement's own env_vars win."""
    from specdec.rpc.worker_host import actor_options

    _no_otel_env(monkeypatch)
    assert "runtime_env" not in actor_options(None, {"target_gpu": 1})  # off: the options are as before
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4317")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "specdec")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "authorization=Bearer secret")
    placement = {"resources": {"target_gpu": 1}, "runtime_env": {"env_vars": {"OTEL_SERVICE_NAME": "mine", "A": "1"}}}
    env = actor_options(placement, {})["runtime_env"]["env_vars"]
    assert env == {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317", "OTEL_SERVICE_NAME": "mine", "A": "1"}
