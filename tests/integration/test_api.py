"""The public API by gRPC's conventions, against the real service (router + Ray workers, tiny models).

Status codes and their google.rpc details (read through the real SpecdecClient), requests that do
not decode, bounds checked before tokenizing, max_tokens at the context's edge, Tokenize equal to
what Generate runs, the access log, and a normal request's latency beside huge prompts.
"""

from __future__ import annotations

import logging
import statistics
import threading
import time

import grpc
import pytest

from router.access_log import ACCESS_LOGGER
from specdec.rpc import generate_pb2, generate_pb2_grpc
from specdec.rpc.client import InvalidArgument, NotFound, build_request
from specdec.rpc.client_errors import from_rpc_error
from tests.integration.service_fixture import MAX_LEN, MODEL, running_service

GENERATE = "/specdec.v1.Generation/Generate"


@pytest.fixture(scope="module")
def api(ray_cluster, actor_reaper, tiny_paths):
    with running_service(actor_reaper, tiny_paths) as svc:
        yield svc


def _tokenizer(tiny_paths):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_paths["llama"])


def test_codes_and_details(api):
    client = api.client
    # an unknown model is NOT_FOUND, listing the models that can be named
    before = api.metric("specdec_requests_total", {"outcome": "not_found"})
    for call in (lambda: client.generate("x", model="gpt-9", timeout=30), lambda: client.tokenize("x", model="gpt-9")):
        with pytest.raises(NotFound) as err:
            call()
        assert "'gpt-9'" in err.value.details() and MODEL in err.value.details()
    assert api.metric("specdec_requests_total", {"outcome": "not_found"}) == before + 1  # Tokenize is not counted

    # bytes that do not decode: INVALID_ARGUMENT naming the field, counted
    before = api.metric("specdec_requests_total", {"outcome": "invalid_argument"})
    garbled = generate_pb2.GenerateRequest(prompt="def fib(n):").SerializeToString().replace(b"fib", b"f\xffb")
    with grpc.insecure_channel(api.router.address) as ch:
        with pytest.raises(grpc.RpcError) as err:
            ch.unary_unary(GENERATE)(garbled, timeout=30)
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == "request does not decode: prompt is not valid UTF-8"
    assert api.metric("specdec_requests_total", {"outcome": "invalid_argument"}) == before + 1

    # request_id: bounded, never echoed back in the error; at the bound it is served and echoed
    for bad in ("r" * 1_000_000, "tab\tid"):
        with pytest.raises(InvalidArgument) as err:
            client.generate("x", max_tokens=2, request_id=bad, timeout=30)
        assert err.value.field == "request_id" and len(err.value.details()) < 200
    rid = "r" * 256
    assert client.generate("x", max_tokens=2, request_id=rid, timeout=30).request_id == rid
    with pytest.raises(InvalidArgument) as err:
        client.generate("x", stop=["a"] * 17, timeout=30)
    assert err.value.field == "stop"


def test_max_tokens_at_the_context_edge(api):
    prompt = [65 + i % 26 for i in range(MAX_LEN - 8)]
    out = api.client.generate(prompt_token_ids=prompt, max_tokens=8, ignore_eos=True, timeout=120)
    assert out.finish_reason == "length" and len(out.token_ids) == 8  # prompt + max_tokens == context
    with pytest.raises(InvalidArgument) as err:
        api.client.generate(prompt_token_ids=prompt, max_tokens=9, ignore_eos=True, timeout=60)
    assert err.value.field == "max_tokens" and "[1, 8]" in err.value.details()  # refused, not lowered
    # 0 = the default, lowered to the room left
    assert len(api.client.generate(prompt_token_ids=prompt, ignore_eos=True, timeout=120).token_ids) == 8


def test_tokenize_is_the_prompt_generate_runs(api, tiny_paths):
    text = "def fib(n):\n    return n"
    expected = _tokenizer(tiny_paths)(text)["input_ids"]
    tok = api.client.tokenize(text)
    assert tok.token_ids == expected and tok.count == len(expected)
    out = api.client.generate(text, max_tokens=2, timeout=60)
    assert out.usage["prompt_tokens"] == tok.count
    assert api.client.tokenize(prompt_token_ids=[5, 6, 7]).token_ids == [5, 6, 7]
    # longer than the context: Tokenize counts it, Generate refuses it
    long = "ab" * MAX_LEN
    assert api.client.tokenize(long).count > MAX_LEN
    with pytest.raises(InvalidArgument) as err:
        api.client.generate(long, timeout=60)
    assert err.value.field == "prompt"
    for kwargs, field in ((dict(prompt_token_ids=[1, 10_000]), "prompt_token_ids"), (dict(), "prompt")):
        with pytest.raises(InvalidArgument) as err:
            api.client.tokenize(**kwargs)
        assert err.value.field == field
    with pytest.raises(grpc.RpcError) as err:
        api.client.tokenize("hi", chat=True)  # ListModels says has_chat_template is false
    assert err.value.code() is grpc.StatusCode.FAILED_PRECONDITION


