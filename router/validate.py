"""GenerateRequest -> validated parameters, or InvalidParams naming the field (INVALID_ARGUMENT).

Three steps, each before the costlier work that follows it: :func:`check_request_id` first (the
id is echoed in every chunk and sent on every worker call); :func:`parse` checks what needs only
the model's :class:`Limits` (exclusive prompt fields, sizes, ranges, enums), before the prompt
is tokenized or queued; :func:`finalize` checks what needs the tokenized prompt (token ids
against the vocabulary, prompt and max_tokens against the context).

The bounds are documented in protos/specdec/v1/generate.proto and the README.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from specdec.core.params import InvalidParams, SamplingParams, VerifyMode, choose_mode
from specdec.rpc import generate_pb2
from specdec.rpc.convert import check_token_ids, float_from_proto, mode_from_proto, spec_mode_from_proto

__all__ = [
    "MAX_REQUEST_ID_BYTES",
    "MAX_STOP_STRINGS",
    "MAX_STOP_BYTES",
    "MAX_STOP_TOKEN_IDS",
    "MAX_MESSAGES",
    "CHAT_ROLES",
    "PROMPT_BYTES_PER_TOKEN",
    "Limits",
    "PromptInput",
    "ParsedRequest",
    "check_request_id",
    "parse_prompt",
    "parse",
    "finalize",
]

MAX_REQUEST_ID_BYTES = 256
MAX_STOP_STRINGS = 16
MAX_STOP_BYTES = 256
MAX_STOP_TOKEN_IDS = 64
MAX_MESSAGES = 256
CHAT_ROLES = ("system", "user", "assistant")
# Default prompt byte limit per token of context: far above what text takes per token (a few
# bytes), so no prompt that fits the context is refused, while a prompt that cannot fit is
# refused before it is tokenized.
PROMPT_BYTES_PER_TOKEN = 32


@dataclass(frozen=True)
class Limits:
    """The bounds a request is checked against before tokenizing, for one model."""

    max_context: int
    max_prompt_bytes: int

    @classmethod
    def for_model(cls, max_context: int, max_prompt_bytes: int = 0) -> Limits:
        """``max_prompt_bytes`` 0: :data:`PROMPT_BYTES_PER_TOKEN` per token of the context."""
        return cls(max_context, max_prompt_bytes or PROMPT_BYTES_PER_TOKEN * max_context)


@dataclass
class PromptInput:
    prompt: str | None
    prompt_ids: list[int] | None
    chat: bool
    messages: list[tuple[str, str]] | None = None  # (role, content), rendered by the chat template


def _utf8_len_over(text: str, limit: int) -> int | None:
    """The UTF-8 length of ``text`` when it is over ``limit``, else None (without encoding when
    the character count settles it: 1 to 4 bytes per character)."""
    if len(text) > limit:
        return len(text.encode("utf-8", "surrogatepass")) if len(text) <= 4 * limit else len(text)
    if 4 * len(text) <= limit:
        return None
    n = len(text.encode("utf-8", "surrogatepass"))
    return n if n > limit else None


def check_request_id(request_id: str) -> None:
    """At most :data:`MAX_REQUEST_ID_BYTES` bytes of printable ASCII; the message never echoes it."""
    if len(request_id) > MAX_REQUEST_ID_BYTES:
        n = len(request_id.encode("utf-8", "surrogatepass"))
        raise InvalidParams(
            "request_id", f"must be at most {MAX_REQUEST_ID_BYTES} bytes of printable ASCII (got {n} bytes)"
        )
    for i, ch in enumerate(request_id):
        if not " " <= ch <= "~":
            raise InvalidParams(
                "request_id",
                f"must be printable ASCII (0x20-0x7E); character {i} is U+{ord(ch):04X}",
            )


def _parse_messages(req, limits: Limits) -> list[tuple[str, str]]:
    """The conversation's (role, content) pairs; its contents together within the prompt byte limit."""
    if len(req.messages) > MAX_MESSAGES:
        raise InvalidParams("messages", f"at most {MAX_MESSAGES} messages (got {len(req.messages)})")
    out: list[tuple[str, str]] = []
    remaining = limits.max_prompt_bytes
    for i, m in enumerate(req.messages):
        role, content = m.role, m.content
        if role not in CHAT_ROLES:
            shown = role if len(role) <= 32 else role[:29] + "..."
            raise InvalidParams(f"messages[{i}].role", f"must be one of {', '.join(CHAT_ROLES)} (got {shown!r})")
        # a character is at least one byte: a content longer than what is left is over without encoding it
        remaining -= len(content) if len(content) > remaining else len(content.encode("utf-8", "surrogatepass"))
        if remaining < 0:
            raise InvalidParams(
                f"messages[{i}].content",
                f"the messages have more than {limits.max_prompt_bytes} bytes, the most this server takes "
                f"(the model's context is {limits.max_context} tokens)",
            )
        out.append((role, content))
    return out


