"""Conversions between the core's types and the specdec.v1 worker messages.

Torch-free on purpose (the router imports it and never imports torch, docs/design.md, Rules of the
house): it only touches ``specdec.core.params`` / ``specdec.core.verify`` data classes, which import torch
lazily, and the generated stubs.

Floats travel as protobuf ``float`` (32-bit). :func:`float_from_proto` gives back the shortest
decimal that rounds to the same float32 (0.699999988 -> 0.7), so a worker sees the temperature the
user typed, exactly as the single-process engine does, and a router that decodes
``GenerateRequest`` floats with the same helper agrees with it bit for bit.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from specdec.core.params import InvalidParams, SamplingParams, VerifyMode, choose_mode
from specdec.core.round_types import Draft, SparseDist, VerifyResult
from specdec.core.token_tree import check_parents
from specdec.rpc import generate_pb2, worker_pb2

__all__ = [
    "WORKER_MAX_TOKENS",
    "WireSequence",
    "float_from_proto",
    "params_to_proto",
    "params_from_proto",
    "mode_to_proto",
    "spec_mode_to_proto",
    "spec_mode_from_proto",
    "SPEC_MODE_TO_PROTO",
    "mode_from_proto",
    "sequence_to_proto",
    "sequence_from_proto",
    "check_token_ids",
    "draft_to_proto",
    "add_verify_item",
    "draft_from_proto",
    "outcome_to_proto",
    "outcome_from_proto",
]

# Workers never decide when a request ends (the router applies max_tokens and stops), so the
# SamplingParams they rebuild carry a max_tokens that never binds.
WORKER_MAX_TOKENS = 2**31 - 1

_MODE_TO_PROTO = {
    VerifyMode.GREEDY: generate_pb2.VERIFY_MODE_GREEDY,
    VerifyMode.REJECTION: generate_pb2.VERIFY_MODE_REJECTION,
    VerifyMode.INVARIANT: generate_pb2.VERIFY_MODE_INVARIANT,
}
_MODE_FROM_PROTO = {v: k for k, v in _MODE_TO_PROTO.items()}

# The public API's speculation modes (one map: the client sends them, the router reads them).
SPEC_MODE_TO_PROTO = {
    "auto": generate_pb2.SPECULATION_MODE_AUTO,
    "off": generate_pb2.SPECULATION_MODE_OFF,
    "draft": generate_pb2.SPECULATION_MODE_DRAFT,
    "ngram": generate_pb2.SPECULATION_MODE_NGRAM,
}
_SPEC_MODE_FROM_PROTO = {v: k for k, v in SPEC_MODE_TO_PROTO.items()}


def _as_f32(x: float) -> float:
    return struct.unpack("<f", struct.pack("<f", x))[0]


def float_from_proto(x: float) -> float:
    """The shortest decimal whose float32 rounding is ``x`` (``x`` came from a proto float field)."""
    if not math.isfinite(x) or x == 0:
        return float(x)
    for digits in range(1, 10):
        y = float(f"{x:.{digits}g}")
        try:
            if _as_f32(y) == x:
                return y
        except OverflowError:  # pragma: no cover - only near float32's max
            break
    return float(x)


# ---- sampling parameters ---------------------------------------------------------------------


def params_to_proto(p: SamplingParams) -> worker_pb2.SamplingParams:
    """What a worker needs of a request's parameters (stops and max_tokens stay on the router)."""
    return worker_pb2.SamplingParams(
        temperature=float(p.temperature),
        top_p=float(p.top_p),
        top_k=int(p.top_k),
        has_seed=p.seed is not None,
        seed=int(p.seed) if p.seed is not None else 0,
    )


def params_from_proto(m: worker_pb2.SamplingParams) -> SamplingParams:
    """Rebuild and validate the parameters (raises :class:`InvalidParams` naming the field).

    ``max_tokens`` is :data:`WORKER_MAX_TOKENS` (never binding; not validated against a context).
    An unset message (all zeros) is greedy with top_p = 1.
    """
    top_p = float_from_proto(m.top_p) if m.top_p != 0 or m.temperature != 0 else 1.0
    params = SamplingParams(
        max_tokens=WORKER_MAX_TOKENS,
        temperature=float_from_proto(m.temperature),
        top_p=top_p,
        top_k=int(m.top_k),
        seed=int(m.seed) if m.has_seed else None,
    )
    params.validate()
    return params


