"""One access-log line per finished request, on its own logger (``specdec.access``).

Fields: rpc, request_id, model, status (the gRPC code name, OK on success), finish_reason,
prompt_tokens, completion_tokens, ttft_ms, total_ms, acceptance_rate, peer. Never the prompt or
the completion text. The line reads ``key=value ...``; the record also carries the fields as a
dict (``record.access``), which ``specdec serve --log-format json`` writes as a JSON object
(specdec/core/log_format.py, shared with the HTTP gateway's own refusals).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from router import clock
from specdec.core.log_format import ACCESS_LOGGER, log_access

__all__ = ["ACCESS_LOGGER", "AccessRecord"]


@dataclass
class AccessRecord:
    """Filled in while a request is served; :meth:`emit` writes its line once."""

    rpc: str
    peer: str
    t_start: float = field(default_factory=clock.now)
    request_id: str = ""
    model: str = ""
    status: str = "OK"
    finish_reason: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    t_first: float | None = None  # the router clock (router/clock.py) at the first token
    acceptance_rate: float | None = None
    _emitted: bool = False

    def fields(self, now: float | None = None) -> dict[str, Any]:
        now = clock.now() if now is None else now
        return {
            "rpc": self.rpc,
            "request_id": self.request_id or None,
            "model": self.model or None,
            "status": self.status,
            "finish_reason": self.finish_reason or None,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "ttft_ms": round((self.t_first - self.t_start) * 1000, 1) if self.t_first is not None else None,
            "total_ms": round((now - self.t_start) * 1000, 1),
            "acceptance_rate": round(self.acceptance_rate, 4) if self.acceptance_rate is not None else None,
            "peer": self.peer or None,
        }

    def emit(self) -> None:
        if self._emitted:
            return
        self._emitted = True
        log_access(self.fields())
