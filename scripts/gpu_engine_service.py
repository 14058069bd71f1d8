"""The service against the engine at batch 1: what a round's gRPC hops cost at this device's
forward times.

The router (router.server.RouterThread) and the two workers' gRPC servers run in this process,
without Ray, on loopback, over the very runners the engine uses (so the same weights): the
target's TargetServicer and a DraftServicer over the fixed-acceptance drafter, each on its own
sync gRPC server with the worker-secret check, as tests/integration/test_tokenizer_rpc.py serves
them. The router runs the engine's round: fixed k, one micro-batch, no pre-drafting, drafts
always awaited. One prompt goes through the engine and through the service at k = 0 and with
speculation; the difference of their mean time per round (after the first, which holds the
prefill) is the hops' overhead per round. The router's own round phases (router/metrics.py) say
where it goes: the Verify's transport and the servers' threads (rpc), the router's work (router),
the drafter's call (draft wait).

Then the same again with the two workers in a process of their own (``--workers``: the same
models, built there from the same seeds; its target's k = 0 tokens are checked against this
one's), the router and the client here, as a deployment runs them: in one process every thread
shares one interpreter lock, and the router's and the client's work between rounds can slow the
workers' forwards (on the 2-core CPU the toy models' verify took 1.5x the engine's there).

The router and the workers need grpcio, protobuf and prometheus_client; where this Python lacks
them the section is skipped, saying which.
"""

from __future__ import annotations

import json
import math
import os
import queue
import secrets
import subprocess
import sys
import threading
import time
from contextlib import ExitStack
from pathlib import Path

from fixed_acceptance import FixedAcceptanceDrafter
from gpu_engine_e2e import NOT_RUN, acceptance, make_prompts, run_engine

from specdec.core.engine import KPolicy


def _missing() -> str | None:
    try:
        import draft_worker.servicer  # noqa: F401 - the imports the service needs, tried at once
        import router.server  # noqa: F401
        import specdec.rpc.client  # noqa: F401
        import target_worker.servicer  # noqa: F401
    except ImportError as exc:
        return exc.name or str(exc)
    return None


def _serve(stack: ExitStack, add, servicer, service: str, secret: str) -> str:
    from specdec.rpc.server import start_server, stop_server
    from specdec.rpc.worker_secret import worker_interceptor

    server, port = start_server([(add, servicer, service)], interceptors=[worker_interceptor(secret)])
    stack.callback(stop_server, server, 0)
    return f"127.0.0.1:{port}"


def _secret() -> str:
    """This process's worker secret, made here as `specdec serve` makes one where none is set: the
    router sends it, the workers require it."""
    from specdec.rpc.worker_secret import SECRET_ENV, current_secret

    return current_secret() or os.environ.setdefault(SECRET_ENV, secrets.token_urlsafe(32))


def _workers(stack: ExitStack, pair, drafter) -> tuple[str, str]:
    """The target's and the drafter's gRPC servers; returns their addresses."""
    from draft_worker.servicer import SERVICE_NAME as DRAFT_SERVICE
    from draft_worker.servicer import DraftServicer
    from specdec.core.target import TargetVerifier
    from specdec.core.tokenizer_spec import vocab_fingerprint
    from specdec.rpc import worker_pb2_grpc
    from target_worker.servicer import TargetServicer

    secret = _secret()
    device = pair.target.device.type
    target = TargetServicer(
        TargetVerifier(pair.target), pair.tokenizer, model_name=pair.names[0], dtype="bfloat16", device=device
    )
    draft = DraftServicer(
        drafter,
        model_name=pair.names[1],
        dtype="bfloat16",
        device=device,
        vocab_size=pair.vocab_size,
        max_context=pair.draft.max_len,
        num_slots=pair.draft.num_slots,
        tokenizer_fingerprint=vocab_fingerprint(pair.tokenizer.get_vocab()),
    )
    target_name = "specdec.v1.TargetService"
    t_addr = _serve(stack, worker_pb2_grpc.add_TargetServiceServicer_to_server, target, target_name, secret)
    d_addr = _serve(stack, worker_pb2_grpc.add_DraftServiceServicer_to_server, draft, DRAFT_SERVICE, secret)
    return t_addr, d_addr


def _router(stack: ExitStack, t_addr: str, d_addr: str, k: int, max_tokens: int):
    """The router over the two workers, running the engine's round; returns (client, its metrics)."""
    from router.config import RebalanceConfig, RouterConfig
    from router.server import RouterThread, TargetBinding
    from router.workers import StaticEndpoint
    from specdec.rpc.client import SpecdecClient

    _secret()  # the router's calls carry this process's secret (where _workers has not made it)
    config = RouterConfig(
        port=0,
        metrics_port=None,
        http_port=None,
        k_policy=KPolicy(k=k, adaptive=False, k_min=1, k_max=k),
        micro_batches=1,
        predraft=False,
        draft_deadline_factor=0.0,  # always the 5 s deadline: no round fails open on timing noise
        rebalance=RebalanceConfig(enabled=False),
        default_max_tokens=max_tokens,
    )
    binding = TargetBinding(
        "bench", StaticEndpoint(t_addr, "target-0"), StaticEndpoint(d_addr, "draft-0"), "bench-draft", tokenizer=None
    )
    router = RouterThread([binding], config).start(connect_timeout=120)
    stack.callback(router.stop, 0)
    client = SpecdecClient(router.address)
    stack.callback(client.close)
    return client, router.metrics


