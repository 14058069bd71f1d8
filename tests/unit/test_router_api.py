"""The router's API edge without workers: bounds checked before tokenizing, max_tokens at the context's
edge, retry delays, the access log and its JSON form."""

from __future__ import annotations

import io
import json
import logging

import pytest

from router.access_log import ACCESS_LOGGER, AccessRecord
from router.retry import DrainEstimate, recovery_estimate
from router.validate import (
    MAX_REQUEST_ID_BYTES,
    MAX_STOP_BYTES,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    PROMPT_BYTES_PER_TOKEN,
    Limits,
    check_request_id,
    finalize,
    parse,
)
from specdec.core.log_format import JsonFormatter, set_log_format
from specdec.core.params import InvalidParams
from specdec.rpc import generate_pb2

LIMITS = Limits.for_model(max_context=64)


def _field(fn) -> str:
    with pytest.raises(InvalidParams) as err:
        fn()
    assert str(err.value).startswith(err.value.field + ": ")
    return err.value.field


def _parse(**kw):
    return parse(generate_pb2.GenerateRequest(**kw), LIMITS)


def test_request_id_is_bounded_printable_ascii_and_never_echoed():
    check_request_id("")
    check_request_id("a" * MAX_REQUEST_ID_BYTES)
    check_request_id("req 42: ~!")
    for bad in ("a" * (MAX_REQUEST_ID_BYTES + 1), "x" * 2_500_000, "tab\there", "caf\u00e9", "nl\n"):
        with pytest.raises(InvalidParams) as err:
            check_request_id(bad)
        assert err.value.field == "request_id" and len(str(err.value)) < 120, str(err.value)[:200]


def test_prompt_bytes_are_bounded_before_tokenizing():
    assert LIMITS.max_prompt_bytes == PROMPT_BYTES_PER_TOKEN * 64
    n = LIMITS.max_prompt_bytes
    assert _parse(prompt="a" * n).prompt == "a" * n
    assert _field(lambda: _parse(prompt="a" * (n + 1))) == "prompt"
    assert _field(lambda: _parse(prompt="\u00e9" * (n // 2 + 1))) == "prompt"  # bytes, not characters
    assert _parse(prompt="\u00e9" * (n // 2)).prompt
    assert _field(lambda: _parse(prompt="x" * 3_500_000)) == "prompt"
    assert Limits.for_model(64, max_prompt_bytes=10).max_prompt_bytes == 10
    assert _field(lambda: _parse(prompt_token_ids=[1] * 65)) == "prompt_token_ids"


def test_stop_bounds_name_the_field():
    assert len(_parse(prompt="x", stop=["s"] * MAX_STOP_STRINGS).stop) == MAX_STOP_STRINGS
    assert _field(lambda: _parse(prompt="x", stop=["s"] * (MAX_STOP_STRINGS + 1))) == "stop"
    assert _field(lambda: _parse(prompt="x", stop=["a", "b", "c", "d" * (MAX_STOP_BYTES + 1)])) == "stop[3]"
    assert _field(lambda: _parse(prompt="x", stop=["a", ""])) == "stop[1]"
    assert _parse(prompt="x", stop=["d" * MAX_STOP_BYTES]).stop
    assert len(_parse(prompt="x", stop_token_ids=[1] * MAX_STOP_TOKEN_IDS).stop_token_ids) == MAX_STOP_TOKEN_IDS
    assert _field(lambda: _parse(prompt="x", stop_token_ids=[1] * (MAX_STOP_TOKEN_IDS + 1))) == "stop_token_ids"


def test_max_tokens_beyond_the_context_is_refused_not_lowered():
    prompt = list(range(10))

    def run(max_tokens: int):
        parsed = _parse(prompt_token_ids=prompt, max_tokens=max_tokens)
        return finalize(parsed, prompt, vocab_size=256, max_context=64, default_max_tokens=256)[0]

    assert run(54).max_tokens == 54  # prompt + max_tokens == context: accepted
    assert _field(lambda: run(55)) == "max_tokens"  # one more: refused
    assert run(0).max_tokens == 54  # the default is lowered to the room left


def test_drain_estimate_follows_the_rate_of_request_ends():
    est = DrainEstimate()
    assert est.seconds(waiting=10) == 1.0  # nothing measured yet
    for t in range(10):
        est.finished(now=float(t))
    assert est.seconds(waiting=4, now=10.0) == pytest.approx(5.0)  # 1 end per second, 5 to go
    assert est.seconds(waiting=4, now=100.0) > 40  # nothing ended since: the rate decays
    assert est.seconds(waiting=10_000, now=10.0) == 60.0  # capped
    assert recovery_estimate(None, 0.0) == 5.0
    assert recovery_estimate(8.0, 3.0) == pytest.approx(5.0)
    assert recovery_estimate(8.0, 30.0) == 1.0


def test_access_log_line_and_its_json_form(caplog):
    rec = AccessRecord("Generate", "ipv4:127.0.0.1:5555", t_start=100.0, request_id='my "id" 7', model="m")
    rec.status, rec.finish_reason, rec.prompt_tokens, rec.completion_tokens = "OK", "length", 5, 24
    rec.t_first, rec.acceptance_rate = 100.25, 0.5
    with caplog.at_level(logging.INFO, logger=ACCESS_LOGGER):
        rec.emit()
        rec.emit()  # once per request
    (record,) = [r for r in caplog.records if r.name == ACCESS_LOGGER]
    text = record.getMessage()
    assert text.startswith('rpc=Generate request_id="my \\"id\\" 7" model=m status=OK finish_reason=length')
    assert "prompt_tokens=5 completion_tokens=24 ttft_ms=250.0" in text and "acceptance_rate=0.5" in text
    assert text.endswith("peer=ipv4:127.0.0.1:5555")
    line = json.loads(JsonFormatter().format(record))
    assert line["logger"] == ACCESS_LOGGER and line["request_id"] == 'my "id" 7' and line["ttft_ms"] == 250.0
    assert line["status"] == "OK" and line["completion_tokens"] == 24 and "message" not in line
    refused = AccessRecord("Generate", "", status="INVALID_ARGUMENT").fields()
    assert refused["request_id"] is None and refused["ttft_ms"] is None


def test_set_log_format_switches_the_root_handlers():
    root = logging.getLogger()
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    root.addHandler(handler)
    try:
        set_log_format("json", [handler])
        logging.getLogger("specdec.test").warning("hello %s", "there")
        assert json.loads(stream.getvalue().splitlines()[-1])["message"] == "hello there"
        set_log_format("text", [handler])
        logging.getLogger("specdec.test").warning("plain")
        assert stream.getvalue().splitlines()[-1].endswith("WARNING specdec.test: plain")
        with pytest.raises(ValueError):
            set_log_format("xml")
    finally:
        root.removeHandler(handler)
