"""Fuzzing the public API of the running service (router + Ray workers, tiny models): well over a
thousand generated requests, fields at their extremes and bytes that do not decode.

Every reply is OK or a documented status with a message (never INTERNAL or UNKNOWN), the service
stays healthy, and afterwards every KV slot is free and the processes' memory is back near where it
started. Hypothesis draws the requests from a fixed seed (``derandomize``), so a failure replays.
"""

from __future__ import annotations

import time

import grpc
import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specdec.rpc import generate_pb2
from tests.integration.service_fixture import MAX_LEN, MODEL, SLOTS, running_service

VOCAB = 259  # specdec.core.tiny: 256 bytes + 3 specials
INT32 = st.integers(-(2**31), 2**31 - 1)
UINT64 = st.integers(0, 2**64 - 1)
# What the API documents (docs/api.md, generate.proto); CANCELLED: the streams this test closes early.
DOCUMENTED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
}
METHODS = {
    "Generate": (generate_pb2.GenerateRequest, False),
    "GenerateStream": (generate_pb2.GenerateRequest, True),
    "Tokenize": (generate_pb2.TokenizeRequest, False),
    "ListModels": (generate_pb2.ListModelsRequest, False),
}
STRUCTURED, GARBLED = 720, 360
TIMEOUT_S = 20.0

text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=40)  # proto strings are valid UTF-8
edge_text = st.one_of(text, st.sampled_from(["", " ", "\x00", "\n\n", "é" * 130, "x" * 300, "🙂" * 70]))


def _edge_ints(small: list[int], wide=INT32):
    return st.one_of(st.sampled_from(small), wide)


ok_ids = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=24)
prompt_ids = st.lists(st.one_of(st.integers(-3, VOCAB + 3), INT32), max_size=24)
long_ids = st.sampled_from([MAX_LEN - 4, MAX_LEN - 1, MAX_LEN, MAX_LEN + 1]).map(lambda n: [7] * n)
ok_prompts = st.one_of(st.tuples(text.filter(bool), st.just([])), st.tuples(st.just(""), ok_ids))
bad_prompts = st.one_of(
    st.tuples(edge_text, st.just([])),
    st.tuples(st.just(""), prompt_ids),
    st.tuples(st.just(""), long_ids),
    st.tuples(text, prompt_ids),  # both: refused
    st.tuples(st.sampled_from(["ab" * (16 * MAX_LEN), "ab" * MAX_LEN]), st.just([])),  # at and over the byte bound
)
unit_float = st.floats(0.0, 1.0, width=32)
any_float = st.one_of(st.floats(width=32), st.sampled_from([-0.0, 1e-45, 3.4e38, float("nan"), float("inf")]))
# field: (values a request passes with, values at the extremes)
FIELDS = {
    "request_id": (st.sampled_from(["", "fuzz-1"]), st.one_of(text, st.sampled_from(["r" * 257, "tab\tid"]))),
    "model": (st.sampled_from(["", MODEL]), st.one_of(text, st.just("gpt-9"))),
    "prompt": (ok_prompts, bad_prompts),
    "chat": (st.just(False), st.just(True)),
    "max_tokens": (st.integers(0, 4), _edge_ints([-1, MAX_LEN, 2**31 - 1])),
    "top_k": (st.integers(0, 20), _edge_ints([VOCAB, VOCAB + 1, -1])),
    "stop": (st.lists(text.filter(bool), max_size=3), st.lists(edge_text, max_size=18)),
    "stop_token_ids": (st.lists(st.integers(0, VOCAB - 1), max_size=4), st.lists(INT32, max_size=66)),
    "mode": (st.integers(0, 4), _edge_ints([5, -1])),
    "k": (st.integers(0, 6), _edge_ints([7, 64, -1])),
    "verify_mode": (st.integers(0, 3), _edge_ints([4, -1])),
    "temperature": (st.one_of(st.none(), unit_float), any_float),
    "top_p": (st.one_of(st.none(), unit_float), any_float),
}
# which fields are at their extremes: none (about a third of the requests), a few, or all
broken_fields = st.one_of(
    st.just(frozenset()),
    st.frozensets(st.sampled_from(sorted(FIELDS)), min_size=1, max_size=3),
    st.just(frozenset(FIELDS)),
)


@st.composite
def generate_requests(draw) -> generate_pb2.GenerateRequest:
    broken = draw(broken_fields)
    v = {name: draw(strategies[name in broken]) for name, strategies in FIELDS.items()}
    prompt, ids = v["prompt"]
    req = generate_pb2.GenerateRequest(
        request_id=v["request_id"],
        model=v["model"],
        prompt=prompt,
        prompt_token_ids=ids,
        chat=v["chat"],
        max_tokens=v["max_tokens"],
        top_k=v["top_k"],
        stop=v["stop"],
        stop_token_ids=v["stop_token_ids"],
        ignore_eos=draw(st.booleans()),
        speculation=generate_pb2.SpeculationOptions(mode=v["mode"], k=v["k"], verify_mode=v["verify_mode"]),
    )
    for name in ("temperature", "top_p"):
        if v[name] is not None:
            setattr(req, name, v[name])
    seed = draw(st.one_of(st.none(), st.sampled_from([0, 2**64 - 1]), UINT64))
    if seed is not None:
        req.seed = seed
    return req