# ---- verification mode -----------------------------------------------------------------------


def mode_to_proto(mode: VerifyMode | str | None) -> int:
    """VerifyMode (or its string value) -> the proto enum; None -> VERIFY_MODE_UNSPECIFIED."""
    if mode is None:
        return generate_pb2.VERIFY_MODE_UNSPECIFIED
    return _MODE_TO_PROTO[VerifyMode(mode)]


def mode_from_proto(value: int) -> VerifyMode | None:
    """The proto enum -> VerifyMode; UNSPECIFIED -> None (the auto rule applies)."""
    if value == generate_pb2.VERIFY_MODE_UNSPECIFIED:
        return None
    try:
        return _MODE_FROM_PROTO[value]
    except KeyError:
        raise InvalidParams("mode", f"unknown verify mode {value} (expected GREEDY, REJECTION or INVARIANT)") from None


def spec_mode_to_proto(mode: str | None) -> int:
    """ "auto" | "off" | "draft" | "ngram" -> the proto enum; None -> SPECULATION_MODE_UNSPECIFIED."""
    if mode is None:
        return generate_pb2.SPECULATION_MODE_UNSPECIFIED
    try:
        return SPEC_MODE_TO_PROTO[mode]
    except KeyError:
        raise InvalidParams(
            "speculation.mode", f"must be one of {', '.join(SPEC_MODE_TO_PROTO)} (got {mode!r})"
        ) from None


def spec_mode_from_proto(value: int) -> str:
    """The proto enum -> "auto" | "off" | "draft" | "ngram" (UNSPECIFIED means "auto")."""
    if value == generate_pb2.SPECULATION_MODE_UNSPECIFIED:
        return "auto"
    try:
        return _SPEC_MODE_FROM_PROTO[value]
    except KeyError:
        raise InvalidParams(
            "speculation.mode", f"unknown speculation mode {value} (expected OFF, DRAFT, NGRAM or AUTO)"
        ) from None


# ---- sequences -------------------------------------------------------------------------------


@dataclass
class WireSequence:
    """A decoded ``worker_pb2.Sequence`` with its mode resolved (never None)."""

    request_id: str
    tokens: list[int]
    params: SamplingParams
    mode: VerifyMode
    k: int


def sequence_to_proto(
    request_id: str, tokens: Sequence[int], params: SamplingParams, mode: VerifyMode | str | None, k: int = 0
) -> worker_pb2.Sequence:
    m = worker_pb2.Sequence()
    _fill_sequence(m, request_id, tokens, params, mode, k)
    return m


def _fill_sequence(
    m: worker_pb2.Sequence,
    request_id: str,
    tokens: Sequence[int],
    params: SamplingParams,
    mode: VerifyMode | str | None,
    k: int = 0,
) -> None:
    m.request_id = request_id
    m.tokens.extend(tokens)
    m.params.CopyFrom(params_to_proto(params))
    m.mode = mode_to_proto(mode)
    m.k = int(k)


def add_verify_item(
    request: worker_pb2.VerifyRequest,
    request_id: str,
    tokens: Sequence[int],
    params: SamplingParams,
    mode: VerifyMode | str | None,
    draft: Draft,
) -> None:
    """Append one sequence and its draft to ``request`` in place. A sequence carries its whole
    context every round: built into the request once, not copied in from a message of its own."""
    item = request.items.add()
    _fill_sequence(item.sequence, request_id, tokens, params, mode)
    item.draft.CopyFrom(draft_to_proto(request_id, draft))  # k tokens: small


def check_token_ids(tokens: Iterable[int], vocab_size: int | None, field: str) -> None:
    """Raise InvalidParams naming ``field`` unless every id is in [0, vocab_size) (>= 0 when unknown)."""
    for t in tokens:
        if t < 0 or (vocab_size is not None and t >= vocab_size):
            upper = f"{vocab_size})" if vocab_size is not None else "vocab_size)"
            raise InvalidParams(field, f"token id {t} is outside the vocabulary [0, {upper}")