def test_access_log_one_line_per_request_without_text(api, caplog):
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    secret = "SECRET-PROMPT-7f3a"
    out = api.client.generate(secret, max_tokens=12, ignore_eos=True, request_id="acc-1", timeout=60)
    with pytest.raises(InvalidArgument):
        api.client.generate(secret, top_p=2.0, request_id="acc-2", timeout=30)
    call = api.stub.GenerateStream(generate_pb2.GenerateRequest(prompt=secret, max_tokens=900, request_id="acc-3"))
    next(call)
    call.cancel()
    t_end = time.monotonic() + 60
    # wait for these three ids: a line of an earlier test's abandoned stream may land here too
    while not {"acc-1", "acc-2", "acc-3"} <= {
        r.access["request_id"] for r in caplog.records if r.name == ACCESS_LOGGER
    }:
        assert time.monotonic() < t_end, [r.getMessage() for r in caplog.records]
        time.sleep(0.05)
    ours = ("acc-1", "acc-2", "acc-3")
    lines = {
        r.access["request_id"]: r for r in caplog.records if r.name == ACCESS_LOGGER and r.access["request_id"] in ours
    }
    ok = lines["acc-1"].access
    assert ok["rpc"] == "Generate" and ok["model"] == MODEL and ok["status"] == "OK"
    assert ok["finish_reason"] == "length" and ok["completion_tokens"] == 12
    assert ok["prompt_tokens"] == out.usage["prompt_tokens"] and 0 < ok["ttft_ms"] <= ok["total_ms"]
    assert ok["acceptance_rate"] == pytest.approx(out.stats["acceptance_rate"], abs=1e-3)
    assert ok["peer"].startswith("ipv")
    assert lines["acc-2"].access["status"] == "INVALID_ARGUMENT"
    assert lines["acc-3"].access["rpc"] == "GenerateStream" and lines["acc-3"].access["status"] == "CANCELLED"
    fields = {"rpc", "request_id", "model", "status", "finish_reason", "prompt_tokens", "completion_tokens"}
    fields |= {"ttft_ms", "total_ms", "acceptance_rate", "peer"}
    for r in lines.values():
        assert set(r.access) == fields  # no text field
        assert secret not in r.getMessage() and secret not in str(r.access)
    api.wait_slots_free()


def test_a_burst_on_one_connection_is_ok_or_resource_exhausted(api):
    """200 calls at once on one channel (one HTTP/2 connection), beyond the per-client limit (32):
    each ends OK or RESOURCE_EXHAUSTED with RetryInfo, never a refused stream (UNAVAILABLE)."""
    request = build_request("def fib(n):", max_tokens=4, ignore_eos=True)
    with grpc.insecure_channel(api.router.address) as ch:
        stub = generate_pb2_grpc.GenerationStub(ch)
        futures = [stub.Generate.future(request, timeout=120) for _ in range(200)]
        codes: dict = {}
        for f in futures:
            exc = f.exception()
            code = grpc.StatusCode.OK if exc is None else exc.code()
            codes[code] = codes.get(code, 0) + 1
            if exc is not None and code is grpc.StatusCode.RESOURCE_EXHAUSTED:
                assert from_rpc_error(exc).retry_delay is not None
    assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}, codes
    assert codes.get(grpc.StatusCode.OK, 0) >= 32 and codes.get(grpc.StatusCode.RESOURCE_EXHAUSTED, 0) > 0, codes
    api.wait_slots_free()


def _huge_prompts_beside_normal_requests(api, rounds: int) -> tuple[list, list, list]:
    """Per round: a normal request alone, then again while 12 prompts of 3.5 MB are sent at once.
    Returns (the huge calls' errors, the normal requests' outputs, [(solo s, loaded s)])."""
    huge = build_request("x" * 3_500_000).SerializeToString()  # serialized once: the clients' cost is not under test
    errors: list = []
    outputs: list = []

    def normal() -> float:
        t0 = time.perf_counter()
        outputs.append(api.client.generate("def fib(n):", max_tokens=128, ignore_eos=True, timeout=120).token_ids)
        return time.perf_counter() - t0

    def send_huge(raw) -> None:
        try:
            raw(huge, timeout=60)
        except grpc.RpcError as exc:
            err = from_rpc_error(exc)
            errors.append((err.status_code, err.field, "bytes" in err.message))

    times = []
    with grpc.insecure_channel(api.router.address) as ch:
        raw = ch.unary_unary(GENERATE)  # bytes in, bytes out
        for _ in range(rounds):
            solo = normal()
            threads = [threading.Thread(target=send_huge, args=(raw,)) for _ in range(12)]
            for t in threads:
                t.start()
            loaded = normal()
            for t in threads:
                t.join(60)
                assert not t.is_alive(), "a huge prompt's call outlived its 60 s deadline"
            times.append((solo, loaded))
    return errors, outputs, times


def test_huge_prompts_are_refused_by_size_beside_a_normal_request(api):
    """12 prompts of 3.5 MB at once beside a normal request: each is refused as INVALID_ARGUMENT on
    `prompt` by its byte count (router/validate.py, before any tokenizing), and the normal request
    completes with the same tokens as alone."""
    errors, outputs, _ = _huge_prompts_beside_normal_requests(api, rounds=1)
    assert errors == [(grpc.StatusCode.INVALID_ARGUMENT, "prompt", True)] * 12
    assert len(outputs) == 2 and outputs[0] == outputs[1] and len(outputs[0]) == 128
    api.wait_slots_free()


@pytest.mark.slow  # a latency ratio: opt-in (pyproject.toml, markers)
def test_huge_prompts_do_not_stall_a_normal_request(api):
    """The same beside a normal request's latency: within 1.5x of its solo figure. Solo and loaded
    runs alternate (the machine's other load hits both alike); medians of 3."""
    api.client.generate("def fib(n):", max_tokens=128, ignore_eos=True, timeout=120)  # warm
    errors, _, times = _huge_prompts_beside_normal_requests(api, rounds=3)
    assert len(errors) == 36
    solo, loaded = zip(*times, strict=True)
    assert statistics.median(loaded) <= 1.5 * statistics.median(solo), (solo, loaded)