def _garble(data: bytes, cuts: list[int], flips: list[tuple[int, int]]) -> bytes:
    out = bytearray(data)
    for pos, value in flips:
        if out:
            out[pos % len(out)] = value
    for cut in cuts:
        out = out[: cut % (len(out) + 1)]
    return bytes(out)


garbled = st.one_of(
    st.binary(max_size=300),
    st.builds(
        _garble,
        generate_requests().map(lambda r: r.SerializeToString()),
        st.lists(st.integers(0, 10_000), max_size=1),
        st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), min_size=1, max_size=6),
    ),
)


class Tally:
    def __init__(self):
        self.sent = 0
        self.codes: dict[str, int] = {}

    def check(self, code: grpc.StatusCode, details: str | None, what: str) -> None:
        self.sent += 1
        self.codes[code.name] = self.codes.get(code.name, 0) + 1
        assert code in DOCUMENTED, f"{what}: {code.name}: {details}"
        assert code is grpc.StatusCode.OK or (details and len(details) < 1000), f"{what}: {code.name} without a message"


def _rss() -> dict[str, int]:
    return {name: psutil.Process(pid).memory_info().rss for name, pid in _PIDS.items()}


_PIDS: dict[str, int] = {}


@pytest.fixture(scope="module")
def fuzzed(ray_cluster, actor_reaper, tiny_paths):
    import ray

    with running_service(actor_reaper, tiny_paths, default_max_tokens=4) as svc:
        _PIDS.update(router=psutil.Process().pid)
        for role, handle in (("target", svc.target), ("draft", svc.draft)):
            _PIDS[role] = ray.get(handle.info.remote(), timeout=60)["pid"]
        channel = grpc.insecure_channel(svc.router.address)
        svc.raw = {
            name: (channel.unary_stream if stream else channel.unary_unary)(f"/specdec.v1.Generation/{name}")
            for name, (_, stream) in METHODS.items()
        }
        svc.tally = Tally()
        for _ in range(20):  # warm: the memory the service needs anyway is counted before the start
            svc.client.generate("def fib(n):", max_tokens=3, timeout=60)
        svc.rss_start = _rss()
        try:
            yield svc
        finally:
            channel.close()


def _call(
    svc, method: str, data: bytes, cancel_early: bool = False, timeout: float = TIMEOUT_S
) -> tuple[grpc.StatusCode, str | None]:
    try:
        if METHODS[method][1]:
            stream = svc.raw[method](data, timeout=timeout)
            for _ in stream:
                if cancel_early:
                    # CANCELLED when the cancel ended the call; if the server had already ended it,
                    # the cancel is a no-op and this is the server's own status
                    stream.cancel()
                    return stream.code(), stream.details()
        else:
            svc.raw[method](data, timeout=timeout)
        return grpc.StatusCode.OK, None
    except grpc.RpcError as exc:
        return exc.code(), exc.details()


FUZZ = settings(
    max_examples=STRUCTURED,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)


@FUZZ
@given(
    req=generate_requests(),
    method=st.sampled_from(list(METHODS)[:3]),
    cancel=st.booleans(),
    timeout=st.sampled_from([TIMEOUT_S, TIMEOUT_S, TIMEOUT_S, 0.005, 0.05]),  # some end at their deadline
)
def test_generated_requests(fuzzed, req, method, cancel, timeout):
    if method == "Tokenize":
        data = generate_pb2.TokenizeRequest(
            model=req.model, prompt=req.prompt, prompt_token_ids=req.prompt_token_ids, chat=req.chat
        ).SerializeToString()
    else:
        data = req.SerializeToString()
    code, details = _call(fuzzed, method, data, cancel_early=cancel, timeout=timeout)
    fuzzed.tally.check(code, details, f"{method} {req}"[:2000])


@settings(FUZZ, max_examples=GARBLED)
@given(data=garbled, method=st.sampled_from(list(METHODS)))
def test_garbled_bytes(fuzzed, data, method):
    code, details = _call(fuzzed, method, data)
    fuzzed.tally.check(code, details, f"{method} {data[:200]!r}")


def test_the_service_is_as_it_was(fuzzed):
    tally = fuzzed.tally
    assert tally.sent >= STRUCTURED + GARBLED >= 1000, tally.codes
    assert tally.codes.get("OK", 0) > 150 and tally.codes.get("INVALID_ARGUMENT", 0) > 300, tally.codes
    assert fuzzed.client.health() == "SERVING"
    fuzzed.wait_slots_free(timeout=30)
    t_end = time.monotonic() + 60  # the router's gauge says so too, from its own poll of the workers' Info
    while fuzzed.metric("specdec_worker_free_slots", {"role": "target", "worker": "target-0"}) != SLOTS:
        assert time.monotonic() < t_end, "specdec_worker_free_slots never showed the free slots"
        time.sleep(0.2)
    out = fuzzed.client.generate("def fib(n):", max_tokens=4, ignore_eos=True, timeout=60)
    assert len(out.token_ids) == 4
    time.sleep(1.0)
    grown = {name: (rss - fuzzed.rss_start[name]) >> 20 for name, rss in _rss().items()}
    # after a warm-up, what is left is allocator slack (MiB), not a per-request leak
    assert grown["target"] < 64 and grown["draft"] < 64 and grown["router"] < 160, (grown, tally.codes)
    print(f"fuzz: {tally.sent} requests, codes {tally.codes}, RSS growth MiB {grown}")
