"""GenerateRequest -> validated parameters, or InvalidParams naming the field (INVALID_ARGUMENT).

Two steps: :func:`parse` checks what needs no model (exclusive prompt fields, ranges, enums);
:func:`finalize` checks what needs the target (token ids against the vocabulary, prompt and
max_tokens against the context) once the prompt is tokenized.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from specdec.core.params import InvalidParams, SamplingParams, VerifyMode, choose_mode
from specdec.rpc import generate_pb2
from specdec.rpc.convert import check_token_ids, float_from_proto, mode_from_proto, spec_mode_from_proto

__all__ = ["ParsedRequest", "parse", "finalize"]


@dataclass
class ParsedRequest:
    request_id: str
    model: str
    prompt: str | None
    prompt_ids: list[int] | None
    chat: bool
    max_tokens: int  # 0 = the server's default
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    spec_mode: str  # off | draft | ngram | auto
    k: int | None  # None = the server's k policy
    verify_mode: VerifyMode | None


def parse(req: generate_pb2.GenerateRequest) -> ParsedRequest:
    has_text, has_ids = bool(req.prompt), len(req.prompt_token_ids) > 0
    if has_text and has_ids:
        raise InvalidParams("prompt", "give exactly one of prompt and prompt_token_ids, not both")
    if not has_text and not has_ids:
        raise InvalidParams("prompt", "the prompt is empty: give a non-empty prompt or prompt_token_ids")
    if req.chat and has_ids:
        raise InvalidParams(
            "chat", "chat applies the template to `prompt` text; it cannot be used with prompt_token_ids"
        )
    if req.max_tokens < 0:
        raise InvalidParams("max_tokens", f"must be >= 1, or 0 for the server's default (got {req.max_tokens})")
    temperature = float_from_proto(req.temperature) if req.HasField("temperature") else 0.0
    if not math.isfinite(temperature) or temperature < 0:
        raise InvalidParams("temperature", f"must be a finite number >= 0 (got {temperature})")
    top_p = float_from_proto(req.top_p) if req.HasField("top_p") else 1.0
    if not math.isfinite(top_p) or not 0 < top_p <= 1:
        raise InvalidParams("top_p", f"must be in (0, 1] (got {top_p})")
    if req.top_k < 0:
        raise InvalidParams("top_k", f"must be >= 0, 0 = off (got {req.top_k})")
    for s in req.stop:
        if not s:
            raise InvalidParams("stop", "stop strings must be non-empty")
    spec = req.speculation
    spec_mode = spec_mode_from_proto(spec.mode)
    if spec.k < 0:
        raise InvalidParams("speculation.k", f"must be >= 0, 0 = the server's k policy (got {spec.k})")
    try:
        verify_mode = mode_from_proto(spec.verify_mode)
    except InvalidParams:
        raise InvalidParams(
            "speculation.verify_mode",
            f"unknown verify mode {spec.verify_mode} (expected GREEDY, REJECTION or INVARIANT)",
        ) from None
    return ParsedRequest(
        request_id=req.request_id,
        model=req.model,
        prompt=req.prompt if has_text else None,
        prompt_ids=list(req.prompt_token_ids) if has_ids else None,
        chat=req.chat,
        max_tokens=int(req.max_tokens),
        temperature=temperature,
        top_p=top_p,
        top_k=int(req.top_k),
        seed=int(req.seed) if req.HasField("seed") else None,
        stop=tuple(req.stop),
        stop_token_ids=tuple(int(t) for t in req.stop_token_ids),
        ignore_eos=req.ignore_eos,
        spec_mode=spec_mode,
        k=int(spec.k) if spec.k > 0 else None,
        verify_mode=verify_mode,
    )


def finalize(
    p: ParsedRequest, prompt_ids: list[int], *, vocab_size: int, max_context: int, default_max_tokens: int
) -> tuple[SamplingParams, VerifyMode]:
    """Sampling parameters and verification mode for the tokenized prompt (InvalidParams if bad)."""
    if not prompt_ids:
        raise InvalidParams("prompt", "the prompt is empty after tokenization")
    check_token_ids(prompt_ids, vocab_size, "prompt_token_ids")
    if len(prompt_ids) >= max_context:
        raise InvalidParams(
            "prompt",
            f"prompt has {len(prompt_ids)} tokens; the model's context is "
            f"{max_context} tokens, which leaves no room to generate",
        )
    max_tokens = p.max_tokens or min(default_max_tokens, max_context - len(prompt_ids))
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=p.top_k,
        seed=p.seed,
        stop=p.stop,
        stop_token_ids=p.stop_token_ids,
        ignore_eos=p.ignore_eos,
    )
    params.validate(vocab_size=vocab_size, max_context=max_context, prompt_len=len(prompt_ids))
    try:
        mode = choose_mode(params, p.verify_mode)
    except InvalidParams as exc:
        raise InvalidParams("speculation.verify_mode", exc.message) from None
    return params, mode
