"""specdec.v1.DraftService over a drafter: Propose, Release, Info.

A thin shell over :class:`specdec.core.drafters.ModelDrafter` (a draft model on the runner) or
:class:`specdec.core.drafters.NgramProposer` (model "ngram": no model, no KV slots). Messages are
validated before the drafter runs (a ``k`` above ``max_k``, which no router round asks for, is
INVALID_ARGUMENT; sequences beyond the free slots or the context get empty drafts and cost no
forward); one lock serialises the model. The drafter keeps its caches by
request id and rebuilds them from the committed tokens in every call. When it has no free slot it
proposes nothing for that sequence (an empty draft: the round verifies with k = 0).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterable

from specdec.core.drafters import Drafter, DraftInput, ModelDrafter, propose_within_k
from specdec.core.params import InvalidParams
from specdec.core.tokenizer_spec import vocab_fingerprint
from specdec.core.torch_thread import on_torch_thread
from specdec.rpc import worker_pb2, worker_pb2_grpc
from specdec.rpc.convert import draft_to_proto, sequence_from_proto
from specdec.rpc.errors import rpc_method
from specdec.rpc.placement import device_placement
from specdec.rpc.telemetry import WorkerMeter, report_compute
from specdec.rpc.worker_config import WorkerConfig

log = logging.getLogger(__name__)

SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["DraftService"].full_name
NGRAM = "ngram"

__all__ = ["SERVICE_NAME", "NGRAM", "DraftServicer", "build_draft_servicer"]


class DraftServicer(worker_pb2_grpc.DraftServiceServicer):
    """``vocab_size`` / ``max_context`` None: no model (n-gram), ids only need to be >= 0."""

    def __init__(
        self,
        drafter: Drafter,
        *,
        model_name: str,
        dtype: str,
        device: str,
        vocab_size: int | None,
        max_context: int,
        num_slots: int,
        eos_token_ids: Iterable[int] = (),
        tokenizer_fingerprint: str = "",
        max_k: int = 16,
    ):
        self.drafter = drafter
        self.tokenizer_fingerprint = tokenizer_fingerprint  # empty: no tokenizer (n-gram)
        self.max_k = max_k
        self.runner = getattr(drafter, "runner", None)
        self.model_name, self.dtype, self.device = model_name, dtype, device
        self.placement = device_placement(device)  # the router compares draft and target's
        self.instance = uuid.uuid4().hex  # WorkerInfo.instance: a new one, no caches
        self.vocab_size, self.max_context, self.num_slots = vocab_size, max_context, num_slots
        self.eos_token_ids = sorted(int(t) for t in eos_token_ids)
        self.meter = WorkerMeter()  # busy time and telemetry (specdec.rpc.worker_host sets it up)

    @property
    def free_slots(self) -> int:
        # An n-gram drafter holds no cache: it always has room.
        return self.runner.free_slots if self.runner is not None else self.num_slots

    def _holds(self, request_id: str) -> bool:
        return request_id in getattr(self.drafter, "slots", {})

    def info_dict(self) -> dict:
        return {
            "model": self.model_name,
            "role": "draft",
            "dtype": self.dtype,
            "device": self.device,
            "max_context": self.max_context,
            "vocab_size": self.vocab_size or 0,
            "num_slots": self.num_slots,
            "free_slots": self.free_slots,
            "eos_token_ids": list(self.eos_token_ids),
            "tokenizer_fingerprint": self.tokenizer_fingerprint,
            "placement": self.placement,
            "instance": self.instance,
            "evicted": getattr(getattr(self.drafter, "slots", None), "evicted", 0),  # n-gram: no slots
            "captured": self.runner.capture_summary() if self.runner is not None else {},
        }

    def _sequences(self, protos) -> list:
        for s in protos:
            if s.k > self.max_k:
                raise InvalidParams("sequences.k", f"k = {s.k}; this worker drafts at most {self.max_k} tokens")
        seqs = [sequence_from_proto(s, self.vocab_size, "sequences") for s in protos]
        seen: set[str] = set()
        for s in seqs:
            if s.request_id in seen:
                raise InvalidParams("sequences.request_id", f"request id {s.request_id!r} appears twice in one call")
            seen.add(s.request_id)
        return seqs

    def _cached(self, request_id: str) -> int:
        """Tokens the drafter holds for a request (0 for the n-gram drafter, which caches nothing)."""
        slots = getattr(self.drafter, "slots", None)
        if slots is None or request_id not in slots:
            return 0
        return int(self.drafter.runner.lengths[slots[request_id]])

    @rpc_method
    def Propose(self, request: worker_pb2.ProposeRequest, context) -> worker_pb2.ProposeResponse:
        seqs = self._sequences(request.sequences)
        if not seqs:
            return worker_pb2.ProposeResponse()
        inputs = [DraftInput(s.request_id, s.tokens, s.params, s.mode, s.k) for s in seqs]

        def propose() -> tuple[list, float]:
            t0 = time.perf_counter()  # before the meter: an emulated slower device (its delay) computes too
            with self.meter.compute(steps=max(i.k for i in inputs)):
                return propose_within_k(self.drafter, inputs), time.perf_counter() - t0

        drafts, seconds = on_torch_thread(propose)  # one forward at a time, on one thread
        report_compute(context, seconds)
        return worker_pb2.ProposeResponse(drafts=[draft_to_proto(i.request_id, d) for i, d in zip(inputs, drafts)])

    @rpc_method
    def Prefill(self, request: worker_pb2.PrefillRequest, context) -> worker_pb2.PrefillResponse:
        seqs = self._sequences(request.sequences)
        inputs = [DraftInput(s.request_id, s.tokens, s.params, s.mode, 0) for s in seqs]

        def prefill() -> tuple[list[int], float]:
            t0 = time.perf_counter()
            with self.meter.compute(steps=0):
                self.drafter.prefill(inputs)
            return [self._cached(s.request_id) for s in seqs], time.perf_counter() - t0

        cached, seconds = on_torch_thread(prefill)
        report_compute(context, seconds)
        return worker_pb2.PrefillResponse(
            outcomes=[worker_pb2.PrefillOutcome(request_id=s.request_id, cached_tokens=n) for s, n in zip(seqs, cached)]
        )

    @rpc_method
    def Release(self, request: worker_pb2.ReleaseRequest, context) -> worker_pb2.ReleaseResponse:
        def release() -> int:
            held = [rid for rid in request.request_ids if self._holds(rid)]
            for rid in request.request_ids:
                self.drafter.release(rid)
            return len(held)

        return worker_pb2.ReleaseResponse(released=on_torch_thread(release))

    @rpc_method
    def Info(self, request: worker_pb2.InfoRequest, context) -> worker_pb2.WorkerInfo:
        return worker_pb2.WorkerInfo(**self.info_dict(), telemetry=self.meter.telemetry())


def build_draft_servicer(config: WorkerConfig | dict) -> DraftServicer:
    """A DraftServicer for ``config``: the n-gram drafter for model "ngram", else the model on a runner."""
    cfg = WorkerConfig.from_dict(config)
    if cfg.model.lower() == NGRAM:
        from specdec.core.drafters import NgramProposer

        log.info("draft worker: n-gram drafter (n %d..%d)", cfg.min_ngram, cfg.max_ngram)
        return DraftServicer(
            NgramProposer(max_ngram=cfg.max_ngram, min_ngram=cfg.min_ngram),
            model_name=NGRAM,
            dtype="",
            device="cpu",
            vocab_size=None,
            max_context=cfg.max_len,
            num_slots=cfg.num_slots,
            max_k=cfg.max_k,
        )
    return on_torch_thread(_model_servicer, cfg)  # on the thread that will run the forwards


def _model_servicer(cfg: WorkerConfig) -> DraftServicer:
    import torch

    from specdec.core.build import make_model_drafter
    from specdec.core.draft_options import draft_options_from_dict
    from specdec.core.models import load_model

    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    options = draft_options_from_dict(cfg.draft_options)
    loaded = load_model(cfg.model, dtype=cfg.dtype, device=cfg.device)
    drafter: ModelDrafter = make_model_drafter(loaded, cfg.num_slots, cfg.max_len, options)
    drafter.top_k_sent = cfg.top_k_sent
    runner = drafter.runner
    log.info(
        "draft worker: %s (%s, %s, %s), %d slots x %d tokens",
        cfg.model,
        cfg.dtype,
        loaded.device,
        options,
        cfg.num_slots,
        cfg.max_len,
    )
    return DraftServicer(
        drafter,
        model_name=cfg.model,
        dtype=cfg.dtype,
        device=loaded.device.type,
        vocab_size=runner.vocab_size,
        max_context=cfg.max_len,
        num_slots=cfg.num_slots,
        eos_token_ids=loaded.eos_token_ids,
        tokenizer_fingerprint=vocab_fingerprint(loaded.tokenizer.get_vocab()),
        max_k=cfg.max_k,
    )