def sequence_from_proto(
    m: worker_pb2.Sequence, vocab_size: int | None = None, field: str = "sequences"
) -> WireSequence:
    """Decode and validate one sequence: non-empty id and tokens, ids in range, params, mode, k >= 0.

    The mode is resolved with the public rule (:func:`specdec.core.params.choose_mode`): GREEDY at
    temperature 0 whatever was asked, INVARIANT when unspecified and seeded, else REJECTION.
    """
    if not m.request_id:
        raise InvalidParams(f"{field}.request_id", "must not be empty")
    if not m.tokens:
        raise InvalidParams(f"{field}.tokens", f"request {m.request_id!r}: no tokens (send prompt + generated)")
    tokens = list(m.tokens)
    check_token_ids(tokens, vocab_size, f"{field}.tokens")
    if m.k < 0:
        raise InvalidParams(f"{field}.k", f"request {m.request_id!r}: k must be >= 0 (got {m.k})")
    params = params_from_proto(m.params)
    mode = choose_mode(params, mode_from_proto(m.mode))
    return WireSequence(m.request_id, tokens, params, mode, int(m.k))


# ---- drafts and outcomes ---------------------------------------------------------------------


def _tree_from_proto(m: worker_pb2.Draft, tokens: list[int], vocab_size: int | None, field: str) -> Draft:
    """A token tree: a parent per token, each -1 or an earlier token; scores none or one per token."""
    parents = [int(p) for p in m.parents]
    try:
        check_parents(parents, len(tokens))
    except ValueError as exc:
        raise InvalidParams(f"{field}.parents", str(exc)) from None
    scores = [float(x) for x in m.scores]
    if scores and (len(scores) != len(tokens) or not all(math.isfinite(x) and x <= 0 for x in scores)):
        raise InvalidParams(f"{field}.scores", "one log-probability (finite, <= 0) per tree token, or none")
    # A sampled tree: one q per node, its parent's (specdec/core/tree_sampling.py).
    probs = _dists_from_proto(m, tokens, vocab_size, field) if m.dists else None
    return Draft(tokens=tokens, probs=probs, parents=parents, scores=scores or None)


def draft_to_proto(request_id: str, draft: Draft) -> worker_pb2.Draft:
    dists = [worker_pb2.SparseDist(ids=list(ids), probs=list(probs)) for ids, probs in (draft.probs or [])]
    return worker_pb2.Draft(
        request_id=request_id,
        tokens=list(draft.tokens),
        dists=dists,
        parents=list(draft.parents or ()),
        scores=list(draft.scores or ()),
    )


def draft_from_proto(m: worker_pb2.Draft, vocab_size: int | None = None, field: str = "draft") -> Draft:
    """Decode and validate a draft; empty ``dists`` -> ``probs=None`` (verified as point masses)."""
    tokens = list(m.tokens)
    check_token_ids(tokens, vocab_size, f"{field}.tokens")
    if m.parents or m.scores:
        return _tree_from_proto(m, tokens, vocab_size, field)
    if not m.dists:
        return Draft(tokens=tokens, probs=None)
    return Draft(tokens=tokens, probs=_dists_from_proto(m, tokens, vocab_size, field))


def _dists_from_proto(m: worker_pb2.Draft, tokens: list[int], vocab_size: int | None, field: str) -> list[SparseDist]:
    if len(m.dists) != len(tokens):
        raise InvalidParams(
            f"{field}.dists",
            f"{len(m.dists)} distributions for {len(tokens)} draft tokens (send one per token, or none)",
        )
    probs = []
    for j, d in enumerate(m.dists):
        if len(d.ids) != len(d.probs) or not d.ids:
            raise InvalidParams(f"{field}.dists", f"position {j}: {len(d.ids)} ids but {len(d.probs)} probs")
        check_token_ids(d.ids, vocab_size, f"{field}.dists.ids")
        if not all(math.isfinite(p) and p >= 0 for p in d.probs):
            raise InvalidParams(f"{field}.dists", f"position {j}: probabilities must be finite and >= 0")
        probs.append((list(d.ids), [float(p) for p in d.probs]))
    return probs


def outcome_to_proto(request_id: str, result: VerifyResult) -> worker_pb2.VerifyOutcome:
    return worker_pb2.VerifyOutcome(
        request_id=request_id, tokens=list(result.tokens), num_accepted=int(result.num_accepted)
    )


def outcome_from_proto(m: worker_pb2.VerifyOutcome) -> VerifyResult:
    return VerifyResult(tokens=list(m.tokens), num_accepted=int(m.num_accepted))
