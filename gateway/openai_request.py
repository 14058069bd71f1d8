"""An OpenAI request body -> a ``GenerateRequest`` for the router, or a 400 naming the parameter.

Only the shape is checked here (types, and parameters this service does not implement); every bound
is the router's, checked once for gRPC and HTTP callers alike (router/validate.py). A parameter the
service does not implement is refused, never silently ignored (docs/design.md, The API): ``n`` above
1, ``logprobs``, ``tools``, ``response_format``, penalties, ... A parameter at its neutral value
(``n: 1``, ``logprobs: false``, ``null``) is accepted, since client libraries send those.

Extensions (``extra_body`` in OpenAI's Python client): ``speculation`` ({mode, k, verify_mode} as in
the proto's SpeculationOptions), ``top_k``, ``ignore_eos``, ``stop_token_ids``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.api_error import ApiError
from specdec.rpc import generate_pb2
from specdec.rpc.client import build_request

__all__ = ["OpenAIRequest", "parse_completion", "parse_chat", "DEFAULT_TEMPERATURE"]

# OpenAI's documented default: an absent temperature samples at 1 (send 0 for greedy decoding).
DEFAULT_TEMPERATURE = 1.0
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}

# Parameters with the values that mean "off": anything else is refused.
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "n": (1,),
    "best_of": (1,),
    "echo": (False,),
    "logprobs": (False,),
    "top_logprobs": (0,),
    "suffix": ("",),
    "presence_penalty": (0, 0.0),
    "frequency_penalty": (0, 0.0),
    "logit_bias": ({},),
    "tools": ([],),
    "tool_choice": ("none",),
    "functions": ([],),
    "function_call": ("none",),
    "parallel_tool_calls": (),
    "response_format": ({"type": "text"},),
    "audio": (),
    "modalities": (["text"],),
    "prediction": (),
    "reasoning_effort": (),
    "service_tier": ("auto", "default"),
    "store": (False,),
    "metadata": ({},),
    "web_search_options": (),
}
_COMMON = {"model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "stream_options", "user"}
_EXTENSIONS = {"speculation", "top_k", "ignore_eos", "stop_token_ids"}
_COMPLETION = _COMMON | _EXTENSIONS | {"prompt"}
_CHAT = _COMMON | _EXTENSIONS | {"messages", "max_completion_tokens"}


@dataclass
class OpenAIRequest:
    request: generate_pb2.GenerateRequest
    model: str  # as asked ("" = the default)
    stream: bool
    include_usage: bool
    renames: dict[str, str]  # gRPC field -> the parameter the caller used (error messages)


def _bad(param: str, message: str, code: str = "invalid_type") -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param, code=code)


def _check_known(body: dict, allowed: set[str]) -> None:
    for key, value in body.items():
        if key in allowed or value is None:
            continue
        if key in _NEUTRAL:
            if value in _NEUTRAL[key]:
                continue
            raise _bad(key, f"not supported by this server (got {_short(value)})", "unsupported_parameter")
        raise _bad(key, "unrecognized request argument", "unknown_parameter")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _typed(body: dict, key: str, kinds: tuple[type, ...], what: str) -> Any:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) and bool not in kinds:  # JSON true is not a number here
        raise _bad(key, f"must be {what}")
    if not isinstance(value, kinds):
        raise _bad(key, f"must be {what} (got {_short(value)})")
    return value


def _is_ids(value: Any) -> bool:
    return (
        isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    )


def _stops(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return stop
    raise _bad("stop", "must be a string or a list of strings")


def _common(body: dict, *, max_tokens: int | None, max_tokens_param: str = "max_tokens") -> dict[str, Any]:
    stream_options = _typed(body, "stream_options", (dict,), "an object")
    stream = bool(_typed(body, "stream", (bool,), "true or false"))
    if stream_options is not None and not stream:
        raise _bad("stream_options", "only allowed when stream is true", "invalid_value")
    include_usage = False
    if stream_options:
        extra = set(stream_options) - {"include_usage"}
        if extra:
            raise _bad(f"stream_options.{sorted(extra)[0]}", "unrecognized", "unknown_parameter")
        include_usage = bool(_typed(stream_options, "include_usage", (bool,), "true or false"))
    model = _typed(body, "model", (str,), "a string") or ""
    _typed(body, "user", (str,), "a string")  # accepted; not used (never logged: it may identify a person)
    temperature = _typed(body, "temperature", (int, float), "a number")
    seed = _typed(body, "seed", (int,), "an integer")
    if seed is not None and not 0 <= seed < 2**64:
        raise _bad("seed", f"must be in [0, 2^64) (got {seed})", "invalid_value")
    spec = _typed(body, "speculation", (dict,), "an object") or {}
    unknown = set(spec) - {"mode", "k", "verify_mode"}
    if unknown:
        raise _bad(f"speculation.{sorted(unknown)[0]}", "unrecognized (mode, k, verify_mode)", "unknown_parameter")
    stop_token_ids = body.get("stop_token_ids") or []
    if stop_token_ids and not _is_ids(stop_token_ids):
        raise _bad("stop_token_ids", "must be a list of token ids")
    k = _typed(spec, "k", (int,), "an integer")
    if k is not None and not 0 <= k < 2**31:
        raise _bad("speculation.k", f"must be >= 0 (got {k})", "invalid_value")
    for key in ("mode", "verify_mode"):
        _typed(spec, key, (str,), "a string")
    top_k = _typed(body, "top_k", (int,), "an integer")
    if max_tokens is not None and not 0 < max_tokens < 2**31:
        raise _bad(max_tokens_param, f"must be >= 1 (got {max_tokens})", "invalid_value")
    return dict(
        model=model,
        stream=stream,
        include_usage=include_usage,
        kwargs=dict(
            model=model,
            max_tokens=max_tokens or 0,
            temperature=DEFAULT_TEMPERATURE if temperature is None else float(temperature),
            top_p=None if (p := _typed(body, "top_p", (int, float), "a number")) is None else float(p),
            top_k=0 if top_k is None else top_k,
            seed=seed,
            stop=_stops(body),
            stop_token_ids=stop_token_ids,
            ignore_eos=bool(_typed(body, "ignore_eos", (bool,), "true or false")),
            mode=spec.get("mode"),
            k=k or 0,
            verify_mode=spec.get("verify_mode"),
        ),
    )


def _build(common: dict, renames: dict[str, str], request_id: str, **prompt: Any) -> OpenAIRequest:
    try:
        req = build_request(**prompt, **common["kwargs"], request_id=request_id)
    except ValueError as exc:  # an unknown speculation or verify mode; a number out of its proto field's range
        message, field = str(exc), getattr(exc, "field", None)  # InvalidParams: "field: what is wrong"
        if field is None and "VerifyMode" in message:  # VerifyMode(value) refused it
            field = "speculation.verify_mode"
            message = f"{field}: {message}"
        raise ApiError(400, message, param=field, code="invalid_value") from None
    return OpenAIRequest(req, common["model"], common["stream"], common["include_usage"], renames)


def parse_completion(body: dict, request_id: str = "") -> OpenAIRequest:
    """``POST /v1/completions``: ``prompt`` is a string or a list of token ids (one prompt)."""
    _check_known(body, _COMPLETION)
    max_tokens = _typed(body, "max_tokens", (int,), "an integer")
    common = _common(body, max_tokens=max_tokens)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and (isinstance(prompt[0], str) or _is_ids(prompt[0])):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str) and prompt:
        return _build(common, {}, request_id, prompt=prompt)
    if _is_ids(prompt):
        return _build(common, {"prompt_token_ids": "prompt"}, request_id, prompt_token_ids=prompt)
    if isinstance(prompt, list) and len(prompt) > 1:
        raise _bad("prompt", "one prompt per request (a batch of prompts is not supported)", "unsupported_value")
    raise _bad("prompt", "must be a non-empty string or a list of token ids")


def _content(message: dict, i: int) -> str:
    content = message.get("content")
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):  # content parts: text only
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise _bad(f"messages[{i}].content[{j}]", "only text parts are supported", "unsupported_value")
            texts.append(part["text"])
        return "".join(texts)
    raise _bad(f"messages[{i}].content", "must be a string or a list of text parts")


def parse_chat(body: dict, request_id: str = "") -> OpenAIRequest:
    """``POST /v1/chat/completions``: ``messages`` (system, user, assistant) through the chat template."""
    _check_known(body, _CHAT)
    max_tokens = _typed(body, "max_tokens", (int,), "an integer")
    max_completion = _typed(body, "max_completion_tokens", (int,), "an integer")
    if max_tokens is not None and max_completion is not None and max_tokens != max_completion:
        raise _bad("max_tokens", "give max_completion_tokens or max_tokens, not both", "invalid_value")
    renames = {"max_tokens": "max_completion_tokens"} if max_completion is not None else {}
    if max_completion is not None:
        common = _common(body, max_tokens=max_completion, max_tokens_param="max_completion_tokens")
    else:
        common = _common(body, max_tokens=max_tokens)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "must be a non-empty list of messages")
    turns = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise _bad(f"messages[{i}]", "must be an object with role and content")
        role = m.get("role")
        if role not in ROLES:
            raise _bad(
                f"messages[{i}].role", f"must be system, user or assistant (got {_short(role)})", "unsupported_value"
            )
        for key in m:
            if key not in ("role", "content", "name") and m[key] is not None:
                raise _bad(f"messages[{i}].{key}", "not supported by this server", "unsupported_parameter")
        turns.append((ROLES[role], _content(m, i)))
    return _build(common, renames, request_id, messages=turns)
