"""Our exceptions become gRPC status codes with a message a person can act on, never a stack trace.

This is the one place that maps exceptions to statuses. :func:`rich_status_for` maps an exception
to a :class:`RichStatus`: code, message and, for programs, ``google.rpc`` details sent in the
``grpc-status-details-bin`` trailer (grpcio-status): ``BadRequest`` field violations for
INVALID_ARGUMENT (the field's path as in the proto), ``RetryInfo`` for RESOURCE_EXHAUSTED and
UNAVAILABLE when the raiser knows a delay it can stand behind. :func:`status_for` is its
(code, message) pair; :func:`abort_with` / :func:`abort_with_async` answer an RPC with it;
:func:`rpc_method` wraps a servicer method. The trace goes to the log. Exception classes defined
in torch modules (``specdec.core.runner``, ``specdec.core.models``) are matched by class name, so
this module stays torch-free.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from google.protobuf import duration_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

log = logging.getLogger(__name__)

__all__ = [
    "RpcStatusError",
    "RichStatus",
    "rich_status_for",
    "status_for",
    "abort_with",
    "abort_with_async",
    "rpc_method",
    "remote_error_message",
]


class RpcStatusError(Exception):
    """Raise from a servicer to answer with a given status code and message.

    ``field``: the request field at fault (INVALID_ARGUMENT: a BadRequest field violation; the
    message should start with "field: "). ``retry_after``: seconds after which a retry can succeed
    (RESOURCE_EXHAUSTED / UNAVAILABLE: a RetryInfo), when the raiser can stand behind one.
    """

    def __init__(
        self, code: grpc.StatusCode, message: str, *, field: str | None = None, retry_after: float | None = None
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.field = field
        self.retry_after = retry_after

    def __reduce__(self):
        return (_rebuild, (type(self), self.code, self.message, self.field, self.retry_after))


def _rebuild(cls, code, message, field, retry_after):
    exc = RpcStatusError.__new__(cls)
    RpcStatusError.__init__(exc, code, message, field=field, retry_after=retry_after)
    return exc


@dataclass(frozen=True)
class RichStatus:
    """A status to answer with: code, message and the google.rpc details programs read."""

    code: grpc.StatusCode
    message: str
    field: str | None = None  # -> google.rpc.BadRequest.FieldViolation.field
    description: str | None = None  # -> its description (what is wrong)
    retry_after: float | None = None  # seconds -> google.rpc.RetryInfo.retry_delay

    def to_proto(self) -> status_pb2.Status:
        status = status_pb2.Status(code=self.code.value[0], message=self.message)
        if self.field is not None:
            violation = error_details_pb2.BadRequest.FieldViolation(
                field=self.field, description=self.description or self.message
            )
            status.details.add().Pack(error_details_pb2.BadRequest(field_violations=[violation]))
        if self.retry_after is not None:
            delay = duration_pb2.Duration()
            delay.FromNanoseconds(int(max(0.0, self.retry_after) * 1e9))
            status.details.add().Pack(error_details_pb2.RetryInfo(retry_delay=delay))
        return status

    def trailing_metadata(self) -> tuple[tuple[str, bytes], ...]:
        """The ``grpc-status-details-bin`` trailer (empty when there are no details)."""
        if self.field is None and self.retry_after is None:
            return ()
        return tuple(rpc_status.to_status(self.to_proto()).trailing_metadata)


# Our exceptions by class name (some live in modules that import torch; the router must not).
_CODES_BY_NAME: dict[str, grpc.StatusCode] = {
    "InvalidParams": grpc.StatusCode.INVALID_ARGUMENT,  # specdec.core.sampling
    "SlotsExhausted": grpc.StatusCode.RESOURCE_EXHAUSTED,  # specdec.core.runner
    "ContextFull": grpc.StatusCode.OUT_OF_RANGE,  # specdec.core.runner
    "ModelLoadError": grpc.StatusCode.FAILED_PRECONDITION,  # specdec.core.models
    "IncompatibleModels": grpc.StatusCode.FAILED_PRECONDITION,  # specdec.core.build
    # A tensor-parallel group lost a rank: the worker is going away and restarts (the router replays).
    "GroupFailure": grpc.StatusCode.UNAVAILABLE,  # specdec.core.lockstep
}
_MAX_MESSAGE = 500


def _short(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= _MAX_MESSAGE else text[: _MAX_MESSAGE - 3] + "..."


def rich_status_for(exc: BaseException) -> RichStatus:
    """The gRPC status for an exception raised while serving.

    InvalidParams -> INVALID_ARGUMENT ("field: what is wrong", with a BadRequest naming the field),
    SlotsExhausted -> RESOURCE_EXHAUSTED, ContextFull -> OUT_OF_RANGE, ModelLoadError /
    IncompatibleModels -> FAILED_PRECONDITION, GroupFailure -> UNAVAILABLE, TimeoutError ->
    DEADLINE_EXCEEDED, NotImplementedError -> UNIMPLEMENTED, a grpc.RpcError from a downstream call ->
    its own code and details, RpcStatusError -> its code (and its field / retry_after); anything else
    -> INTERNAL with the exception's type and first line (the worker logs the trace).
    """
    if isinstance(exc, RpcStatusError):
        message = _short(exc.message)
        description = message[len(exc.field) + 2 :] if exc.field and message.startswith(exc.field + ": ") else None
        return RichStatus(exc.code, message, exc.field, description, exc.retry_after)
    if isinstance(exc, grpc.RpcError) and hasattr(exc, "code") and hasattr(exc, "details"):
        code = exc.code()
        return RichStatus(
            code if isinstance(code, grpc.StatusCode) else grpc.StatusCode.UNKNOWN, _short(exc.details() or "")
        )
    for cls in type(exc).__mro__:
        code = _CODES_BY_NAME.get(cls.__name__)
        if code is not None and cls.__module__.startswith("specdec"):
            field = getattr(exc, "field", None) if code is grpc.StatusCode.INVALID_ARGUMENT else None
            description = getattr(exc, "message", None) if field else None
            return RichStatus(code, _short(str(exc)), field, _short(description) if description else None)
    if isinstance(exc, TimeoutError):
        return RichStatus(grpc.StatusCode.DEADLINE_EXCEEDED, _short(str(exc) or "the operation timed out"))
    if isinstance(exc, NotImplementedError):
        return RichStatus(grpc.StatusCode.UNIMPLEMENTED, _short(str(exc) or "not implemented"))
    text = exc.args[0] if len(exc.args) == 1 and isinstance(exc.args[0], str) else str(exc)
    first = text.strip().splitlines()[0] if text.strip() else ""
    return RichStatus(
        grpc.StatusCode.INTERNAL,
        _short(f"internal error ({type(exc).__name__}{': ' + first if first else ''}); see the server log"),
    )


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """:func:`rich_status_for` as (code, message)."""
    status = rich_status_for(exc)
    return status.code, status.message


def _log_failure(exc: BaseException, code: grpc.StatusCode, where: str) -> None:
    if code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN):
        log.error("%s failed", where, exc_info=exc)
    else:
        log.info("%s: %s: %s", where, code.name, exc)


def abort_with(context: grpc.ServicerContext, exc: BaseException, where: str = "rpc", quiet: bool = False) -> None:
    """Abort the RPC with :func:`rich_status_for`'s status (raises, like ``context.abort``);
    ``quiet``: the caller logged it already."""
    status = rich_status_for(exc)
    if not quiet:
        _log_failure(exc, status.code, where)
    if status.trailing_metadata():
        context.set_trailing_metadata(status.trailing_metadata())
    context.abort(status.code, status.message)


async def abort_with_async(
    context: grpc.aio.ServicerContext, exc: BaseException, where: str = "rpc", quiet: bool = False
) -> None:
    """The grpc.aio twin of :func:`abort_with`."""
    status = rich_status_for(exc)
    if not quiet:
        _log_failure(exc, status.code, where)
    await context.abort(status.code, status.message, status.trailing_metadata())


def _is_abort(exc: BaseException) -> bool:
    """The exception ``context.abort`` raised (sync servers raise a bare Exception(); aio AbortError)."""
    return type(exc) is Exception and not exc.args or isinstance(exc, grpc.aio.AbortError)


def rpc_method(fn: Callable) -> Callable:
    """Decorate a servicer method so that exceptions become a status (:func:`status_for`).

    Works for sync handlers and sync generators (grpc.server), and for coroutines and async
    generators (grpc.aio). Raise exceptions (InvalidParams, RpcStatusError, ...) inside; a
    ``context.abort`` made by the method itself passes through unchanged.
    """
    where = fn.__qualname__

    if inspect.isasyncgenfunction(fn):

        @functools.wraps(fn)
        async def agen_wrapper(self, request, context):
            try:
                async for item in fn(self, request, context):
                    yield item
            except Exception as exc:  # noqa: BLE001 - the edge: every error becomes a status
                if _is_abort(exc):
                    raise
                await abort_with_async(context, exc, where)

        return agen_wrapper

    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def coro_wrapper(self, request, context):
            try:
                return await fn(self, request, context)
            except Exception as exc:  # noqa: BLE001
                if _is_abort(exc):
                    raise
                await abort_with_async(context, exc, where)

        return coro_wrapper

    if inspect.isgeneratorfunction(fn):

        @functools.wraps(fn)
        def gen_wrapper(self, request, context):
            try:
                yield from fn(self, request, context)
            except Exception as exc:  # noqa: BLE001
                if _is_abort(exc):
                    raise
                abort_with(context, exc, where)

        return gen_wrapper

    @functools.wraps(fn)
    def wrapper(self, request, context):
        try:
            return fn(self, request, context)
        except Exception as exc:  # noqa: BLE001
            if _is_abort(exc):
                raise
            abort_with(context, exc, where)

    return wrapper


def remote_error_message(exc: BaseException) -> str:
    """One readable line for an error raised in another process (e.g. Ray's ActorDiedError, whose
    text embeds the remote traceback): the last "pkg.SomeError: message" line as
    "SomeError: message", else the first line."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    for ln in reversed(lines):
        head, sep, rest = ln.partition(": ")
        if sep and head.replace(".", "").replace("_", "").isalnum() and head.rsplit(".", 1)[-1][:1].isupper():
            return _short(f"{head.rsplit('.', 1)[-1]}: {rest}")
    return _short(lines[0] if lines else type(exc).__name__)
