"""A failed call as a structured exception: code, message and the google.rpc details, for programs.

:func:`from_rpc_error` reads the ``grpc-status-details-bin`` trailer (grpcio-status) of a
``grpc.RpcError``: BadRequest field violations and RetryInfo's delay. The exceptions are
``grpc.RpcError`` subclasses with ``code()`` and ``details()``, so code that caught
``grpc.RpcError`` before keeps working.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status

__all__ = [
    "FieldViolation",
    "SpecdecError",
    "InvalidArgument",
    "NotFound",
    "ResourceExhausted",
    "Unavailable",
    "DeadlineExceeded",
    "from_rpc_error",
]


@dataclass(frozen=True)
class FieldViolation:
    field: str  # the field's path as in the proto, e.g. "top_p" or "stop[1]"
    description: str


class SpecdecError(grpc.RpcError):
    """A call to the specdec API failed. ``field_violations`` (INVALID_ARGUMENT) and
    ``retry_delay`` (seconds; RESOURCE_EXHAUSTED, UNAVAILABLE) come from the status details."""

    def __init__(
        self,
        status_code: grpc.StatusCode,
        message: str,
        field_violations: tuple[FieldViolation, ...] = (),
        retry_delay: float | None = None,
    ) -> None:
        super().__init__(f"{status_code.name}: {message}")
        self.status_code = status_code
        self.message = message
        self.field_violations = field_violations
        self.retry_delay = retry_delay

    @property
    def field(self) -> str | None:
        """The first field at fault, if the server named one."""
        return self.field_violations[0].field if self.field_violations else None

    def code(self) -> grpc.StatusCode:
        return self.status_code

    def details(self) -> str:
        return self.message


class InvalidArgument(SpecdecError):
    pass


class NotFound(SpecdecError):
    pass


class ResourceExhausted(SpecdecError):
    pass


class Unavailable(SpecdecError):
    pass


class DeadlineExceeded(SpecdecError):
    pass


_CLASSES = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
}


def from_rpc_error(exc: grpc.RpcError) -> SpecdecError:
    """The structured exception for a failed call (a grpc.RpcError that is also a grpc.Call)."""
    if isinstance(exc, SpecdecError):
        return exc
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    message = (exc.details() if hasattr(exc, "details") else str(exc)) or ""
    violations: list[FieldViolation] = []
    delay = None
    try:
        status = rpc_status.from_call(exc) if hasattr(exc, "trailing_metadata") else None
    except ValueError:  # details inconsistent with the status: ignore them
        status = None
    for detail in status.details if status is not None else ():
        bad, retry = error_details_pb2.BadRequest(), error_details_pb2.RetryInfo()
        if detail.Unpack(bad):
            violations += [FieldViolation(v.field, v.description) for v in bad.field_violations]
        elif detail.Unpack(retry):
            delay = retry.retry_delay.ToNanoseconds() / 1e9
    return _CLASSES.get(code, SpecdecError)(code, message, tuple(violations), delay)
