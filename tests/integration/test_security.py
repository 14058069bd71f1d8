"""The public API with TLS and bearer tokens, the per-client limit and fair share, size bounds and
the reaping of a frozen client, against the real service (router + Ray workers, tiny models, real
gRPC and TLS).

The router here serves TLS with two accepted tokens (a rotation), health exempt, at most 2 calls in
flight per client, and pings every connection every 0.5 s (0.5 s to answer).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from router.access_log import ACCESS_LOGGER
from specdec.rpc import generate_pb2
from specdec.rpc.api_security import SecurityConfig
from specdec.rpc.auth import PUBLIC_HEADER, channel_tls
from specdec.rpc.client import ResourceExhausted, SpecdecClient, SpecdecError
from specdec.rpc.client_credentials import ClientCredentials
from tests.grpc_helpers import run_grpcurl
from tests.integration.service_fixture import MAX_LEN, MODEL, SLOTS, running_service
from tests.pki import make_pki

REPO = Path(__file__).resolve().parents[2]
TOKEN_A, TOKEN_B = "token-a-" + "0" * 24, "token-b-rotated-" + "1" * 16
REFUSED = "missing or invalid credentials"
GENERATION = "/specdec.v1.Generation/"


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    root = tmp_path_factory.mktemp("pki")
    files = make_pki(root)
    (root / "tokens").write_text(f"# the current token and the next one\n{TOKEN_A}\n{TOKEN_B}\n")
    files["tokens"] = root / "tokens"
    return files


WRITE_BOUND_S = 2.0  # router.stream_write_timeout_s here


@pytest.fixture(scope="module")
def secured(ray_cluster, actor_reaper, tiny_paths, pki):
    security = SecurityConfig(
        tls_cert=str(pki["server.crt"]), tls_key=str(pki["server.key"]), tokens_file=str(pki["tokens"])
    )
    with running_service(
        actor_reaper,
        tiny_paths,
        security=security,
        credentials=creds(pki, TOKEN_A),
        max_inflight_per_client=2,
        keepalive_time_s=0.5,
        keepalive_timeout_s=0.5,
        stream_write_timeout_s=WRITE_BOUND_S,
        default_max_tokens=8,
    ) as svc:
        yield svc


def creds(pki, token: str | None, **kw) -> ClientCredentials:
    return ClientCredentials(token=token, ca=str(pki["ca.crt"]), **kw)


def _code(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code(), err.value.details()


def test_tls_and_bearer_tokens(secured, pki, caplog):
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    address = secured.router.address
    with grpc.insecure_channel(address) as plain:  # plaintext to the TLS port: no connection
        code, _ = _code(lambda: health_pb2_grpc.HealthStub(plain).Check(health_pb2.HealthCheckRequest(), timeout=5))
        assert code is grpc.StatusCode.UNAVAILABLE
    before = secured.metric("specdec_requests_total", {"outcome": "unauthenticated"})
    for token in (None, "not-the-token-" + "x" * 20, TOKEN_A[:-1]):
        with SpecdecClient(address, credentials=creds(pki, token)) as client:
            calls = {
                "Generate": lambda: client.generate("hi", max_tokens=2, timeout=30),  # noqa: B023
                "GenerateStream": lambda: list(client.generate_stream("hi", max_tokens=2, timeout=30)),  # noqa: B023
                "ListModels": lambda: client.list_models(),  # noqa: B023
                "Tokenize": lambda: client.tokenize("hi"),  # noqa: B023
            }
            for name, call in calls.items():
                assert _code(call) == (grpc.StatusCode.UNAUTHENTICATED, REFUSED), (token, name)
            assert client.health() == "SERVING"  # exempt: probes need no token
    # Generate and GenerateStream are counted, each refusal has its access line
    assert secured.metric("specdec_requests_total", {"outcome": "unauthenticated"}) == before + 6
    denied = [r.access for r in caplog.records if r.name == ACCESS_LOGGER and r.access["status"] == "UNAUTHENTICATED"]
    assert len(denied) == 12 and {d["rpc"] for d in denied} == {"Generate", "GenerateStream", "ListModels", "Tokenize"}
    # both tokens of the rotation work
    for token in (TOKEN_A, TOKEN_B):
        with SpecdecClient(address, credentials=creds(pki, token)) as client:
            assert client.generate("hi", max_tokens=2, timeout=60).usage["completion_tokens"] <= 2
            assert [m["name"] for m in client.list_models()][0] == MODEL
    # grpcurl: reflection needs the token too (only health is exempt here)
    tls = ("-cacert", str(pki["ca.crt"]))
    out = run_grpcurl(*tls, address, "list")
    assert out.returncode != 0 and "Unauthenticated" in out.stdout + out.stderr
    out = run_grpcurl(*tls, "-H", f"{PUBLIC_HEADER}: Bearer {TOKEN_B}", address, "list")
    assert out.returncode == 0 and "specdec.v1.Generation" in out.stdout.split(), out.stderr


def test_mutual_tls(secured, pki, tiny_paths):
    """A router that requires a client certificate signed by the CA: none is no connection at all."""
    from router.config import RouterConfig
    from router.server import RouterThread, TargetBinding
    from router.workers import ActorEndpoint

    security = SecurityConfig(
        tls_cert=str(pki["server.crt"]), tls_key=str(pki["server.key"]), tls_client_ca=str(pki["ca.crt"])
    )
    binding = TargetBinding(MODEL, ActorEndpoint(secured.target, "target-0"), tokenizer=str(tiny_paths["llama"]))
    router = RouterThread([binding], RouterConfig(port=0, metrics_port=None), security=security).start(60)
    try:
        with pytest.raises(ConnectionError):
            SpecdecClient(router.address, credentials=creds(pki, None), wait_ready=3)
        mtls = creds(pki, None, cert=str(pki["client.crt"]), key=str(pki["client.key"]))
        with SpecdecClient(router.address, credentials=mtls) as client:
            assert client.generate("hi", max_tokens=2, timeout=60).finish_reason in ("stop", "length")
    finally:
        router.stop(grace=0)
    secured.wait_slots_free()


def test_per_client_concurrency_limit(secured, pki):
    """Two calls in flight per client: a third from the same token is RESOURCE_EXHAUSTED with a
    RetryInfo, while another client (another token) is served; once one ends, the next goes in."""
    before = secured.metric("specdec_requests_total", {"outcome": "resource_exhausted"})
    a = secured.client
    streams = [a.generate_stream("def fib(n):", max_tokens=MAX_LEN - 16, ignore_eos=True, timeout=120) for _ in "ab"]
    for s in streams:
        next(s)  # both are running
    with pytest.raises(ResourceExhausted) as err:
        a.generate("hi", max_tokens=2, timeout=30)
    assert "2 calls in flight" in err.value.details() and 0 < err.value.retry_delay <= 30
    with SpecdecClient(secured.router.address, credentials=creds(pki, TOKEN_B)) as b:
        assert b.generate("hi", max_tokens=2, timeout=60).usage["completion_tokens"] <= 2
    streams[0].close()  # cancels it
    t_end = time.monotonic() + 60
    while True:
        try:
            a.generate("hi", max_tokens=2, timeout=30)
            break
        except ResourceExhausted:
            assert time.monotonic() < t_end, "the cancelled call still counts"
            time.sleep(0.1)
    streams[1].close()
    assert secured.metric("specdec_requests_total", {"outcome": "resource_exhausted"}) >= before + 1
    secured.wait_slots_free()


def test_a_free_slot_goes_to_another_client_before_the_first_client_s_queue(secured, pki):
    """Fair share (router.fair_share), with the batch cut to one slot: client A runs one request
    and queues a second; client B queues one after it. The slot A's first request frees goes to
    B's; A's second waits (first come first served would have run it first)."""
    sched = secured.router.router.schedulers_for(MODEL)[0]

    async def state(capacity: int | None = None) -> tuple[list[str], list[str], int]:
        """(running, queued) request ids, and the batch capacity (set first when given), read on
        the router's loop."""
        if capacity is not None:
            sched.capacity = capacity
        return [j.request_id for j in sched.running], [j.request_id for j in sched.waiting], sched.capacity

    def until(cond) -> tuple[list[str], list[str], int]:
        t_end = time.monotonic() + 60
        while not cond(now := secured.router.run(state(), timeout=10)):
            assert time.monotonic() < t_end, now
            time.sleep(0.05)
        return now

    long = {"max_tokens": MAX_LEN - 16, "ignore_eos": True, "timeout": 120}
    *_, capacity = secured.router.run(state(1), timeout=10)
    try:
        with SpecdecClient(secured.router.address, credentials=creds(pki, TOKEN_B)) as b, ThreadPoolExecutor(2) as pool:
            a1 = secured.client.generate_stream("def fib(n):", request_id="a1", **long)
            next(a1)  # it holds the only slot
            a2 = secured.client.generate_stream("def fib(n):", request_id="a2", **long)
            a2_first = pool.submit(next, a2)  # each next blocks until its request has a slot
            until(lambda s: s[1] == ["a2"])
            b1 = b.generate_stream("hi", request_id="b1", **long)
            b1_first = pool.submit(next, b1)
            until(lambda s: s[1] == ["a2", "b1"])
            a1.close()  # cancels it: its slot frees
            running, waiting, _ = until(lambda s: s[0] and "a1" not in s[0])
            assert (running, waiting) == (["b1"], ["a2"])
            b1_first.result(timeout=60)
            b1.close()
            a2_first.result(timeout=60)  # A's queued request runs once B's ends
            a2.close()
    finally:
        secured.router.run(state(capacity), timeout=10)
    secured.wait_slots_free()


