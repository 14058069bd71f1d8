"""Who may call (specdec/rpc/auth.py): bearer tokens, the workers' shared secret, TLS and mTLS, over real gRPC."""

from __future__ import annotations

from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from specdec.rpc.auth import (
    HEALTH_AND_REFLECTION,
    INTERNAL_HEADER,
    PUBLIC_HEADER,
    Tokens,
    channel_tls,
    credentials_metadata,
    server_interceptor,
    server_tls,
)
from tests.pki import make_pki

TOKEN_A, TOKEN_B = "a" * 32, "b-rotated-" + "x" * 22


def _server(interceptor, credentials=None) -> tuple[grpc.Server, int]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), interceptors=[interceptor])
    servicer = health.HealthServicer()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = (
        server.add_secure_port("localhost:0", credentials) if credentials else server.add_insecure_port("127.0.0.1:0")
    )
    server.start()
    return server, port


def _check(channel, metadata=()) -> grpc.StatusCode:
    try:
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), metadata=metadata, timeout=10)
        return grpc.StatusCode.OK
    except grpc.RpcError as exc:
        assert exc.code() != grpc.StatusCode.UNAUTHENTICATED or exc.details() == "missing or invalid credentials"
        return exc.code()


def test_tokens_from_a_file_and_the_environment(tmp_path, monkeypatch):
    f = tmp_path / "tokens"
    f.write_text(f"# current and next\n{TOKEN_A}\n\n{TOKEN_B}  # rotated in\n")
    monkeypatch.setenv("SPECDEC_TEST_TOKENS", "c" * 20 + ", " + "d" * 20)
    tokens = Tokens.load(f, "SPECDEC_TEST_TOKENS")
    assert all(tokens.accepts(t) for t in (TOKEN_A, TOKEN_B, "c" * 20, "d" * 20))
    assert not tokens.accepts("a" * 31) and not tokens.accepts("") and not tokens.accepts(None)
    (tmp_path / "empty").write_text("# nothing\n")
    with pytest.raises(ValueError, match="no tokens"):
        Tokens.load(tmp_path / "empty")
    (tmp_path / "short").write_text("abc\n")
    with pytest.raises(ValueError, match="16 characters"):
        Tokens.load(tmp_path / "short")


def test_public_api_needs_a_bearer_token_and_health_can_be_exempt():
    tokens = Tokens((TOKEN_A.encode(), TOKEN_B.encode()))
    server, port = _server(server_interceptor(tokens, PUBLIC_HEADER))
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            assert _check(ch) == grpc.StatusCode.UNAUTHENTICATED
            assert _check(ch, [(PUBLIC_HEADER, "Bearer wrong-token-0000000000")]) == grpc.StatusCode.UNAUTHENTICATED
            assert _check(ch, [(PUBLIC_HEADER, f"Basic {TOKEN_A}")]) == grpc.StatusCode.UNAUTHENTICATED
            assert _check(ch, credentials_metadata(TOKEN_A)) == grpc.StatusCode.OK
            assert _check(ch, credentials_metadata(TOKEN_B)) == grpc.StatusCode.OK  # rotation: both work
    finally:
        server.stop(None)
    server, port = _server(server_interceptor(tokens, PUBLIC_HEADER, exempt=HEALTH_AND_REFLECTION))
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            assert _check(ch) == grpc.StatusCode.OK
    finally:
        server.stop(None)


def test_workers_need_the_shared_secret():
    secret = "s" * 40
    server, port = _server(server_interceptor(Tokens((secret.encode(),)), INTERNAL_HEADER))
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            assert _check(ch) == grpc.StatusCode.UNAUTHENTICATED
            assert _check(ch, credentials_metadata(secret)) == grpc.StatusCode.UNAUTHENTICATED  # wrong header
            assert _check(ch, credentials_metadata(secret, INTERNAL_HEADER)) == grpc.StatusCode.OK
    finally:
        server.stop(None)


def test_tls_and_mutual_tls(tmp_path):
    pki = make_pki(tmp_path)
    tokens = Tokens((TOKEN_A.encode(),))
    open_all = server_interceptor(tokens, PUBLIC_HEADER, exempt=("/",))
    server, port = _server(open_all, server_tls(pki["server.crt"], pki["server.key"]))
    try:
        with grpc.secure_channel(f"localhost:{port}", channel_tls(pki["ca.crt"])) as ch:
            assert _check(ch) == grpc.StatusCode.OK
        with grpc.insecure_channel(f"localhost:{port}") as ch:  # plaintext to a TLS port fails
            assert _check(ch) == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop(None)
    server, port = _server(open_all, server_tls(pki["server.crt"], pki["server.key"], client_ca=pki["ca.crt"]))
    try:
        with grpc.secure_channel(f"localhost:{port}", channel_tls(pki["ca.crt"])) as ch:  # no client cert
            assert _check(ch) == grpc.StatusCode.UNAVAILABLE
        creds = channel_tls(pki["ca.crt"], pki["client.crt"], pki["client.key"])
        with grpc.secure_channel(f"localhost:{port}", creds) as ch:
            assert _check(ch) == grpc.StatusCode.OK
    finally:
        server.stop(None)
