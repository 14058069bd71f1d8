"""The access line of a request the gateway refuses itself, before the router sees it (bad JSON, a
parameter this service does not implement, an unknown route): the router writes the line of every
request that reaches it, so these would otherwise leave no trace.

The line is the router's (router/access_log.py, the same formatting: specdec/core/log_format.py) with
the same fields, ``rpc`` being the HTTP method and path and ``status`` the gRPC code the refusal
stands for (so one query counts refusals over both logs), plus ``http_status`` and ``error_code``
(the OpenAI error's ``code``).
"""

from __future__ import annotations

import time
from typing import Any

from specdec.core.log_format import log_access

__all__ = ["log_refusal", "GRPC_STATUS"]

# The HTTP statuses the gateway itself answers with, as the gRPC code the router would have named.
GRPC_STATUS = {
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    404: "NOT_FOUND",
    405: "UNIMPLEMENTED",
    413: "RESOURCE_EXHAUSTED",
    415: "INVALID_ARGUMENT",
}


def _peer(scope: dict[str, Any]) -> str | None:
    """``ipv4:HOST:PORT`` / ``ipv6:[HOST]:PORT``, as gRPC names the router's peers."""
    client = scope.get("client")
    if not client:
        return None
    host, port = client
    return f"ipv6:[{host}]:{port}" if ":" in host else f"ipv4:{host}:{port}"


def log_refusal(
    scope: dict[str, Any], t_arrive: float, http_status: int, error_code: str | None, request_id: str
) -> None:
    log_access(
        {
            "rpc": f"{scope.get('method', '')} {scope.get('path', '')}",
            "request_id": request_id or None,
            "model": None,
            "status": GRPC_STATUS.get(http_status, "UNKNOWN"),
            "finish_reason": None,
            "prompt_tokens": 0,
            "completion_tokens": 0,
            "ttft_ms": None,
            "total_ms": round((time.perf_counter() - t_arrive) * 1000, 1),
            "acceptance_rate": None,
            "peer": _peer(scope),
            "http_status": http_status,
            "error_code": error_code,
        }
    )