def _start(stack: ExitStack, pair, drafter, k: int, max_tokens: int):
    """The workers and the router in this process; returns (client, the router's metrics)."""
    return _router(stack, *_workers(stack, pair, drafter), k, max_tokens)


PHASES = ("round", "draft_wait", "verify", "rpc", "router")  # router/metrics.py: specdec_round_phase_seconds


def _phase_sums(metrics) -> dict[str, float]:
    """The router's round phases so far: each one's total seconds, and the rounds counted."""
    out = {}
    for family in metrics.phase.collect():
        for sample in family.samples:
            if sample.name.endswith("_sum"):
                out[sample.labels["phase"]] = sample.value
            elif sample.name.endswith("_count") and sample.labels["phase"] == "round":
                out["rounds"] = sample.value
    return out


def _phases(metrics, run) -> tuple[dict, dict[str, float]]:
    """``run()``'s result, and where its rounds' time went by the router's own phases, ms a round:
    draft_wait (the Propose), verify (the Verify's wall time), rpc (of that, all but the worker's
    own compute: serialisation, loopback, the servers' threads) and router (the router's own work)."""
    before = _phase_sums(metrics)
    result = run()
    after = _phase_sums(metrics)
    rounds = after["rounds"] - before.get("rounds", 0.0)
    if not rounds:
        return result, {}
    return result, {p: round(1e3 * (after[p] - before.get(p, 0.0)) / rounds, 3) for p in PHASES if p in after}


def _through_service(client, prompt: list[int], max_tokens: int, k: int) -> dict:
    chunks = list(
        client.generate_stream(
            prompt_token_ids=prompt, max_tokens=max_tokens, ignore_eos=True, mode="draft" if k else "off", k=k
        )
    )
    times = [c.time for c in chunks if c.token_ids]
    stats = chunks[-1].stats or {}
    # A chunk is a round's committed tokens (its accepted drafts and the target's own), and a round
    # drafts what the k policy allows before max_tokens: the rounds' (drafted, accepted), where the
    # counts agree with the service's own.
    rounds, generated = [], 0
    for c in chunks:
        if c.token_ids:
            rounds.append((min(k, max_tokens - generated - 1), len(c.token_ids) - 1))
            generated += len(c.token_ids)
    agree = len(rounds) == stats.get("rounds") and sum(d for d, _ in rounds) == stats.get("drafted")
    return {
        "tokens": [t for c in chunks for t in c.token_ids],
        "round ms": (times[-1] - times[0]) / (len(times) - 1) * 1e3 if len(times) > 1 else float("nan"),
        "stats": stats,
        "chunks": len(times),
        "rounds": rounds if agree else None,
    }


def _row(out: dict, name: str, engine_run, service_run: dict, ref_tokens: list[int], phases: dict, planned) -> None:
    """One row of the report: a served run against the engine's; ``planned``: the accepted tokens
    the fixed-acceptance plan says (None at k = 0)."""
    stats = service_run["stats"]
    row = out[name] = {
        "engine ms/round": round(engine_run.round_ms(), 3),
        "service ms/round": round(service_run["round ms"], 3),
        "overhead ms/round": round(service_run["round ms"] - engine_run.round_ms(), 3),
        "engine rounds": len(engine_run.verify_s),
        "service rounds": stats.get("rounds"),
        "service chunks": service_run["chunks"],
        "fail-open rounds": stats.get("fail_open_rounds", 0),
        "identical to engine k=0": service_run["tokens"] == ref_tokens,
        "router phases ms/round": phases,
    }
    if not row["identical to engine k=0"]:
        out["failures"].append(f"{name}: the service's tokens differ from the engine's at k = 0")
    if planned is None:
        return
    row["engine identical to k=0"] = engine_run.tokens == [ref_tokens]
    if not row["engine identical to k=0"]:
        out["failures"].append(f"{name}: the engine's tokens differ from its own at k = 0")
    row["a measured (engine)"] = round(acceptance(engine_run.rounds)[0], 4)
    if service_run["rounds"] is not None:
        row["a measured (service)"] = round(acceptance(service_run["rounds"])[0], 4)
    row["accepted"], row["accepted as planned"] = stats.get("accepted"), planned
    if not row["fail-open rounds"] and stats.get("accepted") != planned:
        out["failures"].append(f"{name}: the service accepted {stats.get('accepted')}, the plan says {planned}")


def _served(client, metrics, prompt: list[int], k: int, max_tokens: int) -> dict:
    """Warm-up requests, then the two served runs: k = 0 and k; each (run, router phases)."""
    for warm_k in (0, k):  # the channels, the router's loop, the servicers' first calls
        _through_service(client, prompt, 4, warm_k)
    return {kk: _phases(metrics, lambda kk=kk: _through_service(client, prompt, max_tokens, kk)) for kk in (0, k)}


