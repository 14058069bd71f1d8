"""The OpenAI response objects: a whole completion, the streamed chunks, usage, model listing.

Every object carries ``id``, ``created``, ``model`` and ``system_fingerprint``. A stream sends one
chunk per speculation round's committed tokens (the router's GenerateChunk): the role in the first
chunk, ``finish_reason`` in the last, then, when asked, a chunk with ``usage`` and no choices.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from specdec.rpc.client import GenerateResult, StreamChunk

__all__ = ["Reply", "usage", "sse", "DONE", "models_list"]

DONE = b"data: [DONE]\n\n"


def sse(obj: dict) -> bytes:
    """One server-sent event: ``data: <json>`` and a blank line."""
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def usage(counts: dict[str, int]) -> dict[str, int]:
    p, c = counts["prompt_tokens"], counts["completion_tokens"]
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


@dataclass
class Reply:
    """The fields every object of one request shares; ``chat``: chat.completion vs text_completion."""

    chat: bool
    request_id: str
    model: str
    system_fingerprint: str
    created: int = field(default_factory=lambda: int(time.time()))
    _first: bool = True

    @property
    def id(self) -> str:
        return ("chatcmpl-" if self.chat else "cmpl-") + self.request_id

    def _head(self, obj: str) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.system_fingerprint,
        }

    def whole(self, out: GenerateResult) -> dict[str, Any]:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": out.text}}
        else:
            choice = {"index": 0, "text": out.text}
        choice.update(logprobs=None, finish_reason=out.finish_reason)
        return {
            **self._head("chat.completion" if self.chat else "text_completion"),
            "choices": [choice],
            "usage": usage(out.usage),
        }

    def chunk(self, c: StreamChunk, include_usage: bool) -> dict[str, Any]:
        if self.chat:
            delta = {"role": "assistant", "content": c.text} if self._first else {"content": c.text}
            choice = {"index": 0, "delta": delta}
        else:
            choice = {"index": 0, "text": c.text}
        self._first = False
        choice.update(logprobs=None, finish_reason=c.finish_reason)
        obj = {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [choice]}
        if include_usage:
            obj["usage"] = None  # OpenAI: null on every chunk but the usage chunk
        return obj

    def usage_chunk(self, counts: dict[str, int]) -> dict[str, Any]:
        return {
            **self._head("chat.completion.chunk" if self.chat else "text_completion"),
            "choices": [],
            "usage": usage(counts),
        }


def models_list(models: list[dict[str, Any]], created: int) -> dict[str, Any]:
    """``GET /v1/models``: the target models (the names requests take); drafts are internal."""
    data = [
        {"id": m["name"], "object": "model", "created": created, "owned_by": "specdec"}
        for m in models
        if m["role"] == "target"
    ]
    return {"object": "list", "data": data}
