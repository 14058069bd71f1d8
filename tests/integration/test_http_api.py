"""The OpenAI-compatible HTTP API against the real service: the gateway process (``python -m gateway``,
started as ``specdec serve`` starts it) over the router and Ray workers serving SmolLM2-135M, called
by OpenAI's own Python client, unmodified, and by httpx for the raw bytes.

Models, completions (text and token-id prompts) equal to gRPC and to the single-process engine,
multi-turn chat with a system message through the chat template (usage equal to Tokenize), streams
with usage, the SSE framing byte for byte, errors as OpenAI's exceptions (400 with the parameter,
404, 401, 429 with Retry-After), x-request-id as the access log's request_id, and a client that
disconnects mid-stream leaving every KV slot free.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import time
from pathlib import Path

import httpx
import openai
import pytest

from cluster.gateway_process import start_gateway
from router.access_log import ACCESS_LOGGER
from specdec.bench.serve_http import parse_gateway_metrics
from specdec.rpc.api_security import SecurityConfig
from specdec.rpc.client_credentials import ClientCredentials
from tests.access_lines import check_refusal_line
from tests.conftest import SMOLLM
from tests.integration.service_fixture import SLOTS, running_service

REPO = Path(__file__).resolve().parents[2]
TOKEN = secrets.token_hex(16)
PROMPT = "def fibonacci(n):"
N = 8  # tokens per answer: enough to compare, few enough to stay fast
CONVERSATION = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "Name a primary color."},
    {"role": "assistant", "content": "Blue."},
    {"role": "user", "content": "Another one?"},
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Http:
    def __init__(self, svc, url: str, log: Path | None = None):
        self.svc, self.url, self.log = svc, url, log
        self.raw = httpx.Client(timeout=120)

    def access_lines(self) -> list[dict]:
        """The access lines the gateway process wrote (JSON lines: it runs with --log-format json)."""
        lines = [json.loads(x) for x in self.log.read_text().splitlines() if x.startswith("{")]
        return [x for x in lines if x["logger"] == ACCESS_LOGGER]

    def metrics(self) -> dict:
        """The gateway's /metrics, read as `specdec bench serve` reads it."""
        resp = self.raw.get(self.url + "/metrics")
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
        return parse_gateway_metrics(resp.text)

    def openai(self, api_key: str = TOKEN) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=120)

    def stream(self, path: str, body: dict, **headers) -> httpx.Response:
        """An open streaming response (the caller closes it: closing it early disconnects)."""
        req = self.raw.build_request(
            "POST", self.url + path, json=body, headers={"authorization": f"Bearer {TOKEN}", **headers}
        )
        return self.raw.send(req, stream=True)


