"""The disaggregated service end to end: router + draft and target Ray actors, real gRPC on loopback.

A local Ray cluster (conftest ``ray_cluster``), tiny random models, the router in this process
(``RouterThread``) with the actors' handles (tests/integration/service_fixture.py). Outputs are
compared with the single-process engine (and plain transformers greedy decoding).
"""

from __future__ import annotations

import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest

from specdec.core.params import SamplingParams
from specdec.core.request_state import KPolicy
from specdec.rpc import generate_pb2
from specdec.rpc.client import SpecdecClient, build_request
from specdec.rpc.client_errors import DeadlineExceeded, from_rpc_error
from tests.integration.mixed_requests import mixed_requests
from tests.integration.service_fixture import MAX_LEN, SLOTS, running_service

REPO = Path(__file__).resolve().parents[2]
PROMPTS = ["def fib(n):", "hello world, ", "The quick brown fox", "import numpy as np\n", "abcabcabc", "x = 1\ny ="]


# ---- fixtures ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def service(ray_cluster, actor_reaper, tiny_paths):
    with running_service(actor_reaper, tiny_paths) as svc:
        yield svc


@pytest.fixture(scope="module")
def engine(tiny_paths):
    """The single-process engine with the same models. One torch thread: the workers' processes
    share the two cores, and a 2-thread OpenMP team next to them runs many times slower."""
    import torch

    from specdec.core.build import build_engine

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    eng, parts = build_engine(
        str(tiny_paths["llama"]),
        str(tiny_paths["llama-draft"]),
        dtype="float32",
        num_slots=16,
        max_len=MAX_LEN,
        k_policy=KPolicy(k=3),
    )
    try:
        yield eng, parts
    finally:
        torch.set_num_threads(threads)


def ref(engine, prompt_ids: list[int], params: SamplingParams):
    eng, _ = engine
    (res,) = eng.generate([list(prompt_ids)], params)
    return res


def refs(engine, prompts: list[list[int]], params: list[SamplingParams]):
    """Several references in one engine batch (the engine is batch-invariant for greedy and seeded)."""
    eng, _ = engine
    return eng.generate([list(p) for p in prompts], list(params))


def encode(engine, text: str) -> list[int]:
    return list(engine[1].target.tokenizer(text)["input_ids"])


# ---- correctness -------------------------------------------------------------------------------


def test_greedy_equals_engine_and_transformers(service, engine, tiny_paths):
    from tests.conftest import greedy_ids

    prompt = encode(engine, "def fib(n):")
    n = 24
    out = service.client.generate(prompt_token_ids=prompt, max_tokens=n, ignore_eos=True, timeout=60)
    expected = ref(engine, prompt, SamplingParams(max_tokens=n, ignore_eos=True))
    assert out.token_ids == expected.token_ids and out.text == expected.text
    assert out.finish_reason == "length" and out.usage == {"prompt_tokens": len(prompt), "completion_tokens": n}
    assert out.stats["drafted"] > 0  # it speculated (the tiny draft is often wrong: correctness is the point)

    assert out.token_ids == greedy_ids(tiny_paths["llama"], prompt, n)

    # a text prompt is tokenized by the target worker exactly as the engine's tokenizer does
    by_text = service.client.generate("def fib(n):", max_tokens=n, ignore_eos=True, timeout=60)
    assert by_text.token_ids == out.token_ids and by_text.usage["prompt_tokens"] == len(prompt)


def _mixed_requests(engine) -> list[tuple[dict, SamplingParams | None]]:
    base = [encode(engine, p) for p in PROMPTS]
    return mixed_requests(base, ref(engine, base[0], SamplingParams(max_tokens=40, ignore_eos=True)))


