"""The worker side without Ray: the proto conversions the router and the
workers share (torch-free), the error-to-status mapping, the asyncio gRPC server the router uses
(health, reflection, errors from coroutines, listed by the real grpcurl), and the workers'
entry points started by hand (``python -m draft_worker``, ``python -m target_worker``), and a router
whose only target worker is gone for good."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.core.params import SamplingParams, VerifyMode
from specdec.core.round_types import Draft
from specdec.rpc import generate_pb2, worker_pb2, worker_pb2_grpc
from specdec.rpc.client import SpecdecClient
from specdec.rpc.convert import (
    draft_from_proto,
    draft_to_proto,
    float_from_proto,
    mode_from_proto,
    mode_to_proto,
    outcome_from_proto,
    params_from_proto,
    params_to_proto,
    sequence_to_proto,
)
from specdec.rpc.worker_secret import worker_channel
from tests.grpc_helpers import run_grpcurl

REPO = Path(__file__).resolve().parents[2]


# ---- rpc helpers (no Ray) ----------------------------------------------------------------------


def test_convert_roundtrip_and_torch_free():
    p = SamplingParams(temperature=0.7, top_p=0.9, top_k=5, seed=0)
    back = params_from_proto(worker_pb2.SamplingParams.FromString(params_to_proto(p).SerializeToString()))
    assert (back.temperature, back.top_p, back.top_k, back.seed) == (0.7, 0.9, 5, 0)  # float32 undone
    assert params_from_proto(params_to_proto(SamplingParams())).seed is None
    assert float_from_proto(0.30000001192092896) == 0.3
    for mode in VerifyMode:
        assert mode_from_proto(mode_to_proto(mode)) is mode
    assert mode_from_proto(generate_pb2.VERIFY_MODE_UNSPECIFIED) is None
    d = Draft(tokens=[5, 7], probs=[([5, 6], [0.75, 0.25]), ([7], [1.0])])
    assert draft_from_proto(draft_to_proto("r", d)) == d
    assert draft_from_proto(draft_to_proto("r", Draft(tokens=[3], probs=None))).probs is None
    assert outcome_from_proto(worker_pb2.VerifyOutcome(tokens=[1, 2], num_accepted=1)).num_accepted == 1
    # The router imports these: none of them may pull in torch (or Ray).
    code = (
        "import sys, specdec.rpc.convert, specdec.rpc.server, specdec.rpc.worker_host, draft_worker, target_worker;"
        "print('torch' in sys.modules, 'ray' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert out.stdout.split() == ["False", "False"], out.stderr


def test_status_mapping():
    from specdec.core.models import ModelLoadError
    from specdec.core.params import InvalidParams
    from specdec.core.runner import ContextFull, SlotsExhausted
    from specdec.rpc.errors import status_for

    C = grpc.StatusCode
    assert status_for(InvalidParams("top_p", "must be in (0, 1]")) == (C.INVALID_ARGUMENT, "top_p: must be in (0, 1]")
    assert status_for(SlotsExhausted("full"))[0] is C.RESOURCE_EXHAUSTED
    assert status_for(ContextFull("long"))[0] is C.OUT_OF_RANGE
    assert status_for(ModelLoadError("nope"))[0] is C.FAILED_PRECONDITION
    code, msg = status_for(KeyError("boom\nTraceback (most recent call last): ..."))
    assert code is C.INTERNAL and "\n" not in msg and "Traceback" not in msg


def test_aio_server_and_async_errors():
    """start_aio_server (what the router uses): health, reflection, and rpc_method on coroutines."""
    import asyncio

    from specdec.core.params import InvalidParams
    from specdec.rpc.errors import rpc_method
    from specdec.rpc.server import start_aio_server

    class Draft(worker_pb2_grpc.DraftServiceServicer):
        @rpc_method
        async def Info(self, request, context):
            return worker_pb2.WorkerInfo(model="aio", role="draft")

        @rpc_method
        async def Propose(self, request, context):
            raise InvalidParams("sequences", "nothing to see")

    async def main():
        name = worker_pb2.DESCRIPTOR.services_by_name["DraftService"].full_name
        server, port = await start_aio_server([(worker_pb2_grpc.add_DraftServiceServicer_to_server, Draft(), name)])
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                health = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=name))
                assert health.status == health_pb2.HealthCheckResponse.SERVING
                stub = worker_pb2_grpc.DraftServiceStub(ch)
                assert (await stub.Info(worker_pb2.InfoRequest())).model == "aio"
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.Propose(worker_pb2.ProposeRequest())
                assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
                assert err.value.details() == "sequences: nothing to see"
            listed = await asyncio.to_thread(run_grpcurl, "-plaintext", f"127.0.0.1:{port}", "list")
            assert name in listed.stdout.split() and "grpc.health.v1.Health" in listed.stdout.split()
        finally:
            await server.stop(None)

    asyncio.run(main())


# ---- entry points without Ray ------------------------------------------------------------------


def test_draft_worker_by_hand_ngram():
    """`python -m draft_worker --model ngram` serves DraftService without Ray."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "draft_worker", "--model", "ngram", "--port", "0"],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        assert "serving ngram on" in line, (line, proc.stderr.read() if proc.poll() is not None else "")
        address = line.split()[-1]
        with worker_channel(address) as channel:
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            stub = worker_pb2_grpc.DraftServiceStub(channel)
            tokens = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]
            seq = sequence_to_proto("ng", tokens, SamplingParams(), None, k=3)
            (draft,) = stub.Propose(worker_pb2.ProposeRequest(sequences=[seq]), timeout=10).drafts
            assert list(draft.tokens) == [3, 4, 1]
            assert stub.Info(worker_pb2.InfoRequest(), timeout=10).model == "ngram"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_target_worker_by_hand_bad_model():
    """A model that cannot be loaded: one readable line and exit status 2, no traceback."""
    out = subprocess.run(
        [sys.executable, "-m", "target_worker", "--model", "/nonexistent/model.gguf"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, out.stderr
    assert "no such file" in out.stderr and "Traceback" not in out.stderr


def test_no_target_worker_is_unavailable(tiny_paths):
    """A target that is gone and does not come back: requests get UNAVAILABLE, not a hang."""
    from router.config import RouterConfig
    from router.server import RouterThread, TargetBinding
    from router.workers import StaticEndpoint
    from target_worker.actor import TargetWorker

    worker = TargetWorker({"model": str(tiny_paths["llama"]), "num_slots": 2, "max_len": 256, "threads": 1})
    binding = TargetBinding("t", StaticEndpoint(worker.address()), tokenizer=str(tiny_paths["llama"]))
    router = RouterThread([binding], RouterConfig(port=0, metrics_port=None, recovery_timeout_s=1.0)).start(60)
    try:
        client = SpecdecClient(router.address)
        assert client.generate("x", max_tokens=3, timeout=30).usage["completion_tokens"] == 3
        worker.shutdown(grace=0)
        for kwargs in (dict(prompt_token_ids=[1, 2, 3]), dict(prompt="abc")):
            with pytest.raises(grpc.RpcError) as err:
                client.generate(max_tokens=3, timeout=30, **kwargs)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
            assert err.value.retry_delay is not None and err.value.retry_delay >= 1.0  # RetryInfo
        assert client.list_models()[0]["ready"] is False
        client.close()
    finally:
        router.stop(grace=0)
