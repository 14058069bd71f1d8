"""specdec.v1.TargetService over a TargetVerifier: Prefill, Verify, Release, Tokenize, Info, GetTokenizer.

The servicer is a thin shell: it decodes and validates the messages (bad input is refused before
the model is touched, so a bad item never leaves a batch half done; so is work no router round
asks for: more sequences than KV slots, a draft longer than ``max_k``, more tokens than the
context: INVALID_ARGUMENT), holds one lock around the
runner (the gRPC thread pool calls concurrently), and lets the core do the work. Caches are keyed
by request id and rebuilt from the committed tokens in every call (docs/design.md, invariant 1).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Iterable

import grpc

from specdec.core.params import InvalidParams
from specdec.core.prompts import encode_messages, encode_prompt
from specdec.core.runner import SlotsExhausted
from specdec.core.target import TargetVerifier, VerifyItem
from specdec.core.tokenizer_spec import TokenizerSpec, export_tokenizer
from specdec.core.torch_thread import on_torch_thread
from specdec.rpc import worker_pb2, worker_pb2_grpc
from specdec.rpc.convert import WireSequence, draft_from_proto, outcome_to_proto, sequence_from_proto
from specdec.rpc.errors import RpcStatusError, rpc_method
from specdec.rpc.placement import device_placement
from specdec.rpc.telemetry import WorkerMeter, report_compute
from specdec.rpc.worker_config import WorkerConfig

log = logging.getLogger(__name__)

# Nodes of one token tree (a forward's rows): sparse trees of this size beat larger dense ones
# (Medusa); the router sends far fewer on a CPU (specdec/core/tree_size.py).
MAX_TREE_NODES = 64
SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["TargetService"].full_name

__all__ = ["SERVICE_NAME", "TargetServicer", "build_target_servicer", "target_servicer"]


def _unique_ids(ids: Iterable[str], field: str) -> None:
    seen: set[str] = set()
    for rid in ids:
        if rid in seen:
            raise InvalidParams(field, f"request id {rid!r} appears twice in one call")
        seen.add(rid)


class TargetServicer(worker_pb2_grpc.TargetServiceServicer):
    def __init__(
        self,
        verifier: TargetVerifier,
        tokenizer,
        *,
        model_name: str,
        dtype: str,
        device: str,
        eos_token_ids: Iterable[int] = (),
        max_k: int = 16,
    ):
        self.verifier = verifier
        self.max_k = max_k
        self.runner = verifier.runner
        self.tokenizer = tokenizer
        self.model_name, self.dtype, self.device = model_name, dtype, device
        self.placement = device_placement(device)  # the router compares draft and target's
        self.instance = uuid.uuid4().hex  # WorkerInfo.instance: a new one, no caches
        self.eos_token_ids = sorted(int(t) for t in eos_token_ids)
        self._tok_lock = threading.Lock()  # fast tokenizers are not safe to share across threads
        self.meter = WorkerMeter()  # busy time and telemetry (specdec.rpc.worker_host sets it up)
        self._tok_spec: TokenizerSpec | None = None

    @property
    def tokenizer_spec(self) -> TokenizerSpec:
        if self._tok_spec is None:  # exported once: the tokenizer never changes
            with self._tok_lock:
                self._tok_spec = export_tokenizer(self.tokenizer, self.eos_token_ids)
        return self._tok_spec

    # ---- helpers -----------------------------------------------------------------------------
    def _check_context(self, seq: WireSequence, extra: int, field: str) -> None:
        need = len(seq.tokens) + extra
        if need > self.runner.max_len:
            what = f"{len(seq.tokens)} tokens" + (f" + {extra} draft tokens" if extra else "")
            raise InvalidParams(
                field,
                f"request {seq.request_id!r} has {what}, more than the target's context "
                f"of {self.runner.max_len} tokens",
            )

    def _check_batch(self, n: int, field: str) -> None:
        if n > self.runner.num_slots:
            raise InvalidParams(field, f"{n} sequences in one call; this worker has {self.runner.num_slots} KV slots")

    def _check_capacity(self, ids: list[str]) -> None:
        """Refuse the whole call up front when its new requests do not fit (free + idle slots)."""
        new, fits = self.verifier.capacity_for(ids)
        if new > fits:
            raise SlotsExhausted(
                f"{new} new sequence(s) but only {fits} of {self.runner.num_slots} KV slots can be used on "
                "this target worker; release finished requests or retry later"
            )

    def info_dict(self) -> dict:
        return {
            "model": self.model_name,
            "role": "target",
            "dtype": self.dtype,
            "device": self.device,
            "max_context": self.runner.max_len,
            "vocab_size": self.runner.vocab_size,
            "num_slots": self.runner.num_slots,
            "free_slots": self.verifier.free_slots,
            "eos_token_ids": list(self.eos_token_ids),
            "has_chat_template": bool(getattr(self.tokenizer, "chat_template", None)),
            "tokenizer_fingerprint": self.tokenizer_spec.fingerprint,
            "placement": self.placement,
            "evicted": self.verifier.slots.evicted,
            "instance": self.instance,
            "captured": self.runner.capture_summary(),
        }

    # ---- RPCs --------------------------------------------------------------------------------
    def _chunks(self, wire: Iterable[worker_pb2.Sequence], field: str) -> list[WireSequence]:
        """Prompt chunks to cache (Prefill's sequences, Verify's prefill), checked."""
        vocab = self.runner.vocab_size
        seqs = [sequence_from_proto(s, vocab, field) for s in wire]
        for s in seqs:
            self._check_context(s, 0, f"{field}.tokens")
        return seqs

    @rpc_method
    def Prefill(self, request: worker_pb2.PrefillRequest, context) -> worker_pb2.PrefillResponse:
        self._check_batch(len(request.sequences), "sequences")
        seqs = self._chunks(request.sequences, "sequences")
        _unique_ids((s.request_id for s in seqs), "sequences.request_id")
        if not seqs:
            return worker_pb2.PrefillResponse()

        def prefill() -> tuple[list[int], float]:
            t0 = time.perf_counter()  # before the meter: an emulated slower device (its delay) computes too
            with self.meter.compute():
                self._check_capacity([s.request_id for s in seqs])
                self.verifier.prefill([(s.request_id, s.tokens, s.params) for s in seqs])
                return [self.runner.lengths[self.verifier.slots[s.request_id]] for s in seqs], time.perf_counter() - t0

        cached, seconds = on_torch_thread(prefill)  # one model, one forward at a time, on one thread
        report_compute(context, seconds)
        return worker_pb2.PrefillResponse(
            outcomes=[worker_pb2.PrefillOutcome(request_id=s.request_id, cached_tokens=n) for s, n in zip(seqs, cached)]
        )

    @rpc_method
    def Verify(self, request: worker_pb2.VerifyRequest, context) -> worker_pb2.VerifyResponse:
        self._check_batch(len(request.items) + len(request.prefill), "items")
        vocab = self.runner.vocab_size
        items = []
        for item in request.items:
            most = MAX_TREE_NODES if item.draft.parents else self.max_k
            if len(item.draft.tokens) > most:
                n = len(item.draft.tokens)
                raise InvalidParams("items.draft.tokens", f"{n} draft tokens; this worker takes at most {most}")
            seq = sequence_from_proto(item.sequence, vocab, "items.sequence")
            if item.draft.request_id and item.draft.request_id != seq.request_id:
                raise InvalidParams(
                    "items.draft.request_id",
                    f"draft for {item.draft.request_id!r} sent with sequence {seq.request_id!r}",
                )
            draft = draft_from_proto(item.draft, vocab, "items.draft")
            if draft.depth > self.max_k:
                raise InvalidParams(
                    "items.draft.parents", f"a tree {draft.depth} deep; this worker takes at most {self.max_k}"
                )
            self._check_context(seq, len(draft.tokens), "items")  # a tree's nodes are stored one after another
            items.append(VerifyItem(seq.request_id, seq.tokens, seq.params, seq.mode, draft))
        _unique_ids((i.request_id for i in items), "items.sequence.request_id")
        chunks = self._chunks(request.prefill, "prefill")
        ids = [c.request_id for c in chunks] + [i.request_id for i in items]
        _unique_ids(ids, "prefill.request_id")  # a request's chunk and its verify in one call
        if not ids:
            return worker_pb2.VerifyResponse()

        def verify() -> tuple[list, float]:
            t0 = time.perf_counter()  # as in Prefill
            with self.meter.compute():
                self._check_capacity(ids)
                return self.verifier.verify(items, [(c.request_id, c.tokens, c.params) for c in chunks]), (
                    time.perf_counter() - t0
                )

        results, seconds = on_torch_thread(verify)
        report_compute(context, seconds)
        return worker_pb2.VerifyResponse(outcomes=[outcome_to_proto(i.request_id, r) for i, r in zip(items, results)])

    @rpc_method
    def Release(self, request: worker_pb2.ReleaseRequest, context) -> worker_pb2.ReleaseResponse:
        def release() -> int:
            held = [rid for rid in request.request_ids if self.verifier.has(rid)]
            for rid in held:
                self.verifier.release(rid)
            return len(held)

        return worker_pb2.ReleaseResponse(released=on_torch_thread(release))

    @rpc_method
    def Tokenize(self, request: worker_pb2.TokenizeTextRequest, context) -> worker_pb2.TokenizeTextResponse:
        if (request.chat or request.messages) and not getattr(self.tokenizer, "chat_template", None):
            field = "messages" if request.messages else "chat"
            raise RpcStatusError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{field}: model {self.model_name!r} has no chat template; send a formatted prompt with chat=false",
            )
        with self._tok_lock:
            if request.messages:
                ids = encode_messages(self.tokenizer, [(m.role, m.content) for m in request.messages])
            else:
                ids = encode_prompt(self.tokenizer, request.text, request.chat)
        return worker_pb2.TokenizeTextResponse(token_ids=[int(t) for t in ids])

    @rpc_method
    def Info(self, request: worker_pb2.InfoRequest, context) -> worker_pb2.WorkerInfo:
        return worker_pb2.WorkerInfo(**self.info_dict(), telemetry=self.meter.telemetry())

    @rpc_method
    def GetTokenizer(self, request: worker_pb2.GetTokenizerRequest, context) -> worker_pb2.GetTokenizerResponse:
        spec = self.tokenizer_spec
        return worker_pb2.GetTokenizerResponse(
            tokenizer_json=spec.tokenizer_json,
            chat_template=spec.chat_template,
            special_token_ids=spec.special_token_ids,
            eos_token_ids=spec.eos_token_ids,
            fingerprint=spec.fingerprint,
            clean_up_tokenization_spaces=spec.clean_up_tokenization_spaces,
        )


def build_target_servicer(config: WorkerConfig | dict) -> TargetServicer:
    """Load the model named in ``config`` and wrap it in a TargetServicer (empty caches)."""
    import torch

    from specdec.core.models import load_model
    from specdec.core.runner import ModelRunner

    cfg = WorkerConfig.from_dict(config)
    if cfg.model.lower() == "ngram":
        raise ValueError("worker config 'model': a target worker needs a model, not 'ngram'")

    def build() -> TargetServicer:  # on the thread that will run the forwards (specdec/core/torch_thread.py)
        if cfg.threads is not None:
            torch.set_num_threads(cfg.threads)
        loaded = load_model(cfg.model, dtype=cfg.dtype, device=cfg.device)
        runner = ModelRunner(loaded.model, num_slots=cfg.num_slots, max_len=cfg.max_len)
        runner.capture()  # CUDA graphs of the static steps on a GPU; nothing elsewhere
        return target_servicer(cfg, loaded, runner)

    return on_torch_thread(build)


def target_servicer(cfg: WorkerConfig, loaded, runner) -> TargetServicer:
    """A TargetServicer over ``runner`` (a ModelRunner, or a tensor-parallel group's leader)."""
    log.info(
        "target worker: %s (%s, %s), %d slots x %d tokens",
        cfg.model,
        cfg.dtype,
        loaded.device,
        cfg.num_slots,
        cfg.max_len,
    )
    return TargetServicer(
        TargetVerifier(runner),
        loaded.tokenizer,
        model_name=cfg.model,
        dtype=cfg.dtype,
        device=loaded.device.type,
        eos_token_ids=loaded.eos_token_ids,
        max_k=cfg.max_k,
    )
