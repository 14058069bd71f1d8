"""Errors in OpenAI's JSON shape, ``{"error": {"message", "type", "param", "code"}}``, with their HTTP
status, mapped from the router's gRPC status and its google.rpc details (docs/design.md, The API):

INVALID_ARGUMENT, FAILED_PRECONDITION, OUT_OF_RANGE 400 (``param`` from the BadRequest field);
UNAUTHENTICATED 401; NOT_FOUND 404; RESOURCE_EXHAUSTED 429 and UNAVAILABLE 503 with ``Retry-After``
(and ``retry-after-ms``, which OpenAI's clients read) from RetryInfo; DEADLINE_EXCEEDED 504;
anything else 500.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import grpc

from specdec.rpc.client_errors import SpecdecError

__all__ = ["ApiError", "from_specdec_error"]


@dataclass
class ApiError(Exception):
    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    retry_after: float | None = None  # seconds
    relayed: bool = False  # the router's refusal (the router logged it), not the gateway's own

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        if self.retry_after is None:
            return {}
        return {
            "retry-after": str(max(1, math.ceil(self.retry_after))),
            "retry-after-ms": str(round(self.retry_after * 1000)),
        }


# gRPC code -> (HTTP status, OpenAI error type, code)
_BY_CODE: dict[grpc.StatusCode, tuple[int, str, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error", "invalid_value"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error", "failed_precondition"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error", "out_of_range"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error", "invalid_api_key"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error", "permission_denied"),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error", "model_not_found"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error", "rate_limit_exceeded"),
    grpc.StatusCode.CANCELLED: (499, "server_error", "cancelled"),
    grpc.StatusCode.UNAVAILABLE: (503, "server_error", "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "server_error", "timeout"),
}

# The router names gRPC fields; an HTTP caller named the OpenAI ones.
_PARAMS = {"prompt_token_ids": "prompt", "request_id": "x-request-id", "chat": "messages"}


def http_param(field: str | None, renames: dict[str, str] | None = None) -> str | None:
    """The OpenAI parameter for a gRPC field path (``stop[2]`` stays; ``prompt_token_ids`` is ``prompt``)."""
    if field is None:
        return None
    head, sep, rest = field.partition("[")
    head = (renames or {}).get(head, _PARAMS.get(head, head))
    return head + sep + rest


def from_specdec_error(exc: SpecdecError, renames: dict[str, str] | None = None) -> ApiError:
    """The HTTP error for a failed gRPC call; ``renames``: gRPC field -> the parameter this request used."""
    code = exc.code()
    status, kind, name = _BY_CODE.get(code, (500, "server_error", "internal_error"))
    param = http_param(exc.field, renames) if code is grpc.StatusCode.INVALID_ARGUMENT else None
    message = exc.details() or code.name
    if param and exc.field and param != exc.field and message.startswith(exc.field + ": "):
        message = param + ": " + message[len(exc.field) + 2 :]
    return ApiError(status, message, kind, param, name, exc.retry_delay, relayed=True)
