"""A worker runs all of its model work on one thread (specdec/core/torch_thread.py): what its gRPC
pool's threads ask for queues on that thread, so torch's OpenMP runtime keeps one team."""

from __future__ import annotations

import threading

import grpc
import pytest

from specdec.core.params import SamplingParams, VerifyMode
from specdec.core.torch_thread import on_torch_thread, torch_thread_ident
from specdec.rpc import worker_pb2, worker_pb2_grpc
from specdec.rpc.convert import sequence_to_proto
from specdec.rpc.server import start_server, stop_server
from target_worker.servicer import build_target_servicer


def test_calls_run_on_one_thread_in_turn_and_raise_there():
    seen = []
    threads = [threading.Thread(target=lambda: seen.append(on_torch_thread(threading.get_ident))) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert set(seen) == {torch_thread_ident()} and threading.get_ident() not in seen
    assert on_torch_thread(lambda: on_torch_thread(threading.get_ident)) == torch_thread_ident()  # re-entrant
    with pytest.raises(ZeroDivisionError):
        on_torch_thread(lambda: 1 / 0)


def _sequence(i: int) -> worker_pb2.Sequence:
    return sequence_to_proto(f"r{i}", [3 + i, 5, 7, 11, 13], SamplingParams(max_tokens=4), VerifyMode.GREEDY)


def test_a_target_worker_loads_and_computes_on_the_torch_thread_whatever_thread_calls(tiny_paths, monkeypatch):
    from specdec.core import models

    loaded_on = []
    load = models.load_model
    monkeypatch.setattr(models, "load_model", lambda *a, **k: loaded_on.append(threading.get_ident()) or load(*a, **k))
    svc = build_target_servicer({"model": str(tiny_paths["llama"]), "dtype": "float32", "num_slots": 8, "max_len": 64})
    forward_on, handled_on = [], []
    forward = svc.runner.forward
    monkeypatch.setattr(
        svc.runner, "forward", lambda *a, **k: forward_on.append(threading.get_ident()) or forward(*a, **k)
    )
    verify = svc.Verify

    def handler(request, context):
        handled_on.append(threading.get_ident())
        return verify(request, context)

    monkeypatch.setattr(svc, "Verify", handler)
    server, port = start_server(
        [(worker_pb2_grpc.add_TargetServiceServicer_to_server, svc, "specdec.v1.TargetService")], max_workers=4
    )
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = worker_pb2_grpc.TargetServiceStub(channel)
            calls = [
                stub.Verify.future(worker_pb2.VerifyRequest(items=[worker_pb2.VerifyItem(sequence=_sequence(i))]))
                for i in range(8)
            ]
            assert all(len(c.result(timeout=60).outcomes) == 1 for c in calls)
    finally:
        stop_server(server)
    assert loaded_on == [torch_thread_ident()]
    assert forward_on and set(forward_on) == {torch_thread_ident()}
    assert torch_thread_ident() not in handled_on  # the gRPC pool's threads asked; the torch thread computed