def test_a_client_with_no_slot_takes_one_from_a_client_above_its_share(secured, pki):
    """Preemption (router/preemption.py), with the batch cut to two slots: client A streams two
    requests and holds both; client B's request takes one of them at once instead of waiting for
    either to end. The one that gave its slot up caches its tokens again and finishes with the
    tokens it gets alone."""
    sched = secured.router.router.schedulers_for(MODEL)[0]

    async def set_capacity(capacity: int) -> int:
        old, sched.capacity = sched.capacity, capacity
        return old

    def running() -> list[str]:
        async def ids() -> list[str]:
            return [j.request_id for j in sched.running]

        return secured.router.run(ids(), timeout=10)

    kw = {"max_tokens": 300, "ignore_eos": True, "timeout": 120}  # long enough to hold the slots while B comes
    prompts = {"a1": "def fib(n):", "a2": "import numpy as np\n"}
    alone = {rid: secured.client.generate(p, **kw).token_ids for rid, p in prompts.items()}
    before = secured.metric("specdec_preemptions_total")
    capacity = secured.router.run(set_capacity(2), timeout=10)
    try:
        with SpecdecClient(secured.router.address, credentials=creds(pki, TOKEN_B)) as b, ThreadPoolExecutor(2) as pool:
            streams = {rid: secured.client.generate_stream(p, request_id=rid, **kw) for rid, p in prompts.items()}
            firsts = {rid: next(s) for rid, s in streams.items()}  # both hold a slot
            assert sorted(running()) == ["a1", "a2"]
            b1 = pool.submit(b.generate, "hi", request_id="b1", max_tokens=4, ignore_eos=True, timeout=60)
            assert b1.result(timeout=60).finish_reason == "length"
            tokens = {
                rid: list(firsts[rid].token_ids) + [t for c in s for t in c.token_ids] for rid, s in streams.items()
            }
    finally:
        secured.router.run(set_capacity(capacity), timeout=10)
    assert secured.metric("specdec_preemptions_total") == before + 1
    assert tokens == alone
    secured.wait_slots_free()