@pytest.fixture(scope="module")
def http(ray_cluster, actor_reaper, tiny_paths, smollm_path, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("http")
    tokens = tmp / "tokens"
    tokens.write_text(TOKEN + "\n")
    # Two calls in flight per client: enough for each test, and a third shows the 429.
    with running_service(
        actor_reaper,
        tiny_paths,
        security=SecurityConfig(tokens_file=str(tokens)),
        credentials=ClientCredentials(token=TOKEN),
        models=(SMOLLM, smollm_path, smollm_path),
        max_inflight_per_client=2,
    ) as svc:
        port = _free_port()
        env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        log = open(tmp / "gateway.log", "w+")
        gw = start_gateway(
            svc.router.address, "127.0.0.1", port, SecurityConfig(), log_format="json", env=env, stdout=log, stderr=log
        )
        try:
            http = Http(svc, f"http://127.0.0.1:{port}", tmp / "gateway.log")
            yield http
            http.raw.close()
        finally:
            gw.stop()
            log.close()


@pytest.fixture(scope="module")
def engine(smollm_path):
    from specdec.core.build import build_engine

    eng, parts = build_engine(str(smollm_path), "none", dtype="float32", num_slots=1, max_len=1024)
    return eng, parts


def test_models_and_a_greedy_completion_equal_grpc_and_the_engine(http, engine):
    from specdec.core.params import SamplingParams

    client = http.openai()
    assert [m.id for m in client.models.list().data] == [SMOLLM]  # targets only: the drafter is internal

    out = client.completions.create(
        model=SMOLLM, prompt=PROMPT, max_tokens=N, temperature=0, extra_body={"ignore_eos": True}
    )
    by_grpc = http.svc.client.generate(PROMPT, max_tokens=N, temperature=0.0, ignore_eos=True, timeout=60)
    ids = http.svc.client.tokenize(PROMPT).token_ids
    eng, _ = engine
    (ref,) = eng.generate([ids], SamplingParams(max_tokens=N, ignore_eos=True))
    assert by_grpc.token_ids == ref.token_ids
    assert out.choices[0].text == by_grpc.text == ref.text and out.choices[0].finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (len(ids), N, len(ids) + N)
    assert out.object == "text_completion" and out.id.startswith("cmpl-") and out.created > 0
    assert out.model == SMOLLM and out.system_fingerprint.startswith("fp_")

    by_ids = client.completions.create(
        prompt=ids, max_tokens=N, temperature=0, extra_body={"ignore_eos": True}, model=SMOLLM
    )
    assert by_ids.choices[0].text == out.choices[0].text and by_ids.usage.prompt_tokens == len(ids)


def test_multi_turn_chat_with_a_system_message(http, smollm_path):
    from transformers import AutoTokenizer

    out = http.openai().chat.completions.create(
        model=SMOLLM, messages=CONVERSATION, max_completion_tokens=N, temperature=0, seed=1
    )
    turns = [(m["role"], m["content"]) for m in CONVERSATION]
    ids = http.svc.client.tokenize(messages=turns).token_ids
    # every turn went through the model's own chat template, generation prompt appended
    expected = AutoTokenizer.from_pretrained(smollm_path).apply_chat_template(
        CONVERSATION, add_generation_prompt=True, tokenize=True
    )
    assert ids == list(expected["input_ids"] if hasattr(expected, "keys") else expected)
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    assert out.choices[0].message.role == "assistant" and out.choices[0].message.content
    assert out.usage.prompt_tokens == len(ids) and 0 < out.usage.completion_tokens <= N
    by_grpc = http.svc.client.generate(messages=turns, max_tokens=N, temperature=0.0, timeout=60)
    assert out.choices[0].message.content == by_grpc.text


def test_chat_stream_with_usage(http):
    whole = http.openai().chat.completions.create(model=SMOLLM, messages=CONVERSATION, max_tokens=N, temperature=0)
    stream = http.openai().chat.completions.create(
        model=SMOLLM,
        messages=CONVERSATION,
        max_tokens=N,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    *rounds, tail = chunks
    assert rounds[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in rounds[1:])
    assert [c.choices[0].finish_reason for c in rounds] == [None] * (len(rounds) - 1) + [whole.choices[0].finish_reason]
    assert "".join(c.choices[0].delta.content for c in rounds) == whole.choices[0].message.content
    assert tail.choices == [] and tail.usage.model_dump() == whole.usage.model_dump()
    assert {c.id for c in chunks} == {chunks[0].id} and all(c.object == "chat.completion.chunk" for c in chunks)


def test_sse_framing_byte_for_byte_and_the_request_id(http, caplog):
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    body = {
        "model": SMOLLM,
        "prompt": PROMPT,
        "max_tokens": N,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    resp = http.stream("/v1/completions", body, **{"x-request-id": "http-sse-1"})
    try:
        assert resp.status_code == 200
        assert resp.headers["content-type"] == "text/event-stream; charset=utf-8"
        assert resp.headers["x-request-id"] == "http-sse-1"
        raw = resp.read()
    finally:
        resp.close()
    assert raw.endswith(b"\n\ndata: [DONE]\n\n")
    frames = raw.split(b"\n\n")
    assert frames[-1] == b"" and frames[-2] == b"data: [DONE]"
    events = [json.loads(f.removeprefix(b"data: ")) for f in frames[:-2]]
    # each event is exactly one `data:` line of compact JSON and a blank line, nothing else
    rebuilt = b"".join(
        b"data: " + json.dumps(e, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n" for e in events
    )
    assert rebuilt + b"data: [DONE]\n\n" == raw
    *rounds, usage = events
    assert {e["id"] for e in events} == {"cmpl-http-sse-1"} and all(e["object"] == "text_completion" for e in events)
    assert [e["choices"][0]["finish_reason"] for e in rounds] == [None] * (len(rounds) - 1) + ["length"]
    assert all(e["usage"] is None for e in rounds) and usage["choices"] == []
    assert usage["usage"]["completion_tokens"] == N
    text = http.svc.client.generate(PROMPT, max_tokens=N, temperature=0.0, ignore_eos=True, timeout=60).text
    assert "".join(e["choices"][0]["text"] for e in rounds) == text

    t_end = time.monotonic() + 60
    while not (
        lines := [
            r.access for r in caplog.records if r.name == ACCESS_LOGGER and r.access["request_id"] == "http-sse-1"
        ]
    ):
        assert time.monotonic() < t_end
        time.sleep(0.05)
    assert lines[0]["rpc"] == "GenerateStream" and lines[0]["status"] == "OK" and lines[0]["completion_tokens"] == N


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"top_p": 2.0}, "top_p"),  # the router's bound, named as OpenAI names it
        ({"n": 2}, "n"),  # not implemented: refused, never ignored
        ({"logprobs": True}, "logprobs"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"max_completion_tokens": 5000}, "max_completion_tokens"),  # past the context: refused, not lowered
        ({"extra_body": {"speculation": {"mode": "psychic"}}}, "speculation.mode"),
        ({"extra_body": {"speculation": {"verify_mode": "psychic"}}}, "speculation.verify_mode"),
        ({"extra_body": {"frobnicate": 1}}, "frobnicate"),  # unknown: refused, never ignored
    ],
)
def test_bad_requests_name_the_parameter(http, kwargs, param):
    with pytest.raises(openai.BadRequestError) as err:
        http.openai().chat.completions.create(model=SMOLLM, messages=CONVERSATION[:2], **kwargs)
    assert err.value.param == param and err.value.body["type"] == "invalid_request_error"
    assert err.value.body["message"].startswith(param)


