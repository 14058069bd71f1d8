"""The router without model files: GetTokenizer, fingerprints, refusing a drafter.

Real workers (tiny models) served in this process over real gRPC on loopback, the real router with
no local tokenizer: its text must equal the transformers tokenizer's, and a drafter whose
vocabulary differs from the target's is refused with a clear error while the service keeps
serving (fail open, same greedy output).
"""

from __future__ import annotations

import json
import shutil

import pytest
from transformers import AutoTokenizer

from draft_worker.servicer import build_draft_servicer
from router.config import RouterConfig
from router.server import RouterThread, TargetBinding
from router.tokenizer_link import drafter_mismatch
from router.workers import StaticEndpoint
from specdec.core.tokenizer_spec import export_tokenizer, vocab_fingerprint
from specdec.rpc import worker_pb2, worker_pb2_grpc
from specdec.rpc.client import SpecdecClient
from specdec.rpc.server import start_server, stop_server
from target_worker.servicer import build_target_servicer

CFG = {"dtype": "float32", "num_slots": 4, "max_len": 256, "threads": 1}


def _serve(role: str, path) -> tuple[object, str]:
    if role == "target":
        svc = build_target_servicer({"model": str(path), **CFG})
        add = worker_pb2_grpc.add_TargetServiceServicer_to_server
    else:
        svc = build_draft_servicer({"model": str(path), **CFG})
        add = worker_pb2_grpc.add_DraftServiceServicer_to_server
    server, port = start_server([(add, svc, f"specdec.v1.{role.title()}Service")])
    return server, f"127.0.0.1:{port}"


@pytest.fixture(scope="module")
def foreign_draft(tiny_paths, tmp_path_factory):
    """The tiny draft with one token renamed in its tokenizer: same size, other vocabulary."""
    path = tmp_path_factory.mktemp("foreign") / "draft"
    shutil.copytree(tiny_paths["llama-draft"], path)
    tj = json.loads((path / "tokenizer.json").read_text())
    vocab = tj["model"]["vocab"]
    tok = next(t for t, i in vocab.items() if i == 65)
    vocab["ZZ"] = vocab.pop(tok)
    (path / "tokenizer.json").write_text(json.dumps(tj))
    return path


@pytest.fixture(scope="module")
def workers(tiny_paths, foreign_draft):
    servers = {
        "target": _serve("target", tiny_paths["llama"]),
        "draft": _serve("draft", tiny_paths["llama-draft"]),
        "foreign": _serve("draft", foreign_draft),
    }
    yield {k: a for k, (_, a) in servers.items()}
    for s, _ in servers.values():
        stop_server(s, grace=0)


def test_fingerprint_is_the_vocabulary(tiny_paths, foreign_draft):
    tgt = AutoTokenizer.from_pretrained(tiny_paths["llama"])
    same = AutoTokenizer.from_pretrained(tiny_paths["llama-draft"])
    other = AutoTokenizer.from_pretrained(foreign_draft)
    fp = export_tokenizer(tgt).fingerprint
    assert fp.startswith("sha256:") and fp == export_tokenizer(same).fingerprint
    assert fp != export_tokenizer(other).fingerprint
    assert vocab_fingerprint(dict(reversed(list(tgt.get_vocab().items())))) == fp  # order does not matter
    assert drafter_mismatch(fp, "d", {"t": fp}) is None
    assert drafter_mismatch("", "ngram", {"t": fp}) is None  # n-gram: the target's own ids
    why = drafter_mismatch(export_tokenizer(other).fingerprint, "d", {"t": fp})
    assert why is not None and "draft worker d refused" in why and "target t" in why


def test_get_tokenizer_rpc(workers, tiny_paths):
    import grpc

    with grpc.insecure_channel(workers["target"]) as ch:
        stub = worker_pb2_grpc.TargetServiceStub(ch)
        resp = stub.GetTokenizer(worker_pb2.GetTokenizerRequest(), timeout=30)
        info = stub.Info(worker_pb2.InfoRequest(), timeout=30)
    tok = AutoTokenizer.from_pretrained(tiny_paths["llama"])
    assert json.loads(resp.tokenizer_json) == json.loads(tok.backend_tokenizer.to_str())
    assert resp.fingerprint == info.tokenizer_fingerprint == vocab_fingerprint(tok.get_vocab())
    assert list(resp.eos_token_ids) == [tok.eos_token_id]
    assert set(resp.special_token_ids) == set(tok.all_special_ids)


def _router(workers, draft: str) -> RouterThread:
    binding = TargetBinding(
        model="tiny",
        target=StaticEndpoint(workers["target"], name="target-0"),
        draft=StaticEndpoint(workers[draft], name=f"{draft}-0"),
        tokenizer=None,  # no model files here: the router asks the target
    )
    return RouterThread([binding], RouterConfig(port=0)).start(connect_timeout=60)


def test_router_decodes_with_the_targets_tokenizer(workers, tiny_paths):
    tok = AutoTokenizer.from_pretrained(tiny_paths["llama"])
    rt = _router(workers, "draft")
    try:
        assert rt.router.refused == {}
        with SpecdecClient(rt.address) as client:
            out = client.generate("def fib(n):", max_tokens=24, ignore_eos=True)
        assert out.stats["drafted"] > 0  # the drafter was accepted and used
        assert out.text == tok.decode(out.token_ids, skip_special_tokens=True)
    finally:
        rt.stop(grace=0)


def test_mismatched_drafter_is_refused(workers, caplog):
    good = _router(workers, "draft")
    try:
        with SpecdecClient(good.address) as client:
            ref = client.generate("hello world", max_tokens=16, ignore_eos=True)
    finally:
        good.stop(grace=0)
    rt = _router(workers, "foreign")
    try:
        assert "foreign-0" in rt.router.refused and "differs from target target-0" in rt.router.refused["foreign-0"]
        assert rt.router.pool.client("foreign-0") is None
        assert any("foreign-0 refused" in r.getMessage() for r in caplog.records)
        with SpecdecClient(rt.address) as client:
            out = client.generate("hello world", max_tokens=16, ignore_eos=True)
        assert out.token_ids == ref.token_ids  # served without it (fail open), same greedy output
    finally:
        rt.stop(grace=0)