def test_message_size_bound(secured, pki):
    """A request over router.max_message_bytes is refused by gRPC before it reaches the servicer."""
    big = generate_pb2.GenerateRequest(prompt="x" * (4 << 20)).SerializeToString()
    with grpc.secure_channel(secured.router.address, channel_tls(pki["ca.crt"])) as ch:
        call = ch.unary_unary(GENERATION + "Generate")
        code, details = _code(lambda: call(big, metadata=[(PUBLIC_HEADER, f"Bearer {TOKEN_A}")], timeout=30))
    assert code is grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in details


_FROZEN_CLIENT = """
import sys, time
from specdec.rpc.client import SpecdecClient
from specdec.rpc.client_credentials import ClientCredentials
from specdec.rpc import generate_pb2_grpc
from specdec.rpc.grpc_options import channel_options
creds = ClientCredentials.load(ca=sys.argv[2])
client = SpecdecClient(sys.argv[1], credentials=creds)
# A 1 KB stream window that never grows: the server's writes block once the frozen client stops
# reading, so the call outlives the keepalive however fast the model is (not a race with the output).
window = [("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)]
client.channel = creds.channel(sys.argv[1], channel_options(64 << 20) + window)
client.stub = generate_pb2_grpc.GenerationStub(client.channel)
stream = client.generate_stream(
    "def fib(n):", max_tokens=int(sys.argv[3]), ignore_eos=True, mode="off", request_id="frozen", timeout=600
)
next(stream)
print("streaming", flush=True)
time.sleep(600)  # never reads again
"""


