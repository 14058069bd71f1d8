"""Draft and target workers as Ray actors serving gRPC on loopback.

A real local Ray cluster (conftest ``ray_cluster``), real gRPC through the generated stubs and the
real grpcurl binary, tiny random models. Rounds are driven by hand (propose -> verify -> commit,
k = 3) with the same per-request state the router uses, and the output must equal the
single-process SpecEngine token for token (greedy, seeded invariant and seeded rejection).
"""

from __future__ import annotations

import json
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.core.params import SamplingParams, VerifyMode, choose_mode
from specdec.core.request_state import KPolicy, new_request
from specdec.rpc import worker_pb2, worker_pb2_grpc
from specdec.rpc.auth import INTERNAL_HEADER
from specdec.rpc.convert import (
    sequence_to_proto,
)
from specdec.rpc.telemetry import COMPUTE_METADATA_KEY
from specdec.rpc.worker_secret import current_secret, worker_channel
from tests.grpc_helpers import run_grpcurl

REPO = Path(__file__).resolve().parents[2]
MAX_LEN = 128
K = 3
TARGET_SLOTS = 3
PROMPT = "def fib(n):"
TARGET_NAME = "test-workers-target"
GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.95, seed=1234, ignore_eos=True)


# ---- helpers ---------------------------------------------------------------------------------


@dataclass
class Worker:
    handle: object
    address: str
    channel: grpc.Channel
    stub: object

    @classmethod
    def connect(cls, handle, stub_cls) -> Worker:
        import ray

        address = ray.get(handle.address.remote(), timeout=180)
        channel = worker_channel(address)  # every call carries the session's worker secret
        grpc.channel_ready_future(channel).result(timeout=30)
        return cls(handle, address, channel, stub_cls(channel))

    def info(self) -> worker_pb2.WorkerInfo:
        return self.stub.Info(worker_pb2.InfoRequest(), timeout=10)


@dataclass
class Workers:
    target: Worker
    draft: Worker
    target_config: dict


def run_rounds(
    w: Workers,
    rid: str,
    prompt: list[int],
    params: SamplingParams,
    verify_mode=None,
    eos=frozenset(),
    decode=lambda ids: "",
    on_round=None,
):
    """What the router does for one request: prefill, then propose -> verify -> commit until done."""
    req = new_request(rid, prompt, params, choose_mode(params, verify_mode), KPolicy(k=K), set(eos), decode)
    seq = sequence_to_proto(rid, req.tokens, params, req.mode)
    w.target.stub.Prefill(worker_pb2.PrefillRequest(sequences=[seq]), timeout=30)
    rounds = 0
    while req.finish_reason is None:
        if on_round is not None:
            on_round(rounds)
        k = req.next_k(MAX_LEN)
        seq = sequence_to_proto(rid, req.tokens, params, req.mode, k)
        (draft,) = w.draft.stub.Propose(worker_pb2.ProposeRequest(sequences=[seq]), timeout=30).drafts
        assert draft.request_id == rid and len(draft.tokens) <= k
        if req.mode is VerifyMode.REJECTION:  # the drafter's sparse q travels with its tokens
            assert len(draft.dists) == len(draft.tokens)
        (out,) = w.target.stub.Verify(
            worker_pb2.VerifyRequest(items=[worker_pb2.VerifyItem(sequence=seq, draft=draft)]), timeout=30
        ).outcomes
        assert out.request_id == rid and len(out.tokens) == out.num_accepted + 1
        req.commit(list(out.tokens), out.num_accepted, len(draft.tokens), MAX_LEN)
        rounds += 1
    w.target.stub.Release(worker_pb2.ReleaseRequest(request_ids=[rid]), timeout=10)
    w.draft.stub.Release(worker_pb2.ReleaseRequest(request_ids=[rid]), timeout=10)
    return req