def test_16_concurrent_streams_with_mixed_parameters(service, engine):
    reqs = _mixed_requests(engine)
    results: list = [None] * len(reqs)
    evicted = {r: service.worker_info(r).evicted for r in ("target", "draft")}

    def run(i: int) -> None:
        kw, _ = reqs[i]
        chunks = list(service.client.generate_stream(timeout=120, request_id=f"mix-{i}", **kw))
        results[i] = chunks

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(reqs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    compared = [i for i, (_, p) in enumerate(reqs) if p is not None]
    expected_by_index = dict(
        zip(compared, refs(engine, [reqs[i][0]["prompt_token_ids"] for i in compared], [reqs[i][1] for i in compared]))
    )
    for i, ((kw, params), chunks) in enumerate(zip(reqs, results)):
        assert chunks, f"request {i} got nothing"
        last = chunks[-1]
        assert last.finish_reason in ("stop", "length") and all(c.finish_reason is None for c in chunks[:-1])
        assert all(c.request_id == f"mix-{i}" for c in chunks)
        tokens = [t for c in chunks for t in c.token_ids]
        text = "".join(c.text for c in chunks)
        assert last.usage["completion_tokens"] == len(tokens) <= kw["max_tokens"]
        if params is None:
            assert len(tokens) == kw["max_tokens"]
            continue
        expected = expected_by_index[i]
        assert tokens == expected.token_ids, f"request {i} ({kw}) differs from the engine"
        assert text == expected.text and last.finish_reason == expected.finish_reason, i
    assert service.metric("specdec_round_batch_size_count") > 0
    assert service.metric("specdec_round_batch_size_sum") > service.metric("specdec_round_batch_size_count")
    service.wait_slots_free()
    # 16 streams over 8 slots: each finished request's slots are free before a waiting one is placed
    # (WorkerClient.release), so no worker evicts a running request's cache to make room.
    assert {r: service.worker_info(r).evicted - n for r, n in evicted.items()} == {"target": 0, "draft": 0}
    # ... and the router's gauge shows what the workers report (polled each rebalance period).
    t_end = time.monotonic() + 60
    while (
        shown := [
            service.router.metrics.sample("specdec_worker_evicted", {"role": r, "worker": f"{r}-0"})
            for r in ("target", "draft")
        ]
    ) != [service.worker_info(r).evicted for r in ("target", "draft")]:
        assert time.monotonic() < t_end, f"specdec_worker_evicted shows {shown}"
        time.sleep(0.1)


def test_a_stream_sends_one_chunk_per_round(service, engine):
    """Alone on the service, a greedy stream gets one chunk per verify round: the chunks' count is
    the response's round count, each with the 1 to k_max + 1 tokens that round committed, and
    together the engine's output."""
    prompt = encode(engine, "def fib(n):")
    chunks = list(service.client.generate_stream(prompt_token_ids=prompt, max_tokens=48, mode="draft", timeout=120))
    stats = chunks[-1].stats
    assert stats["rounds"] > 1 and len(chunks) == stats["rounds"], (len(chunks), stats)
    k_max = service.router.router.config.k_policy.k_max
    assert all(1 <= len(c.token_ids) <= k_max + 1 for c in chunks[:-1]), [len(c.token_ids) for c in chunks]
    tokens = [t for c in chunks for t in c.token_ids]
    assert tokens == ref(engine, prompt, SamplingParams(max_tokens=48)).token_ids
    assert stats["accepted"] > 0 and len(tokens) > stats["rounds"]  # some round committed several tokens


def test_list_models_health_and_metrics(service):
    models = service.client.list_models()
    assert [(m["name"], m["role"], m["ready"]) for m in models] == [
        ("tiny-llama", "target", True),
        ("tiny-llama-draft", "draft", True),
    ]
    assert models[0]["max_context"] == MAX_LEN and models[0]["dtype"] == "float32"
    info = service.worker_info("target")
    assert models[0]["vocab_size"] == info.vocab_size == 259
    assert models[0]["eos_token_ids"] == list(info.eos_token_ids) and models[0]["eos_token_ids"]
    assert models[0]["has_chat_template"] is False  # the tiny tokenizer has none
    assert service.client.health() == "SERVING"
    assert service.client.health("specdec.v1.Generation") == "SERVING"
    port = service.router.router.metrics_port
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    for series in (
        "specdec_requests_total",
        "specdec_generated_tokens_total",
        "specdec_time_to_first_token_seconds",
        "specdec_time_per_output_token_seconds",
        "specdec_queue_depth",
        "specdec_rounds_total",
        "specdec_drafted_tokens_total",
        "specdec_accepted_tokens_total",
        "specdec_accepted_tokens_by_position_total",
        "specdec_acceptance_rate",
        "specdec_round_phase_seconds",
        "specdec_fail_open_rounds_total",
        "specdec_worker_up",
    ):
        assert series in text, series
    assert 'phase="draft_wait"' in text and 'phase="verify"' in text


# ---- errors ------------------------------------------------------------------------------------


BAD = [
    (dict(prompt=""), "prompt"),
    (dict(prompt="x", prompt_token_ids=[1, 2]), "prompt"),
    (dict(prompt_token_ids=[1] * MAX_LEN), "prompt_token_ids"),
    (dict(prompt="x", max_tokens=-1), "max_tokens"),
    (dict(prompt="x", max_tokens=MAX_LEN), "max_tokens"),
    (dict(prompt="x", temperature=-0.5), "temperature"),
    (dict(prompt="x", top_p=0.0), "top_p"),
    (dict(prompt="x", top_p=1.5), "top_p"),
    (dict(prompt="x", top_k=-1), "top_k"),
    (dict(prompt_token_ids=[1, 100000]), "prompt_token_ids"),
    (dict(prompt_token_ids=[-3]), "prompt_token_ids"),
    (dict(prompt="x", stop_token_ids=[99999]), "stop_token_ids"),
    (dict(prompt="x", k=-2), "speculation.k"),
    (dict(prompt="x", temperature=0.5, verify_mode="invariant"), "speculation.verify_mode"),
]


@pytest.mark.parametrize("kwargs,field", BAD, ids=[f"{f}-{i}" for i, (_, f) in enumerate(BAD)])
def test_bad_input_is_invalid_argument_naming_the_field(service, kwargs, field):
    with pytest.raises(grpc.RpcError) as err:
        service.client.generate(timeout=30, **kwargs)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(field + ":"), err.value.details()
    assert err.value.field == field  # google.rpc.BadRequest, for programs


def test_unknown_enum_values_are_invalid_argument(service):
    for spec, field in ((dict(mode=17), "speculation.mode"), (dict(verify_mode=9), "speculation.verify_mode")):
        req = generate_pb2.GenerateRequest(prompt="x", speculation=generate_pb2.SpeculationOptions(**spec))
        with pytest.raises(grpc.RpcError) as err:
            service.stub.Generate(req, timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details().startswith(field + ":"), err.value.details()
        assert from_rpc_error(err.value).field == field
    # and the service keeps serving
    assert service.client.generate("ok", max_tokens=3, timeout=30).usage["completion_tokens"] >= 1


def test_deadline_and_cancel_free_the_slots_on_both_workers(service):
    """The client's deadline passes (unary and streaming): the client raises DeadlineExceeded, the
    router counts it and frees the slots; a stream the client cancels frees them too."""
    import ray

    # Each verify 50 ms slower (the workers' TEST/BENCHMARK knob): 900 tokens, at most k_max + 1 a
    # round, take over 6 s however fast the machine, so the stream's 3 s deadline always cuts it,
    # and 3 s leave a loaded machine room for its first chunk.
    ray.get(service.target.set_bench_step_delay.remote(0.05), timeout=60)
    try:
        before = service.metric("specdec_requests_total", {"outcome": "deadline_exceeded"})
        with pytest.raises(DeadlineExceeded) as err:
            service.client.generate("long", max_tokens=900, ignore_eos=True, mode="draft", timeout=0.4)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        got = []
        with pytest.raises(DeadlineExceeded):
            for chunk in service.client.generate_stream(
                "long", max_tokens=900, ignore_eos=True, mode="draft", timeout=3.0
            ):
                got.append(chunk)
        assert got and not got[-1].finish_reason  # it streamed, then the deadline cut it
        service.wait_slots_free()
        t_end = time.monotonic() + 60
        while service.metric("specdec_requests_total", {"outcome": "deadline_exceeded"}) < before + 2:
            assert time.monotonic() < t_end, service.metric("specdec_requests_total", {"outcome": "deadline_exceeded"})
            time.sleep(0.05)

        before = service.metric("specdec_requests_total", {"outcome": "cancelled"})
        request = build_request("long", max_tokens=900, ignore_eos=True, mode="draft")
        call = service.stub.GenerateStream(request, timeout=120)
        got = [next(call), next(call)]
        assert all(c.token_ids for c in got)
        assert service.worker_info("target").free_slots < SLOTS  # it holds a slot while running
        call.cancel()
        service.wait_slots_free()
        t_end = time.monotonic() + 60
        while service.metric("specdec_requests_total", {"outcome": "cancelled"}) <= before:
            assert time.monotonic() < t_end
            time.sleep(0.05)
    finally:
        ray.get(service.target.set_bench_step_delay.remote(0.0), timeout=60)


def test_full_queue_is_resource_exhausted_and_others_keep_going(service, tiny_paths):
    from router.config import RouterConfig
    from router.server import RouterThread, TargetBinding
    from router.workers import ActorEndpoint

    binding = TargetBinding(
        "tiny-llama", ActorEndpoint(service.target), ActorEndpoint(service.draft), tokenizer=str(tiny_paths["llama"])
    )
    small = RouterThread([binding], RouterConfig(port=0, metrics_port=None, max_batch=1, max_queue=1)).start(60)
    try:
        client = SpecdecClient(small.address)
        long = dict(max_tokens=900, ignore_eos=True)
        running = client.stub.GenerateStream(build_request("a", **long), timeout=60)
        next(running)  # admitted and decoding
        queued = client.stub.GenerateStream(build_request("b", **long), timeout=60)
        t_end = time.monotonic() + 10
        while small.metrics.sample("specdec_queue_depth") != 1:
            assert time.monotonic() < t_end
            time.sleep(0.02)
        with pytest.raises(grpc.RpcError) as err:
            client.generate("c", max_tokens=5, timeout=30)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "queue is full" in err.value.details()
        assert 0 < err.value.retry_delay <= 60  # google.rpc.RetryInfo: the queue-drain estimate
        # the main service is not affected
        assert service.client.generate("d", max_tokens=5, timeout=30).usage["completion_tokens"] >= 1
        running.cancel()
        first = next(queued)  # the queued one is admitted once the slot is free
        assert first.token_ids
        queued.cancel()
        client.close()
    finally:
        small.stop(grace=0)
    service.wait_slots_free()


# ---- failures of the workers -------------------------------------------------------------------


def _stream_in_thread(client: SpecdecClient, **kwargs):
    out: dict = {"chunks": []}
    started = threading.Event()

    def run():
        try:
            for c in client.generate_stream(timeout=240, **kwargs):
                out["chunks"].append(c)
                started.set()
        except grpc.RpcError as exc:
            out["error"] = exc
        started.set()

    t = threading.Thread(target=run)
    t.start()
    started.wait(60)
    return t, out


def test_killing_the_draft_worker_fails_open_then_speculation_resumes(service, engine, wait_for_restart):
    import ray

    prompt = encode(engine, "abcabcabc")
    params = SamplingParams(max_tokens=700, ignore_eos=True)
    expected = ref(engine, prompt, params)
    old_pid = ray.get(service.draft.pid.remote(), timeout=30)
    fail_open_before = service.metric("specdec_fail_open_rounds_total", {"reason": "unavailable"})
    t, out = _stream_in_thread(service.client, prompt_token_ids=prompt, max_tokens=700, ignore_eos=True, mode="draft")
    ray.kill(service.draft, no_restart=False)
    t.join(240)
    assert "error" not in out, out.get("error")
    chunks = out["chunks"]
    assert [x for c in chunks for x in c.token_ids] == expected.token_ids  # identical output
    stats = chunks[-1].stats
    assert stats["fail_open_rounds"] > 0 and stats["drafted"] > 0
    assert service.metric("specdec_fail_open_rounds_total", {"reason": "unavailable"}) > fail_open_before

    # the restarted drafter (a new process on a new port) is found again and used
    wait_for_restart(service.draft, old_pid)
    t_end = time.monotonic() + 60
    while service.metric("specdec_worker_up", {"role": "draft", "worker": "draft-0"}) != 1:
        assert time.monotonic() < t_end, "the router did not find the restarted draft worker"
        time.sleep(0.1)
    drafted_before = service.metric("specdec_drafted_tokens_total")
    again = service.client.generate(prompt_token_ids=prompt, max_tokens=40, ignore_eos=True, mode="draft", timeout=60)
    assert again.stats["drafted"] > 0 and again.stats["fail_open_rounds"] == 0
    assert again.token_ids == expected.token_ids[:40]
    assert service.metric("specdec_drafted_tokens_total") > drafted_before
    assert service.metric("specdec_worker_restarts_total", {"role": "draft"}) >= 1
    service.wait_slots_free()


def test_killing_the_target_worker_caches_the_contexts_again_in_chunks_unchanged(service, engine, wait_for_restart):
    """Two streams with prompts of several chunks; the target is killed while both run. Ray starts
    a new process; both requests cache their committed tokens on it again in chunks (never one
    forward over every context: docs/design.md, Recovery) and complete with the engine's tokens."""
    import ray

    prompts = [[3 + (i * 11 + j) % 250 for j in range(300)] for i in range(2)]
    params = [
        SamplingParams(max_tokens=300, ignore_eos=True, temperature=0.9, seed=99),
        SamplingParams(max_tokens=300, ignore_eos=True),
    ]
    expected = refs(engine, prompts, params)
    old_pid = ray.get(service.target.pid.remote(), timeout=30)
    recached, chunks = (service.metric(m) for m in ("specdec_recached_requests_total", "specdec_prefill_chunks_total"))
    streams = [
        _stream_in_thread(
            service.client,
            prompt_token_ids=p,
            max_tokens=300,
            ignore_eos=True,
            temperature=q.temperature,
            seed=q.seed,
        )
        for p, q in zip(prompts, params)
    ]
    ray.kill(service.target, no_restart=False)
    for (t, out), want in zip(streams, expected):
        t.join(240)
        assert "error" not in out, out.get("error")
        # greedy and seeded (invariant): unchanged across the restart
        assert [x for c in out["chunks"] for x in c.token_ids] == want.token_ids
    assert wait_for_restart(service.target, old_pid) != old_pid
    assert service.metric("specdec_worker_restarts_total", {"role": "target"}) >= 1
    assert service.metric("specdec_recached_requests_total") - recached == 2
    # each context (a 300-token prompt and what it had generated) came back in chunks of 128
    assert service.metric("specdec_prefill_chunks_total") - chunks >= 2 * 3 + 2 * 3
    service.wait_slots_free()


# ---- the benchmark driver ----------------------------------------------------------------------


def test_bench_serve_drives_the_service(service, engine, monkeypatch):
    from specdec.bench.serve import BenchOptions, bench_serve
    from specdec.bench.serve_report import format_table
    from specdec.core.prompts import Prompt

    # The AUTO requests keep speculating: by the goodput rule (router/speculation_off.py) measured
    # verify and draft times on a loaded machine can switch them all off, and the bench's report of
    # the Proposes checked below would have none to show.
    monkeypatch.setattr("router.target_balance.plan_speculation", lambda jobs, cost, now, cfg: [j.off for j in jobs])

    prompts = [Prompt(f"p{i}", p, False) for i, p in enumerate(PROMPTS[:3])]

    class Engine:  # the single-process engine, interleaved at c=1 (the CLI passes the real one)
        config = {"engine": "tiny"}

        def one(self, prompt, max_tokens):
            t0 = time.perf_counter()
            res = ref(engine, encode(engine, prompt.text), SamplingParams(max_tokens=max_tokens))
            t1 = time.perf_counter()
            return {
                "id": prompt.id,
                "mode": "engine",
                "tokens": len(res.token_ids),
                "t_start": t0,
                "t_first": t1,
                "t_last": t1,
                "t_end": t1,
                "stats": res.stats.as_dict(),
                "finish_reason": res.finish_reason,
                "token_ids": res.token_ids,
                "error": None,
            }

    options = BenchOptions(
        max_tokens=12,
        concurrency=(1, 2),
        rates=(20.0,),
        requests=3,
        modes=("auto", "off"),
        metrics_url=f"http://127.0.0.1:{service.router.router.metrics_port}/metrics",
    )
    result = bench_serve(
        service.router.address, prompts, options, engine=Engine(), encode=lambda p: encode(engine, p.text)
    )
    rows = {(r["scenario"], r["mode"]): r["summary"] for r in result["results"]}
    assert set(rows) == {
        ("closed c=1", "auto"),
        ("closed c=1", "off"),
        ("closed c=1", "engine"),
        ("closed c=2", "auto"),
        ("closed c=2", "off"),
        ("poisson 20.0/s", "auto"),
        ("poisson 20.0/s", "off"),
    }
    for key, s in rows.items():
        assert s["errors"] == 0 and s["requests"] == 3 and s["tokens"] > 0 and s["throughput_tok_s"] > 0, key
        assert s["ttft_ms_p50"] is not None and s["ttft_ms_p99"] >= s["ttft_ms_p50"], key
    assert rows[("closed c=1", "auto")]["agreement_with_engine"] == 1.0  # greedy: the same tokens
    assert rows[("closed c=1", "off")]["agreement_with_engine"] == 1.0
    assert "speedup_vs_off" in rows[("closed c=2", "auto")] and "service_vs_engine" in rows[("closed c=1", "auto")]
    assert rows[("closed c=2", "auto")]["split"]["rounds"] > 0
    # the draft worker's compute per Propose, and the Propose's size (the calibration reads them)
    drafts = rows[("closed c=1", "auto")]["split"]
    assert drafts["proposes"] > 0 and drafts["propose_compute_ms"] > 0 and drafts["propose_rows"] == 1
    # the wall less the compute: above zero, and within the rounds' total wait for drafts (a round
    # waits out each of its timed Proposes)
    assert 0 < drafts["propose_rpc_ms"] * drafts["proposes"] < drafts["draft_wait_ms_per_round"] * drafts["rounds"]
    assert 1 <= drafts["propose_steps"] <= 12 and "proposes" not in rows[("closed c=1", "off")]["split"]
    table = format_table(result)
    assert "closed c=1" in table and "poisson 20.0/s" in table and "engine" in table
