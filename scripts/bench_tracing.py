"""What the router's and the workers' trace instrumentation costs, tracing off (the default) and on
(spans batched and exported by OTLP/gRPC to tests/otlp_receiver.py, run in a process of its own).

    PYTHONPATH=. python scripts/bench_tracing.py [--batch 1,8] [--requests 400] [--rounds 8] [--pace-ms 2]

It runs the router's own span code as the servicer and the scheduler do (router/traces.py: the
request span from an incoming traceparent, its job's attributes, a prefill round, then ``--rounds``
rounds with their draft_wait and verify phases and outcomes, and router/workers.py's traceparent
check and injection before each call), for ``--batch`` requests at a time, with no model and no
network. Rounds come ``--pace-ms`` apart, as in a service, and the figure is this process's CPU time
(every thread: the SDK's exporter encodes and sends in its own) per round, export included; "back
to back" is the off path alone, unpaced. Per worker call: the workers' server-side span around a
Verify handler that does nothing. Off and on alternate, best of ``--repeat``.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NamedTuple

import grpc

from router.access_log import AccessRecord
from router.jobs import Job
from router.traces import end_request, round_trace, start_request, traced_job
from specdec.core.params import SamplingParams, VerifyMode
from specdec.core.request_state import KPolicy, new_request
from specdec.core.round_types import Draft
from specdec.rpc import tracing, worker_pb2

SERVICE = "specdec.v1.Generation"


class _CallContext:
    """What the servicer reads of grpc's context here: the caller's metadata."""

    def __init__(self, traceparent: str):
        self.metadata = (("traceparent", traceparent), ("user-agent", "grpc-python"))

    def invocation_metadata(self):
        return self.metadata


@contextmanager
def _exported_to(endpoint: str) -> Iterator[None]:
    """Tracing on for the block, exporting to ``endpoint``, as the variables turn it on in a service."""
    os.environ["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] = endpoint
    try:
        assert tracing.setup("bench")
        yield
    finally:
        tracing.shutdown()  # exports what is left
        del os.environ["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"]


def _jobs(n: int) -> list[Job]:
    params, policy = SamplingParams(max_tokens=64), KPolicy(k=4)
    jobs = []
    for i in range(n):
        state = new_request(f"r{i}", [1, 2, 3, 4], params, VerifyMode.GREEDY, policy, {0}, lambda ids: "")
        jobs.append(Job(key=f"r{i}", request_id=f"r{i}", state=state, spec="draft", auto=False, deadline=None))
    return jobs


def _call_metadata(method: str):
    """router/workers.py's check (and, on, injection) before each worker call."""
    return tracing.outgoing() if tracing.active and method in tracing.WORKER_RPCS else None


def _paced_cpu(steps, pace_s: float) -> float:
    """This process's CPU seconds (every thread: the exporter's too) to run ``steps`` (callables)
    ``pace_s`` apart, as a service's rounds are, and to export what they traced."""
    c0 = time.process_time()
    for step in steps:
        step()
        if pace_s:
            time.sleep(pace_s)  # the exporter works meanwhile, as between a service's rounds
    tracing.flush()
    return time.process_time() - c0