def test_the_gateways_own_refusals_have_an_access_line(http):
    """A request the gateway refuses before the router sees it gets one line, in the router's shape;
    one the router refuses gets the router's line only (no second one from the gateway)."""
    chat = {"model": SMOLLM, "messages": CONVERSATION[:2], "max_tokens": 1}

    def post(path: str, rid: str | None, **kwargs) -> httpx.Response:
        headers = {"authorization": f"Bearer {TOKEN}", **({"x-request-id": rid} if rid else {})}
        return http.raw.post(http.url + path, headers=headers, **kwargs)

    sent = {
        "gw-n": (post("/v1/chat/completions", "gw-n", json={**chat, "n": 2}), 400, "unsupported_parameter"),
        "gw-json": (post("/v1/completions", "gw-json", content=b"{not json"), 400, "invalid_json"),
        "gw-route": (post("/v1/engines", "gw-route", json=chat), 404, "not_found"),
    }
    relayed = post("/v1/chat/completions", "gw-relay", json={**chat, "top_p": 2.0})
    assert relayed.status_code == 400
    no_id = post("/v1/completions", None, content=b"[")
    for rid, (resp, status, code) in sent.items():
        assert resp.status_code == status and resp.json()["error"]["code"] == code
        assert resp.headers["x-request-id"] == rid
    t_end = time.monotonic() + 60
    lines = http.access_lines()
    while not set(sent) <= {x["request_id"] for x in lines}:
        assert time.monotonic() < t_end, lines
        time.sleep(0.05)
        lines = http.access_lines()
    for rid, (_, status, code) in sent.items():
        (line,) = [x for x in lines if x["request_id"] == rid]
        check_refusal_line(line, rid, status, code)
    (line,) = [x for x in lines if x["request_id"] == no_id.headers["x-request-id"]]  # the id it made up
    check_refusal_line(line, no_id.headers["x-request-id"], 400, "invalid_json")
    assert not [x for x in lines if x["request_id"] == "gw-relay"]  # the router's line is the one


