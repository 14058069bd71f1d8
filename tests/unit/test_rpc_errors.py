"""Errors by gRPC's conventions: rich status details, undecodable requests, the client's structured exceptions.

Real gRPC servers on loopback (the thread-pool server the workers run and the grpc.aio server the
router runs, both from specdec.rpc.server) with a small Generation servicer whose answers are set
by the prompt; the real SpecdecClient reads them.
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import threading

import grpc
import pytest
from google.rpc import error_details_pb2

from specdec.core.params import InvalidParams
from specdec.rpc import decode_guard, generate_pb2, generate_pb2_grpc
from specdec.rpc.client import InvalidArgument, ResourceExhausted, SpecdecClient, Unavailable
from specdec.rpc.client_errors import from_rpc_error
from specdec.rpc.decode_guard import find_bad_field
from specdec.rpc.errors import RpcStatusError, rich_status_for, rpc_method
from specdec.rpc.server import start_aio_server, start_server

GENERATION = "specdec.v1.Generation"
REQUEST = generate_pb2.GenerateRequest.DESCRIPTOR


def _details(status) -> dict[str, object]:
    out: dict[str, object] = {}
    for any_ in status.to_proto().details:
        for cls in (error_details_pb2.BadRequest, error_details_pb2.RetryInfo):
            msg = cls()
            if any_.Unpack(msg):
                out[cls.__name__] = msg
    return out


# ---- the mapping ---------------------------------------------------------------------------


def test_invalid_params_carry_a_bad_request_naming_the_field():
    status = rich_status_for(InvalidParams("top_p", "must be in (0, 1] (got 2.0)"))
    assert status.code is grpc.StatusCode.INVALID_ARGUMENT and status.message == "top_p: must be in (0, 1] (got 2.0)"
    (violation,) = _details(status)["BadRequest"].field_violations
    assert (violation.field, violation.description) == ("top_p", "must be in (0, 1] (got 2.0)")
    assert status.trailing_metadata()[0][0] == "grpc-status-details-bin"


def test_retry_after_becomes_retry_info_and_survives_pickling():
    exc = RpcStatusError(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full", retry_after=2.5)
    back = pickle.loads(pickle.dumps(exc))  # Ray moves exceptions between processes
    assert (back.code, back.message, back.retry_after) == (exc.code, exc.message, 2.5)
    delay = _details(rich_status_for(back))["RetryInfo"].retry_delay
    assert delay.ToNanoseconds() == 2_500_000_000
    # without details there is no trailer at all
    assert rich_status_for(RpcStatusError(grpc.StatusCode.UNAVAILABLE, "down")).trailing_metadata() == ()


def test_unknown_errors_are_internal_without_a_trace():
    status = rich_status_for(KeyError("boom\nTraceback (most recent call last): ..."))
    assert status.code is grpc.StatusCode.INTERNAL and "Traceback" not in status.message
    assert _details(status) == {}


# ---- locating the bad bytes ------------------------------------------------------------------


def _encoded(**fields) -> bytes:
    return generate_pb2.GenerateRequest(**fields).SerializeToString()


def test_find_bad_field_names_the_field_as_in_the_proto():
    good = _encoded(prompt="hi", stop=["ab", "cd"], speculation=generate_pb2.SpeculationOptions(k=2))
    assert find_bad_field(good, REQUEST) is None
    assert find_bad_field(_encoded(prompt="h\u00ff").replace("h\u00ff".encode(), b"h\xff\xfe"), REQUEST) == (
        "prompt",
        "is not valid UTF-8",
    )
    bad_stop = _encoded(prompt="hi", stop=["ab", "cd"]).replace(b"cd", b"c\xc3")
    assert find_bad_field(bad_stop, REQUEST) == ("stop[1]", "is not valid UTF-8")
    assert find_bad_field(good[:-1], REQUEST) == ("speculation", "is truncated")
    assert find_bad_field(b"\x1a\x05ab", REQUEST) == ("prompt", "is truncated")  # says 5 bytes, has 2
    assert find_bad_field(b"\xff\xff", REQUEST) == (None, "is truncated")


# ---- real servers ------------------------------------------------------------------------------


class Answers(generate_pb2_grpc.GenerationServicer):
    """Answers chosen by the prompt: "bad" -> InvalidParams, "full" -> RESOURCE_EXHAUSTED with a
    retry delay, "down" -> UNAVAILABLE with one, anything else -> the prompt back."""

    @staticmethod
    def _answer(request) -> generate_pb2.GenerateResponse:
        if request.prompt == "bad":
            raise InvalidParams("stop[0]", "stop strings must be non-empty")
        if request.prompt == "full":
            raise RpcStatusError(grpc.StatusCode.RESOURCE_EXHAUSTED, "the queue is full", retry_after=1.5)
        if request.prompt == "down":
            raise RpcStatusError(grpc.StatusCode.UNAVAILABLE, "restarting", retry_after=4.0)
        return generate_pb2.GenerateResponse(text=request.prompt, finish_reason="stop")

    @rpc_method
    def Generate(self, request, context):
        return self._answer(request)

    @rpc_method
    def GenerateStream(self, request, context):
        r = self._answer(request)
        yield generate_pb2.GenerateChunk(text=r.text, finish_reason=r.finish_reason)


class AioAnswers(generate_pb2_grpc.GenerationServicer):
    @rpc_method
    async def Generate(self, request, context):
        return Answers._answer(request)

    @rpc_method
    async def GenerateStream(self, request, context):
        r = Answers._answer(request)
        yield generate_pb2.GenerateChunk(text=r.text, finish_reason=r.finish_reason)


class AioServer:
    """A grpc.aio server on its own loop thread, as the router runs one."""

    def __init__(self, on_refused):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        reg = [(generate_pb2_grpc.add_GenerationServicer_to_server, AioAnswers(), GENERATION)]
        self.server, self.port = asyncio.run_coroutine_threadsafe(
            start_aio_server(reg, on_refused=on_refused), self.loop
        ).result(30)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(None), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(params=["sync", "aio"])
def served(request):
    refused: list = []
    on_refused = lambda *args: refused.append(args)  # noqa: E731
    if request.param == "sync":
        reg = [(generate_pb2_grpc.add_GenerationServicer_to_server, Answers(), GENERATION)]
        server, port = start_server(reg, on_refused=on_refused)
        stop = lambda: server.stop(None).wait()  # noqa: E731
    else:
        aio = AioServer(on_refused)
        port, stop = aio.port, aio.stop
    client = SpecdecClient(f"127.0.0.1:{port}")
    try:
        yield client, refused
    finally:
        client.close()
        stop()


def test_client_raises_structured_errors(served):
    client, _ = served
    assert client.generate("hello").text == "hello"
    with pytest.raises(InvalidArgument) as err:
        client.generate("bad")
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT  # still a grpc.RpcError
    assert err.value.details() == "stop[0]: stop strings must be non-empty"
    assert err.value.field == "stop[0]" and err.value.field_violations[0].description.startswith("stop strings")
    with pytest.raises(ResourceExhausted) as err:
        client.generate("full")
    assert err.value.retry_delay == pytest.approx(1.5)
    with pytest.raises(Unavailable) as err:
        list(client.generate_stream("down"))
    assert err.value.retry_delay == pytest.approx(4.0)


def test_undecodable_requests_are_invalid_argument_with_one_warning(served, caplog, monkeypatch):
    client, refused = served
    monkeypatch.setattr(decode_guard, "_warn", decode_guard._RateLimitedWarning(60.0))  # a fresh limiter
    raw = client.channel.unary_unary(f"/{GENERATION}/Generate")  # bytes in, bytes out
    raw_stream = client.channel.unary_stream(f"/{GENERATION}/GenerateStream")
    garbled = _encoded(request_id="g1", prompt="hi there").replace(b"there", b"th\xffre")
    caplog.set_level(logging.INFO)
    for call in (lambda: raw(garbled, timeout=10), lambda: list(raw_stream(garbled, timeout=10))):
        with pytest.raises(grpc.RpcError) as err:
            call()
        assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details() == "request does not decode: prompt is not valid UTF-8"
        assert from_rpc_error(err.value).field == "prompt"
    with pytest.raises(grpc.RpcError) as err:
        raw(b"\xff\xff\xff", timeout=10)
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("request does not decode: ")
    assert [(m, e.field) for m, _, e in refused] == [
        (f"/{GENERATION}/Generate", "prompt"),
        (f"/{GENERATION}/GenerateStream", "prompt"),
        (f"/{GENERATION}/Generate", None),
    ]
    (warning,) = [r for r in caplog.records if r.name == "specdec.rpc.decode_guard"]  # rate-limited: one
    assert (
        warning.levelno == logging.WARNING and not warning.exc_info and "prompt is not valid UTF-8" in warning.message
    )
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert client.generate("still serving").text == "still serving"