def code_of(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code(), info.value.details()


# ---- fixtures ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def workers(ray_cluster, tiny_paths, actor_reaper) -> Workers:
    from draft_worker import spawn_draft_worker
    from target_worker import spawn_target_worker

    tcfg = {
        "model": str(tiny_paths["llama"]),
        "dtype": "float32",
        "device": "cpu",
        "num_slots": TARGET_SLOTS,
        "max_len": MAX_LEN,
        "threads": 1,
    }
    dcfg = {
        "model": str(tiny_paths["llama-draft"]),
        "dtype": "float32",
        "device": "cpu",
        "num_slots": 4,
        "max_len": MAX_LEN,
        "threads": 1,
    }
    target = spawn_target_worker(tcfg, placement={"resources": {"target_gpu": 1}, "num_cpus": 1}, name=TARGET_NAME)
    draft = spawn_draft_worker(dcfg)  # default placement: {"draft_gpu": 1}
    actor_reaper.extend([target, draft])
    w = Workers(
        Worker.connect(target, worker_pb2_grpc.TargetServiceStub),
        Worker.connect(draft, worker_pb2_grpc.DraftServiceStub),
        tcfg,
    )
    yield w
    w.target.channel.close()
    w.draft.channel.close()


@pytest.fixture(scope="module")
def reference(tiny_paths):
    """The single-process engine on the same models: prompt ids, eos ids and results per mode."""
    from specdec.core.build import make_model_drafter
    from specdec.core.engine import SpecEngine
    from specdec.core.models import load_model
    from specdec.core.runner import ModelRunner

    tgt = load_model(str(tiny_paths["llama"]), dtype="float32")
    drf = load_model(str(tiny_paths["llama-draft"]), dtype="float32")
    target_runner = ModelRunner(tgt.model, num_slots=1, max_len=MAX_LEN)
    drafter = make_model_drafter(drf, num_slots=1, max_len=MAX_LEN)  # the draft worker's defaults too
    prompt = list(tgt.tokenizer(PROMPT)["input_ids"])
    results = {}
    for name, params, mode in (
        ("greedy", GREEDY, None),
        ("invariant", SEEDED, "invariant"),
        ("rejection", SEEDED, "rejection"),
    ):
        engine = SpecEngine(
            target_runner,
            tgt.tokenizer,
            drafter,
            k_policy=KPolicy(k=K),
            eos_token_ids=tgt.eos_token_ids,
            verify_mode=mode,
        )
        (results[name],) = engine.generate([prompt], params)
    return {"prompt": prompt, "eos": tgt.eos_token_ids, "results": results, "tokenizer": tgt.tokenizer}


# ---- actors over gRPC ----------------------------------------------------------------------------


def test_info_and_tokenize(workers, reference):
    t, d = workers.target.info(), workers.draft.info()
    assert (t.role, t.dtype, t.device) == ("target", "float32", "cpu")
    assert (t.max_context, t.num_slots) == (MAX_LEN, TARGET_SLOTS)
    assert t.free_slots == TARGET_SLOTS and t.vocab_size == 259 and list(t.eos_token_ids) == sorted(reference["eos"])
    assert (d.role, d.num_slots, d.free_slots, d.vocab_size) == ("draft", 4, 4, 259)
    assert t.has_chat_template is False and d.has_chat_template is False
    # two CPU workers of one host share its cores: the router charges the target the draft's prefill
    assert t.placement == d.placement == f"{socket.gethostname()}/cpu"
    ids = workers.target.stub.Tokenize(worker_pb2.TokenizeTextRequest(text=PROMPT), timeout=10).token_ids
    assert list(ids) == reference["prompt"]
    code, msg = code_of(lambda: workers.target.stub.Tokenize(worker_pb2.TokenizeTextRequest(text="hi", chat=True)))
    assert code is grpc.StatusCode.FAILED_PRECONDITION and "chat template" in msg  # tiny models have none
    import ray

    info = ray.get(workers.target.handle.info.remote())
    assert info["address"] == workers.target.address and info["restarted"] is False and info["pid"] > 0


@pytest.mark.parametrize("mode", ["greedy", "invariant", "rejection"])
def test_rounds_match_single_process_engine(workers, reference, mode):
    params, verify_mode = (GREEDY, None) if mode == "greedy" else (SEEDED, mode)
    req = run_rounds(workers, f"match-{mode}", reference["prompt"], params, verify_mode, eos=reference["eos"])
    ref = reference["results"][mode]
    assert req.generated == ref.token_ids and len(req.generated) == params.max_tokens
    assert req.finish_reason == ref.finish_reason
    assert (req.stats.rounds, req.stats.drafted, req.stats.accepted) == (
        ref.stats.rounds,
        ref.stats.drafted,
        ref.stats.accepted,
    )
    if mode == "greedy":
        assert req.stats.accepted > 0  # the draft really was used
    assert workers.target.info().free_slots == TARGET_SLOTS and workers.draft.info().free_slots == 4


def test_concurrent_requests(workers, reference):
    """Several requests driven from threads at once (the servers' thread pools call concurrently)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(TARGET_SLOTS) as pool:
        reqs = list(
            pool.map(
                lambda i: run_rounds(workers, f"conc-{i}", reference["prompt"], GREEDY, eos=reference["eos"]),
                range(TARGET_SLOTS),
            )
        )
    assert all(r.generated == reference["results"]["greedy"].token_ids for r in reqs)
    assert workers.target.info().free_slots == TARGET_SLOTS


def test_verify_with_empty_draft(workers, reference):
    prompt = reference["prompt"]
    seq = sequence_to_proto("k0", prompt, GREEDY, VerifyMode.GREEDY)  # no Prefill: Verify builds the cache
    t0 = time.monotonic()
    request = worker_pb2.VerifyRequest(items=[worker_pb2.VerifyItem(sequence=seq)])
    resp, call = workers.target.stub.Verify.with_call(request)
    wall = time.monotonic() - t0
    (out,) = resp.outcomes
    assert list(out.tokens) == reference["results"]["greedy"].token_ids[:1] and out.num_accepted == 0
    # the worker's own compute time rides along (the router's "rpc" round phase is wall minus it)
    compute = float(dict(call.trailing_metadata())[COMPUTE_METADATA_KEY])
    assert 0 < compute < wall
    # an emulated slower device (the TEST/BENCHMARK knob) computes for its delay too: the router's
    # verify cost line reads this time (with it left out, the rebalancer bench priced drafts 20x)
    import ray

    ray.get(workers.target.handle.set_bench_step_delay.remote(0.3), timeout=30)
    try:
        again = worker_pb2.VerifyRequest(items=[worker_pb2.VerifyItem(sequence=seq)])
        _, call = workers.target.stub.Verify.with_call(again)
    finally:
        ray.get(workers.target.handle.set_bench_step_delay.remote(0.0), timeout=30)
    assert float(dict(call.trailing_metadata())[COMPUTE_METADATA_KEY]) >= 0.3
    # Propose with k = 0 drafts nothing.
    (d,) = workers.draft.stub.Propose(worker_pb2.ProposeRequest(sequences=[seq])).drafts
    assert list(d.tokens) == [] and list(d.dists) == []
    # the draft worker reports its compute too (the calibration scales the profile's Propose by it)
    t0 = time.monotonic()
    drafting = sequence_to_proto("k0", prompt, GREEDY, VerifyMode.GREEDY, 3)
    resp, call = workers.draft.stub.Propose.with_call(worker_pb2.ProposeRequest(sequences=[drafting]))
    wall = time.monotonic() - t0
    assert len(resp.drafts[0].tokens) == 3 and 0 < float(dict(call.trailing_metadata())[COMPUTE_METADATA_KEY]) < wall
    workers.draft.stub.Release(worker_pb2.ReleaseRequest(request_ids=["k0"]))
    rel = workers.target.stub.Release(worker_pb2.ReleaseRequest(request_ids=["k0", "never-seen"]))
    assert rel.released == 1


def test_verify_caches_prompt_chunks_in_the_same_forward(workers, reference):
    """A Verify's ``prefill`` sequences are cached in its forward, all but their last token, beside
    the items' rows (the router's prompt chunks ride with the other requests' verify rows): both
    hold a slot after the call, the item gets the tokens a Verify alone gives, and the chunk's
    request then verifies to the same tokens. A request cannot be in both lists."""
    stub, prompt = workers.target.stub, reference["prompt"]
    first = reference["results"]["greedy"].token_ids[:1]
    chunk = sequence_to_proto("chunked", prompt, GREEDY, None)
    item = worker_pb2.VerifyItem(sequence=sequence_to_proto("beside", prompt, GREEDY, None))
    (out,) = stub.Verify(worker_pb2.VerifyRequest(items=[item], prefill=[chunk])).outcomes
    assert out.request_id == "beside" and list(out.tokens) == first
    assert workers.target.info().free_slots == TARGET_SLOTS - 2
    (later,) = stub.Verify(worker_pb2.VerifyRequest(items=[worker_pb2.VerifyItem(sequence=chunk)])).outcomes
    assert list(later.tokens) == first
    twice = worker_pb2.VerifyRequest(items=[item], prefill=[item.sequence])
    code, msg = code_of(lambda: stub.Verify(twice))
    assert code is grpc.StatusCode.INVALID_ARGUMENT and "twice" in msg
    assert stub.Release(worker_pb2.ReleaseRequest(request_ids=["chunked", "beside"])).released == 2


def test_slots_exhausted_eviction_and_release(workers, reference):
    stub, prompt = workers.target.stub, reference["prompt"]
    seqs = [sequence_to_proto(f"slot-{i}", prompt, GREEDY, None) for i in range(TARGET_SLOTS)]
    out = stub.Prefill(worker_pb2.PrefillRequest(sequences=seqs))
    assert [o.cached_tokens for o in out.outcomes] == [len(prompt) - 1] * TARGET_SLOTS
    assert workers.target.info().free_slots == 0
    (first,) = stub.Verify(worker_pb2.VerifyRequest(items=[worker_pb2.VerifyItem(sequence=seqs[0])])).outcomes
    # One batch of more sequences than the worker has slots is refused whole: no router round asks for it.
    extra = [sequence_to_proto(f"slot-extra-{i}", prompt, GREEDY, None) for i in range(TARGET_SLOTS + 1)]
    code, msg = code_of(lambda: stub.Prefill(worker_pb2.PrefillRequest(sequences=extra)))
    assert code is grpc.StatusCode.INVALID_ARGUMENT and "slots" in msg
    # A single new request evicts the least recently used idle cache (caches are caches) ...
    (o,) = stub.Verify(worker_pb2.VerifyRequest(items=[worker_pb2.VerifyItem(sequence=extra[0])])).outcomes
    assert list(o.tokens) == list(first.tokens)
    # ... and an evicted request that comes back is rebuilt from its tokens, unchanged.
    (again,) = stub.Verify(worker_pb2.VerifyRequest(items=[worker_pb2.VerifyItem(sequence=seqs[1])])).outcomes
    assert list(again.tokens) == list(first.tokens)
    ids = [s.request_id for s in seqs] + [extra[0].request_id]
    rel = stub.Release(worker_pb2.ReleaseRequest(request_ids=ids))
    assert rel.released == TARGET_SLOTS and workers.target.info().free_slots == TARGET_SLOTS


def test_bad_input_is_invalid_argument(workers, reference):
    t, d, prompt = workers.target.stub, workers.draft.stub, reference["prompt"]
    C = grpc.StatusCode

    def verify(seq, draft=None):
        return lambda: t.Verify(worker_pb2.VerifyRequest(items=[worker_pb2.VerifyItem(sequence=seq, draft=draft)]))

    bad_tok = sequence_to_proto("bad", prompt + [100_000], GREEDY, None)
    code, msg = code_of(verify(bad_tok))
    assert code is C.INVALID_ARGUMENT and "100000" in msg and "tokens" in msg
    code, _ = code_of(lambda: d.Propose(worker_pb2.ProposeRequest(sequences=[bad_tok])))
    assert code is C.INVALID_ARGUMENT
    ok = sequence_to_proto("bad", prompt, GREEDY, None)
    code, msg = code_of(verify(ok, worker_pb2.Draft(tokens=[-1])))
    assert code is C.INVALID_ARGUMENT and "draft" in msg
    code, msg = code_of(verify(sequence_to_proto("bad", [], GREEDY, None)))
    assert code is C.INVALID_ARGUMENT and "tokens" in msg
    code, msg = code_of(verify(sequence_to_proto("bad", prompt, SamplingParams(temperature=0.5, top_p=2.0), None)))
    assert code is C.INVALID_ARGUMENT and "top_p" in msg
    code, msg = code_of(verify(sequence_to_proto("bad", prompt, SamplingParams(temperature=0.5), "invariant")))
    assert code is C.INVALID_ARGUMENT and "seed" in msg
    code, msg = code_of(lambda: t.Verify(worker_pb2.VerifyRequest(items=[worker_pb2.VerifyItem(sequence=ok)] * 2)))
    assert code is C.INVALID_ARGUMENT and "twice" in msg
    code, msg = code_of(verify(sequence_to_proto("bad", [1] * MAX_LEN, GREEDY, None), worker_pb2.Draft(tokens=[1])))
    assert code is C.INVALID_ARGUMENT and str(MAX_LEN) in msg
    # Bytes that do not decode: INVALID_ARGUMENT naming the field (google.rpc.BadRequest), not INTERNAL.
    calls = (
        (workers.target, "TargetService/Verify", worker_pb2.VerifyRequest(items=[worker_pb2.VerifyItem(sequence=ok)])),
        (workers.draft, "DraftService/Propose", worker_pb2.ProposeRequest(sequences=[ok])),
    )
    for w, method, msg in calls:
        garbled = msg.SerializeToString().replace(b"bad", b"b\xffd")  # the request id
        code, details = code_of(lambda: w.channel.unary_unary(f"/specdec.v1.{method}")(garbled, timeout=10))  # noqa: B023
        path = "items[0].sequence.request_id" if "Verify" in method else "sequences[0].request_id"
        assert (code, details) == (C.INVALID_ARGUMENT, f"request does not decode: {path} is not valid UTF-8")
    # Nothing was left behind, and the worker keeps serving.
    assert workers.target.info().free_slots == TARGET_SLOTS


def test_calls_need_the_worker_secret(workers, reference):
    """A direct call without the deployment's secret, or with another, is UNAUTHENTICATED and never
    reaches the model; with it the call works; health stays open (probes)."""
    seq = sequence_to_proto("no-secret", reference["prompt"], GREEDY, None, k=3)
    calls = {
        "Info": (workers.target, "TargetService/Info", worker_pb2.InfoRequest()),
        "Verify": (workers.target, "TargetService/Verify", worker_pb2.VerifyRequest(items=[{"sequence": seq}])),
        "Prefill": (workers.target, "TargetService/Prefill", worker_pb2.PrefillRequest(sequences=[seq])),
        "Propose": (workers.draft, "DraftService/Propose", worker_pb2.ProposeRequest(sequences=[seq])),
        "Release": (workers.draft, "DraftService/Release", worker_pb2.ReleaseRequest(request_ids=["x"])),
    }
    for secret in (None, "w" * 43):
        for name, (w, method, msg) in calls.items():
            with grpc.insecure_channel(w.address) as bare:
                call = bare.unary_unary(f"/specdec.v1.{method}")
                metadata = [(INTERNAL_HEADER, secret)] if secret else None
                code, details = code_of(lambda: call(msg.SerializeToString(), metadata=metadata, timeout=10))  # noqa: B023
            assert (code, details) == (grpc.StatusCode.UNAUTHENTICATED, "missing or invalid credentials"), name
        with grpc.insecure_channel(workers.target.address) as bare:
            health = health_pb2_grpc.HealthStub(bare).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
    # nothing ran: no slot was taken; with the secret the same call works
    assert workers.target.info().free_slots == TARGET_SLOTS and workers.draft.info().free_slots == 4
    (draft,) = workers.draft.stub.Propose(worker_pb2.ProposeRequest(sequences=[seq]), timeout=30).drafts
    assert len(draft.tokens) == 3
    workers.draft.stub.Release(worker_pb2.ReleaseRequest(request_ids=["no-secret"]), timeout=10)


def test_work_no_router_round_asks_for_is_refused(workers, reference):
    """A k above max_k (once, a 33-byte Propose could make a drafter draft 4,088 tokens), a draft longer than
    max_k, more sequences than KV slots and more tokens than the context: INVALID_ARGUMENT, up front."""
    t, d, prompt, C = workers.target.stub, workers.draft.stub, reference["prompt"], grpc.StatusCode
    big_k = sequence_to_proto("big-k", prompt, GREEDY, None, k=4088)
    assert len(worker_pb2.ProposeRequest(sequences=[big_k]).SerializeToString()) < 64
    code, msg = code_of(lambda: d.Propose(worker_pb2.ProposeRequest(sequences=[big_k]), timeout=10))
    assert code is C.INVALID_ARGUMENT and "at most 16" in msg
    seq = sequence_to_proto("long-draft", prompt, GREEDY, None)
    item = worker_pb2.VerifyItem(sequence=seq, draft=worker_pb2.Draft(tokens=[1] * 17))
    code, msg = code_of(lambda: t.Verify(worker_pb2.VerifyRequest(items=[item]), timeout=10))
    assert code is C.INVALID_ARGUMENT and "17 draft tokens" in msg
    many = [worker_pb2.VerifyItem(sequence=sequence_to_proto(f"m{i}", prompt, GREEDY, None)) for i in range(4)]
    code, msg = code_of(lambda: t.Verify(worker_pb2.VerifyRequest(items=many), timeout=10))
    assert code is C.INVALID_ARGUMENT and f"{TARGET_SLOTS} KV slots" in msg
    too_long = sequence_to_proto("too-long", [1] * (MAX_LEN + 1), GREEDY, None)
    code, msg = code_of(lambda: t.Prefill(worker_pb2.PrefillRequest(sequences=[too_long]), timeout=10))
    assert code is C.INVALID_ARGUMENT and f"context of {MAX_LEN}" in msg
    assert workers.target.info().free_slots == TARGET_SLOTS and workers.draft.info().free_slots == 4


def test_grpcurl_health_and_reflection(workers):
    secret = ("-H", f"{INTERNAL_HEADER}: {current_secret()}")  # grpcurl sends it on reflection calls too
    for w, service in ((workers.target, "specdec.v1.TargetService"), (workers.draft, "specdec.v1.DraftService")):
        listed = run_grpcurl("-plaintext", *secret, w.address, "list")
        assert listed.returncode == 0, listed.stderr
        assert set(listed.stdout.split()) == {
            service,
            "grpc.health.v1.Health",
            "grpc.reflection.v1alpha.ServerReflection",
        }
        for name in ("", service):
            check = run_grpcurl(
                "-plaintext", *secret, "-d", json.dumps({"service": name}), w.address, "grpc.health.v1.Health/Check"
            )
            assert check.returncode == 0 and json.loads(check.stdout)["status"] == "SERVING", check.stderr
        info = run_grpcurl("-plaintext", *secret, "-d", "{}", w.address, f"{service}/Info")
        assert info.returncode == 0 and json.loads(info.stdout)["role"] in ("target", "draft"), info.stderr
        refused = run_grpcurl("-plaintext", "-d", "{}", w.address, f"{service}/Info")
        assert refused.returncode != 0 and "Unauthenticated" in refused.stdout + refused.stderr


def test_killed_target_restarts_and_rebuilds_from_tokens(workers, reference, wait_for_restart):
    """Kill the target mid-request; the restarted actor (new port, empty cache) is found through the
    same handle, the committed tokens are replayed, and the output is unchanged."""
    import ray

    old_pid = ray.get(workers.target.handle.pid.remote())

    def kill_after_3(rounds: int) -> None:
        if rounds != 3:
            return
        ray.kill(workers.target.handle, no_restart=False)
        wait_for_restart(workers.target.handle, old_pid)
        workers.target.channel.close()
        workers.target = Worker.connect(workers.target.handle, worker_pb2_grpc.TargetServiceStub)

    req = run_rounds(workers, "restart", reference["prompt"], GREEDY, eos=reference["eos"], on_round=kill_after_3)
    assert req.generated == reference["results"]["greedy"].token_ids
    info = ray.get(workers.target.handle.info.remote())
    assert info["restarted"] is True and info["pid"] != old_pid
    assert workers.target.info().free_slots == TARGET_SLOTS
    # A named actor is found again by name, too.
    assert ray.get(ray.get_actor(TARGET_NAME).address.remote()) == workers.target.address


def test_unloadable_model_fails_the_actor_once(ray_cluster):
    """A bad model kills the actor in its constructor (no restart loop) with a readable cause."""
    import ray
    from ray.exceptions import RayActorError

    from specdec.rpc.errors import remote_error_message
    from target_worker.actor import spawn_target_worker

    with pytest.raises(ValueError, match="dtype"):  # a bad config fails before anything is spawned
        spawn_target_worker({"model": "x", "dtype": "float8"})
    handle = spawn_target_worker({"model": "/nonexistent/model.gguf"}, placement={"num_cpus": 0.5})
    with pytest.raises(RayActorError) as info:
        ray.get(handle.address.remote(), timeout=120)
    assert remote_error_message(info.value) == "ModelLoadError: /nonexistent/model.gguf: no such file or folder"