def test_the_gateway_counts_its_requests_and_times_its_own_work(http):
    """/metrics: requests by endpoint and status, one own-work time per request that reached the
    router, one per streamed chunk (counts here; the times are the benchmark's)."""
    before = http.metrics()
    client = http.openai()
    client.completions.create(model=SMOLLM, prompt=PROMPT, max_tokens=N, temperature=0)
    rounds = [
        c
        for c in client.chat.completions.create(
            model=SMOLLM, messages=CONVERSATION, max_tokens=N, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
        if c.choices
    ]  # fmt: skip
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=SMOLLM, prompt=PROMPT, max_tokens=N, n=3)
    after = http.metrics()

    def delta(key: tuple[str, str]) -> float:
        return after["requests"].get(key, 0.0) - before["requests"].get(key, 0.0)

    assert delta(("/v1/completions", "200")) == 1 and delta(("/v1/chat/completions", "200")) == 1
    assert delta(("/v1/completions", "400")) == 1 and delta(("/metrics", "200")) >= 1
    assert after["request"]["count"] - before["request"]["count"] == 2  # the refusal never reached the router
    assert after["chunk"]["count"] - before["chunk"]["count"] == len(rounds) > 0
    assert set(after["request"]["buckets"]) >= {0.001, 0.005, float("inf")}


def test_unknown_model_bad_token_and_the_client_limit(http):
    with pytest.raises(openai.NotFoundError) as err:
        http.openai().completions.create(model="gpt-9", prompt="x", max_tokens=1)
    assert "gpt-9" in err.value.body["message"] and SMOLLM in err.value.body["message"]
    with pytest.raises(openai.AuthenticationError):
        http.openai(api_key="not-the-token-" + "x" * 16).models.list()

    body = {"model": SMOLLM, "prompt": PROMPT, "max_tokens": 900, "ignore_eos": True, "stream": True}
    held = [http.stream("/v1/completions", body) for _ in range(2)]  # the client's two calls in flight
    try:
        # kept: a dropped byte iterator closes its connection, which would cancel the stream
        events = [resp.iter_bytes() for resp in held]
        assert [resp.status_code for resp in held] == [200, 200]
        assert all(next(e).startswith(b"data: ") for e in events)
        with pytest.raises(openai.RateLimitError) as err:
            http.openai().completions.create(model=SMOLLM, prompt="x", max_tokens=1)
        assert int(err.value.response.headers["retry-after"]) >= 1
        assert err.value.body["type"] == "rate_limit_error"
    finally:
        for resp in held:
            resp.close()
    http.svc.wait_slots_free()


def test_a_client_that_disconnects_mid_stream_frees_its_slots(http):
    before = http.svc.metric("specdec_requests_total", {"outcome": "cancelled"})
    body = {"model": SMOLLM, "messages": CONVERSATION, "max_tokens": 900, "ignore_eos": True, "stream": True}
    resp = http.stream("/v1/chat/completions", body)
    try:
        events = resp.iter_bytes()
        assert next(events).startswith(b"data: ") and next(events)
        assert http.svc.worker_info("target").free_slots < SLOTS  # it holds a slot while it runs
    finally:
        resp.close()  # the client goes away mid-stream
    http.svc.wait_slots_free()
    t_end = time.monotonic() + 60
    while http.svc.metric("specdec_requests_total", {"outcome": "cancelled"}) <= before:
        assert time.monotonic() < t_end
        time.sleep(0.05)