def parse_prompt(req: generate_pb2.GenerateRequest | generate_pb2.TokenizeRequest, limits: Limits) -> PromptInput:
    """The prompt fields (shared by Generate and Tokenize), checked against the bounds."""
    text = req.prompt  # each access of a string field makes a new str: once, it may be megabytes
    has_text, has_ids, has_messages = bool(text), len(req.prompt_token_ids) > 0, len(req.messages) > 0
    if has_text and has_ids:
        raise InvalidParams("prompt", "give exactly one of prompt and prompt_token_ids, not both")
    if has_messages and (has_text or has_ids):
        raise InvalidParams("messages", "give exactly one of prompt, prompt_token_ids and messages")
    if not has_text and not has_ids and not has_messages:
        raise InvalidParams("prompt", "the prompt is empty: give a non-empty prompt, prompt_token_ids or messages")
    if req.chat and has_ids:
        raise InvalidParams(
            "chat", "chat applies the template to `prompt` text; it cannot be used with prompt_token_ids"
        )
    if has_messages:
        return PromptInput(prompt=None, prompt_ids=None, chat=True, messages=_parse_messages(req, limits))
    if has_text and (n := _utf8_len_over(text, limits.max_prompt_bytes)) is not None:
        raise InvalidParams(
            "prompt",
            f"the prompt has {n} bytes; this server takes at most {limits.max_prompt_bytes} "
            f"(the model's context is {limits.max_context} tokens)",
        )
    if has_ids and len(req.prompt_token_ids) > limits.max_context:
        raise InvalidParams(
            "prompt_token_ids",
            f"{len(req.prompt_token_ids)} ids; the model's context is {limits.max_context} tokens",
        )
    return PromptInput(
        prompt=text if has_text else None,
        prompt_ids=list(req.prompt_token_ids) if has_ids else None,
        chat=req.chat,
    )


def _check_stops(req: generate_pb2.GenerateRequest) -> None:
    if len(req.stop) > MAX_STOP_STRINGS:
        raise InvalidParams("stop", f"at most {MAX_STOP_STRINGS} stop strings (got {len(req.stop)})")
    for i, s in enumerate(req.stop):
        if not s:
            raise InvalidParams(f"stop[{i}]", "stop strings must be non-empty")
        if (n := _utf8_len_over(s, MAX_STOP_BYTES)) is not None:
            raise InvalidParams(f"stop[{i}]", f"stop strings are at most {MAX_STOP_BYTES} bytes (got {n})")
    if len(req.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidParams(
            "stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} stop token ids (got {len(req.stop_token_ids)})"
        )


@dataclass
class ParsedRequest:
    request_id: str
    model: str
    prompt: str | None
    prompt_ids: list[int] | None
    chat: bool
    messages: list[tuple[str, str]] | None  # (role, content): a conversation for the chat template
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


def parse(req: generate_pb2.GenerateRequest, limits: Limits) -> ParsedRequest:
    """Everything that can be checked before tokenizing (call :func:`check_request_id` first)."""
    prompt = parse_prompt(req, limits)
    _check_stops(req)
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
        prompt=prompt.prompt,
        prompt_ids=prompt.prompt_ids,
        chat=prompt.chat,
        messages=prompt.messages,
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
    """Sampling parameters and verification mode for the tokenized prompt (InvalidParams if bad).

    An explicit max_tokens beyond the room left in the context is refused, never lowered (the
    proto's GenerateRequest.max_tokens); 0 takes the default, lowered to that room."""
    field = "prompt" if p.prompt is not None else "messages" if p.messages is not None else "prompt_token_ids"
    if not prompt_ids:
        raise InvalidParams(field, "the prompt is empty after tokenization")
    if len(prompt_ids) >= max_context:  # before the per-id check: it is cheaper
        raise InvalidParams(
            field,
            f"prompt has {len(prompt_ids)} tokens; the model's context is "
            f"{max_context} tokens, which leaves no room to generate",
        )
    check_token_ids(prompt_ids, vocab_size, "prompt_token_ids")
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
