"""What the router's trace instrumentation costs per request and per round, tracing off (the default)
and on (spans batched and exported by OTLP/gRPC to an in-process receiver, tests/otlp_receiver.py).

    PYTHONPATH=. python scripts/bench_tracing.py [--batch 1,8] [--requests 2000] [--rounds 8]

It runs the router's own span code as the servicer and the scheduler do (router/traces.py: the
request span from an incoming traceparent, its job's attributes, a prefill round, then ``--rounds``
rounds with their draft_wait and verify phases and outcomes, and the per-call traceparent check and
injection of router/workers.py), for ``--batch`` requests at a time, with no model and no network in
the timed loop; the export runs in the SDK's background thread, as in the service. The figure is
the time per round (a request's start and end shared among its rounds) beside a round's own time
on the CPU service (docs/results.md); and per worker call, the workers' server-side span around a
Verify handler that does nothing. Configurations alternate, best of ``--repeat``.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
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
from tests.otlp_receiver import otlp_receiver

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


def run(batch: int, requests: int, rounds: int) -> float:
    """Seconds of instrumentation per round (requests' start and end shared among their rounds)."""
    drafts = [Draft(tokens=[5, 6, 7, 8]) for _ in range(batch)]
    outcomes = [worker_pb2.VerifyOutcome(tokens=[5, 6, 9], num_accepted=2) for _ in range(batch)]
    ctx = _CallContext(f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01")
    total = 0.0
    for _ in range(requests // batch):
        jobs = _jobs(batch)  # not timed: the router builds its jobs anyway
        recs = [AccessRecord("Generate", "bench", model="m", prompt_tokens=4) for _ in jobs]
        t0 = time.perf_counter()
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
        total += time.perf_counter() - t0
    return total / ((requests // batch) * rounds)


class _CallDetails(NamedTuple):  # what grpc hands a server interceptor
    method: str
    invocation_metadata: tuple


def run_worker_calls(calls: int) -> float:
    """Seconds per worker call of the server side (specdec/rpc/tracing.py's interceptor, installed
    only while tracing is on) around a Verify handler that does nothing."""
    request = worker_pb2.VerifyRequest(items=[worker_pb2.VerifyItem()] * 4)
    handler = grpc.unary_unary_rpc_method_handler(lambda req, ctx: req)
    metadata = (("traceparent", f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01"),)
    details = _CallDetails("/specdec.v1.TargetService/Verify", metadata)
    interceptors = tracing.server_interceptors()
    t0 = time.perf_counter()
    for _ in range(calls):
        h = handler
        for i in interceptors:  # as grpc does per call
            h = i.intercept_service(lambda d: handler, details)
        h.unary_unary(request, None)
    return (time.perf_counter() - t0) / calls


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", default="1,8", help="requests per round, comma-separated")
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=8, help="rounds per request")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--json", default=None, help="write the figures here too")
    args = p.parse_args()
    for key in [k for k in os.environ if k.startswith("OTEL_")]:  # "off" means off
        del os.environ[key]
    results = []
    with otlp_receiver() as rx:
        for batch in [int(b) for b in args.batch.split(",")]:
            best = {"off": float("inf"), "on": float("inf")}
            for _ in range(args.repeat):
                best["off"] = min(best["off"], run(batch, args.requests, args.rounds))
                with _exported_to(rx.endpoint):
                    best["on"] = min(best["on"], run(batch, args.requests, args.rounds))
            row = {"batch": batch, "off_us_per_round": best["off"] * 1e6, "on_us_per_round": best["on"] * 1e6}
            results.append(row)
            print(
                f"batch {batch}: off {row['off_us_per_round']:.2f} us/round, on {row['on_us_per_round']:.1f} us/round"
                f" ({row['on_us_per_round'] / batch:.1f} us per request-round)",
                flush=True,
            )
        best = {"off": float("inf"), "on": float("inf")}
        for _ in range(args.repeat):
            best["off"] = min(best["off"], run_worker_calls(args.requests * 4))
            with _exported_to(rx.endpoint):
                best["on"] = min(best["on"], run_worker_calls(args.requests * 4))
        row = {"worker_call": True, "off_us": best["off"] * 1e6, "on_us": best["on"] * 1e6}
        results.append(row)
        print(f"worker call (Verify handler): off {row['off_us']:.2f} us, on {row['on_us']:.1f} us", flush=True)
        print(f"spans received while on: {len(rx.spans)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