APART_S = 120.0  # what the workers-apart runs may take, their models built again included


def _workers_apart(stack: ExitStack, build: dict) -> dict:
    """Both workers in a process of their own (as Ray actors run them), over the same models built
    from the same seeds there; returns its addresses and its target's k = 0 tokens."""
    from specdec.rpc.worker_secret import SECRET_ENV

    root = str(Path(__file__).resolve().parents[1])  # specdec, router and the workers' packages
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    proc = subprocess.Popen(
        [sys.executable, __file__, "--workers", json.dumps(build)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={**os.environ, SECRET_ENV: _secret(), "PYTHONPATH": path},
        text=True,
    )
    stack.callback(_stop, proc)
    lines: queue.Queue = queue.Queue()

    def read() -> None:
        for line in proc.stdout:
            lines.put(line)
        lines.put("")

    threading.Thread(target=read, daemon=True).start()
    while True:
        line = lines.get(timeout=600)
        if not line:
            raise RuntimeError(f"the worker process ended (status {proc.wait()}) before serving; its stderr says why")
        if line.startswith("{"):
            return json.loads(line)


def _stop(proc: subprocess.Popen) -> None:
    """End the worker process: it serves until its stdin closes."""
    proc.stdin.close()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _serve_apart(build: dict) -> None:
    """The worker process of :func:`_workers_apart`: build, serve, say where, wait for stdin to close."""
    import gpu_engine

    s = gpu_engine.Settings.of(build["quick"], build["tiny"])
    pair = gpu_engine.build_pair(build["device"], build["tiny"], s)
    prompt = make_prompts(pair.vocab_size, 1, build["prompt tokens"], seed=1)[0]
    ref = run_engine(pair.target, pair.tokenizer, [prompt], build["max tokens"])
    drafter = FixedAcceptanceDrafter(pair.draft, [(prompt, ref.tokens[0])], build["rate"])
    with ExitStack() as stack:
        t_addr, d_addr = _workers(stack, pair, drafter)
        print(json.dumps({"target": t_addr, "draft": d_addr, "reference": ref.tokens[0]}), flush=True)
        sys.stdin.read()


def service_vs_engine(
    pair, k: int, rate: float, prompt_len: int, max_tokens: int, build: dict | None = None, deadline: float = math.inf
) -> dict:
    """The rows "k=0" and "k=K, a=RATE": router and workers in this process; with ``build`` (the
    device, quick and tiny of the pair's settings) also "..., workers apart": the workers in a
    process of their own, the router and client here, as a deployment runs them, unless under
    APART_S seconds are left before ``deadline`` (time.monotonic()) by then."""
    missing = _missing()
    if missing is not None:
        return {
            "skipped": f"the router and the workers need {missing!r} (grpcio, protobuf, prometheus_client): not here"
        }
    prompt = make_prompts(pair.vocab_size, 1, prompt_len, seed=1)[0]
    out: dict = {"k": k, "a set": rate, "prompt tokens": prompt_len, "max tokens": max_tokens, "failures": []}
    spec_name = f"k={k}, a={rate}"
    run_engine(pair.target, pair.tokenizer, [prompt], 4)  # the engine's first calls, not timed
    ref = run_engine(pair.target, pair.tokenizer, [prompt], max_tokens)
    plan = [(prompt, ref.tokens[0])]
    drafter = FixedAcceptanceDrafter(pair.draft, plan, rate)
    spec = run_engine(pair.target, pair.tokenizer, [prompt], max_tokens, drafter, k)
    # what the plan says a run of these rounds accepts: the engine's count (a served drafter's
    # holds the warm-up requests too)
    planned = drafter.planned_accepted
    with ExitStack() as stack:  # the served drafter: the same plan and coins
        client, metrics = _start(stack, pair, FixedAcceptanceDrafter(pair.draft, plan, rate), k, 4)
        served = _served(client, metrics, prompt, k, max_tokens)
    _row(out, "k=0", ref, served[0][0], ref.tokens[0], served[0][1], None)
    _row(out, spec_name, spec, served[k][0], ref.tokens[0], served[k][1], planned)
    if build is None:
        return out
    if time.monotonic() > deadline - APART_S:
        out["workers apart"] = dict(NOT_RUN)
        return out
    with ExitStack() as stack:
        apart = _workers_apart(stack, {**build, "rate": rate, "prompt tokens": prompt_len, "max tokens": max_tokens})
        if apart["reference"] != ref.tokens[0]:
            out["failures"].append("workers apart: the worker process's target decodes other tokens (other models)")
        client, metrics = _router(stack, apart["target"], apart["draft"], k, 4)
        served = _served(client, metrics, prompt, k, max_tokens)
    _row(out, "k=0, workers apart", ref, served[0][0], ref.tokens[0], served[0][1], None)
    _row(out, f"{spec_name}, workers apart", spec, served[k][0], ref.tokens[0], served[k][1], planned)
    return out


if __name__ == "__main__" and sys.argv[1:2] == ["--workers"]:
    _serve_apart(json.loads(sys.argv[2]))
