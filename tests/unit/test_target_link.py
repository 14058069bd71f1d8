"""A round's prompt chunks ride in its Verify (router/target_link.py): one call when it succeeds; a
call that fails is split into a Prefill of the chunks and the items one by one, so a chunk the
target refuses fails only the requests whose chunks they are, and a bad item only its own request.
The target here is a stand-in worker client that refuses any call holding one given request."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import grpc
import pytest

from router.config import RouterConfig
from router.target_link import TargetLink
from specdec.core.params import SamplingParams, VerifyMode
from specdec.core.round_types import Draft
from specdec.rpc import worker_pb2
from specdec.rpc.convert import sequence_to_proto
from specdec.rpc.errors import RpcStatusError


class _Target:
    def __init__(self, refuse: str | None):
        self.name, self.restarts, self.lock = "target-0", 0, asyncio.Lock()
        self.refuse = refuse
        self.calls: list[tuple[str, list[str], list[str]]] = []  # (method, item ids, chunk ids)

    async def wait_up(self, timeout: float) -> None:
        return None

    async def call_timed(self, method: str, request, timeout: float):
        if method == "Verify":
            items, chunks = [i.sequence.request_id for i in request.items], [s.request_id for s in request.prefill]
        else:
            items, chunks = [], [s.request_id for s in request.sequences]
        self.calls.append((method, items, chunks))
        if self.refuse in items + chunks:
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.INVALID_ARGUMENT, grpc.aio.Metadata(), grpc.aio.Metadata(), f"{self.refuse} is bad"
            )
        if method == "Prefill":
            return worker_pb2.PrefillResponse(outcomes=[worker_pb2.PrefillOutcome() for _ in chunks]), 0.01
        outcomes = [worker_pb2.VerifyOutcome(request_id=rid, tokens=[5]) for rid in items]
        return worker_pb2.VerifyResponse(outcomes=outcomes), 0.01


def _verify(refuse: str | None):
    target = _Target(refuse)
    link = TargetLink("m", target, RouterConfig())
    jobs = [
        SimpleNamespace(key=k, state=SimpleNamespace(tokens=[1, 2, 3]), params=SamplingParams(), mode=VerifyMode.GREEDY)
        for k in ("a", "b")
    ]
    chunks = [sequence_to_proto(k, [4] * 129, SamplingParams(), VerifyMode.GREEDY) for k in ("c", "d")]
    out = asyncio.run(link.verify(jobs, [Draft([]), Draft([])], 0, chunks))
    return out, target.calls


def test_the_chunks_ride_in_the_verify():
    (outcomes, compute, chunks_failed), calls = _verify(None)
    assert calls == [("Verify", ["a", "b"], ["c", "d"])]
    assert [o.request_id for o in outcomes] == ["a", "b"] and compute == 0.01 and chunks_failed is None


@pytest.mark.parametrize("refuse", ["c", "b"], ids=["a chunk", "an item"])
def test_a_refused_call_is_split_into_the_chunks_and_each_item(refuse):
    (outcomes, _, chunks_failed), calls = _verify(refuse)
    assert calls == [
        ("Verify", ["a", "b"], ["c", "d"]),
        ("Prefill", [], ["c", "d"]),
        ("Verify", ["a"], []),
        ("Verify", ["b"], []),
    ]
    if refuse == "c":  # the chunks' requests fail; the items are verified
        assert isinstance(chunks_failed, RpcStatusError) and chunks_failed.code is grpc.StatusCode.INVALID_ARGUMENT
        assert [o.request_id for o in outcomes] == ["a", "b"]
    else:  # the chunks are cached; only the bad item fails
        assert chunks_failed is None
        assert outcomes[0].request_id == "a" and isinstance(outcomes[1], RpcStatusError)