def test_bench_serve_drives_grpc_and_http_alike(http, smollm_path):
    """`specdec bench serve --api grpc,http`: the same greedy requests through both APIs, as text (a raw
    prompt to /v1/completions, a chat prompt to /v1/chat/completions) and as token ids."""
    from transformers import AutoTokenizer

    from specdec.bench.serve import BenchOptions, bench_serve
    from specdec.bench.serve_report import format_table
    from specdec.core.prompts import Prompt, encode

    prompts = [Prompt("raw", PROMPT, False), Prompt("chat", "Name a primary color.", True)]
    tokenizer = AutoTokenizer.from_pretrained(smollm_path)
    for enc in (None, lambda p: encode(tokenizer, p)):
        options = BenchOptions(
            max_tokens=N, requests=3, modes=("auto",), apis=("grpc", "http"), http_url=http.url, metrics_url="none"
        )
        result = bench_serve(
            http.svc.router.address, prompts, options, encode=enc, credentials=ClientCredentials(token=TOKEN)
        )
        runs = {r["api"]: r for r in result["results"]}
        assert set(runs) == {"grpc", "http"} and {r["scenario"] for r in result["results"]} == {"closed c=1"}
        by_grpc, by_http = runs["grpc"]["records"], runs["http"]["records"]
        assert [r["id"] for r in by_http] == [r["id"] for r in by_grpc] == ["raw", "chat", "raw"]
        for g, h in zip(by_grpc, by_http):
            assert g["error"] is None and h["error"] is None and h["api"] == "http" and g["api"] == "grpc"
            assert h["tokens"] == g["tokens"] == len(g["token_ids"]) > 0  # usage counts the same greedy tokens
            assert h["finish_reason"] == g["finish_reason"]
            chunks = h["t_chunks"]
            assert chunks and chunks == sorted(chunks) and (chunks[0], chunks[-1]) == (h["t_first"], h["t_last"])
            assert h["t_start"] <= h["t_first"] <= h["t_last"] <= h["t_end"]
        s = runs["http"]["summary"]
        assert s["errors"] == 0 and s["tokens"] == runs["grpc"]["summary"]["tokens"]
        assert s["ttft_ms_p50"] is not None and s["tpot_ms_p50"] is not None
        gateway = s["gateway"]
        assert set(gateway) == {"ms_per_request", "ms_per_request_paired", "chunks_p50", "ms_per_chunk", "ttft_ms_p50"}
        assert None not in gateway.values()  # one client: the requests pair by prompt
        cost = runs["http"]["summary"]["gateway_cost"]  # timed inside the gateway, from its /metrics
        assert cost["requests"] == 3 and cost["chunks"] >= 3 and cost["ms_per_request_p50"] is not None
        assert "gateway overhead" in format_table(result) and "gateway's own work" in format_table(result)
    # Several clients: split between the APIs and run at once (both see the same batches).
    options = BenchOptions(
        max_tokens=N, requests=4, concurrency=(2,), modes=("auto",), apis=("grpc", "http"), http_url=http.url,
        metrics_url="none",
    )  # fmt: skip
    result = bench_serve(http.svc.router.address, prompts, options, credentials=ClientCredentials(token=TOKEN))
    runs = {r["api"]: r for r in result["results"]}
    assert set(runs) == {"grpc", "http"} and {r["scenario"] for r in result["results"]} == {"closed c=2"}
    assert all(r["shared"] for r in runs.values()) and sum(len(r["records"]) for r in runs.values()) == 4
    assert all(
        r["records"] and all(x["api"] == api and x["error"] is None for x in r["records"]) for api, r in runs.items()
    )