@pytest.mark.parametrize("client_state", ["frozen", "not_reading"])
def test_a_client_that_stops_reading_is_reaped_and_its_slots_freed(secured, pki, caplog, client_state):
    """A client that takes one chunk and then no more. "frozen": its process is stopped (SIGSTOP: it
    neither reads nor answers pings), so the keepalive (0.5 s + 0.5 s here) may drop it first.
    "not_reading": alive, answering pings, only not reading: the keepalive never fires, and the
    router's write bound (router.stream_write_timeout_s) ends the call once a chunk waits that long
    for the full flow-control window. Either way the call ends, its access line says CANCELLED
    (its request cancelled if it still ran), and its KV slots are free again."""
    caplog.set_level(logging.WARNING)  # every logger: gRPC's own included
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)  # (after: the capture handler takes this level)
    max_tokens = MAX_LEN - 32
    env = dict(os.environ, SPECDEC_API_TOKEN=TOKEN_B, PYTHONPATH=str(REPO))
    proc = subprocess.Popen(
        [sys.executable, "-c", _FROZEN_CLIENT, secured.router.address, str(pki["ca.crt"]), str(max_tokens)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "streaming", proc.stderr.read() if proc.poll() is not None else ""
        if client_state == "frozen":
            os.kill(proc.pid, signal.SIGSTOP)
        t_end = time.monotonic() + 60
        while True:
            done = [r.access for r in caplog.records if r.name == ACCESS_LOGGER and r.access["request_id"] == "frozen"]
            if done:
                break
            assert time.monotonic() < t_end, f"the {client_state} client's call is still running after 60 s"
            time.sleep(0.1)
        secured.wait_slots_free(timeout=10)
    finally:
        proc.kill()
        os.kill(proc.pid, signal.SIGCONT)
        proc.wait(30)
    (line,) = done
    # CANCELLED even when the tiny model had generated every token before gRPC's send buffer filled:
    # the call never delivered its end (a finished job's line says OK unless the write bound ends it)
    assert line["status"] == "CANCELLED" and line["completion_tokens"] <= max_tokens, line
    assert secured.worker_info("target").free_slots == SLOTS
    # a client cannot write tracebacks into the service's log by not reading
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []


def test_cli_generate_and_bench_take_credentials(secured, pki, tmp_path, capsys, monkeypatch):
    from specdec.cli.main import main

    monkeypatch.delenv("SPECDEC_API_TOKEN", raising=False)
    address, ca = secured.router.address, str(pki["ca.crt"])
    flags = ["generate", "--server", address, "--prompt", "def fib(n):", "--max-tokens", "4", "--json"]
    assert main([*flags, "--ca", ca, "--token-file", str(pki["tokens"])]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["usage"]["completion_tokens"] <= 4 and out["server"] == address
    assert main([*flags, "--ca", ca]) == 1  # no token
    assert "UNAUTHENTICATED" in capsys.readouterr().err
    monkeypatch.setenv("SPECDEC_API_TOKEN", TOKEN_B)  # the default variable
    assert main([*flags, "--ca", ca]) == 0
    capsys.readouterr()

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "p0", "prompt": "def fib(n):", "chat": False}) + "\n")
    report = tmp_path / "bench.json"
    bench = ["bench", "serve", "--server", address, "--prompts", str(prompts), "--max-tokens", "4"]
    bench += ["--modes", "off", "--no-warmup", "--metrics-url", "none", "--ca", ca, "--json", str(report)]
    assert main(bench) == 0
    (result,) = json.loads(report.read_text())["results"]
    assert [r["error"] for r in result["records"]] == [None]
    secured.wait_slots_free()


def test_specdec_error_for_unauthenticated_has_no_detail(secured, pki):
    """The refusal says nothing about which token was close (the same message for all)."""
    with SpecdecClient(secured.router.address, credentials=creds(pki, TOKEN_A + "x")) as client:
        with pytest.raises(SpecdecError) as err:
            client.generate("hi", max_tokens=2, timeout=30)
    assert err.value.details() == REFUSED
    with grpc.secure_channel(secured.router.address, channel_tls(pki["ca.crt"])) as ch:
        code, details = _code(lambda: ch.unary_unary(GENERATION + "NoSuchMethod")(b"", timeout=10))
    assert code is grpc.StatusCode.UNIMPLEMENTED  # unknown methods: gRPC's own answer, token or not