def run(batch: int, requests: int, rounds: int, pace_s: float) -> float:
    """CPU seconds of instrumentation per round (requests' start and end shared among their rounds)."""
    drafts = [Draft(tokens=[5, 6, 7, 8]) for _ in range(batch)]
    outcomes = [worker_pb2.VerifyOutcome(tokens=[5, 6, 9], num_accepted=2) for _ in range(batch)]
    ctx = _CallContext(f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01")
    groups = [
        (_jobs(batch), [AccessRecord("Generate", "bench", model="m") for _ in range(batch)])
        for _ in range(requests // batch)
    ]

    def request(jobs, recs):
        calls = [start_request(SERVICE, "Generate", ctx) for _ in jobs]
        for span, job in zip(calls, jobs):
            traced_job(span, job)
        with round_trace(jobs, "prefill"):
            _call_metadata("Prefill")
        for _ in range(rounds):
            with round_trace(jobs) as trace:
                with trace.phase("draft_wait"):
                    _call_metadata("Propose")
                with trace.phase("verify"):
                    _call_metadata("Verify")
                trace.outcomes(jobs, drafts, outcomes)
        for span, rec, job in zip(calls, recs, jobs):
            end_request(span, rec, job)

    steps = [lambda g=g: request(*g) for g in groups]
    return _paced_cpu(steps, pace_s * rounds) / (len(groups) * rounds)


class _CallDetails(NamedTuple):  # what grpc hands a server interceptor
    method: str
    invocation_metadata: tuple


def run_worker_calls(calls: int, pace_s: float) -> float:
    """CPU seconds per worker call of the server side (specdec/rpc/tracing.py's interceptor,
    installed only while tracing is on) around a Verify handler that does nothing."""
    request = worker_pb2.VerifyRequest(items=[worker_pb2.VerifyItem()] * 4)
    handler = grpc.unary_unary_rpc_method_handler(lambda req, ctx: req)
    metadata = (("traceparent", f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01"),)
    details = _CallDetails("/specdec.v1.TargetService/Verify", metadata)
    interceptors = tracing.server_interceptors()

    def call() -> None:
        h = handler
        for i in interceptors:  # as grpc does per call
            h = i.intercept_service(lambda d: handler, details)
        h.unary_unary(request, None)

    return _paced_cpu([call] * calls, pace_s) / calls


@contextmanager
def _receiver() -> Iterator[tuple[str, list[int]]]:
    """tests/otlp_receiver.py in a process of its own (its decoding is not this process's CPU);
    yields its endpoint and, once it ends, the spans it got."""
    code = (
        "import sys\nfrom tests.otlp_receiver import otlp_receiver\nwith otlp_receiver() as rx:\n"
        "    print(rx.endpoint, flush=True)\n    sys.stdin.read()\n    print(len(rx.spans), flush=True)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    got: list[int] = []
    try:
        yield proc.stdout.readline().strip(), got
    finally:
        proc.stdin.close()
        got.append(int(proc.stdout.readline() or 0))
        proc.wait(timeout=30)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", default="1,8", help="requests per round, comma-separated")
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--rounds", type=int, default=8, help="rounds per request")
    p.add_argument("--pace-ms", type=float, default=2.0, help="time between rounds (and between worker calls / 4)")
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--json", default=None, help="write the figures here too")
    args = p.parse_args()
    for key in [k for k in os.environ if k.startswith("OTEL_")]:  # "off" means off
        del os.environ[key]
    pace = args.pace_ms / 1e3
    results = []
    with _receiver() as (endpoint, received):

        def both(measure) -> dict[str, float]:  # alternating, best of --repeat, in microseconds
            best = {"off": float("inf"), "on": float("inf")}
            for _ in range(args.repeat):
                best["off"] = min(best["off"], measure())
                with _exported_to(endpoint):
                    best["on"] = min(best["on"], measure())
            return {k: v * 1e6 for k, v in best.items()}

        for batch in [int(b) for b in args.batch.split(",")]:
            us = both(lambda batch=batch: run(batch, args.requests, args.rounds, pace))
            # off, back to back: all the instrumentation costs when off, the harness's loop included
            us["off_unpaced"] = min(run(batch, args.requests, args.rounds, 0.0) for _ in range(args.repeat)) * 1e6
            results.append({"per": "round", "batch": batch, **us})
            print(
                f"per round of {batch} request(s): off {us['off']:.1f} us CPU ({us['off_unpaced']:.2f} us back to "
                f"back, no sleep), on {us['on']:.1f} us (+{(us['on'] - us['off']) / batch:.1f} us per request-round)",
                flush=True,
            )
        us = both(lambda: run_worker_calls(args.requests * args.rounds, pace / 4))
        results.append({"per": "worker call", **us})
        print(f"per worker call: off {us['off']:.1f} us CPU, on {us['on']:.1f} us", flush=True)
    print(f"spans the receiver got: {received[0]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
