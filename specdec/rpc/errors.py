"""Our exceptions become gRPC status codes with a message a person can act on, never a stack trace.

:func:`status_for` maps an exception to (code, message); :func:`abort_with` / :func:`abort_with_async`
answer an RPC with it; :func:`rpc_method` wraps a sync servicer method. The trace goes to the log.
Exception classes defined in torch modules (``specdec.core.runner``, ``specdec.core.models``) are
matched by class name, so this module stays torch-free.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable

import grpc

log = logging.getLogger(__name__)

__all__ = ["RpcStatusError", "status_for", "abort_with", "abort_with_async", "rpc_method", "remote_error_message"]


class RpcStatusError(Exception):
    """Raise from a servicer to answer with a given status code and message."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    def __reduce__(self):
        return (type(self), (self.code, self.message))


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


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The gRPC status code and a one-line message for an exception raised while serving.

    InvalidParams -> INVALID_ARGUMENT ("field: what is wrong"), SlotsExhausted ->
    RESOURCE_EXHAUSTED, ContextFull -> OUT_OF_RANGE, ModelLoadError / IncompatibleModels ->
    FAILED_PRECONDITION, GroupFailure -> UNAVAILABLE, TimeoutError -> DEADLINE_EXCEEDED,
    NotImplementedError -> UNIMPLEMENTED, a grpc.RpcError from a downstream call -> its own code and
    details, RpcStatusError -> its code;
    anything else -> INTERNAL with the exception's type and first line (the worker logs the trace).
    """
    if isinstance(exc, RpcStatusError):
        return exc.code, _short(exc.message)
    if isinstance(exc, grpc.RpcError) and hasattr(exc, "code") and hasattr(exc, "details"):
        code = exc.code()
        return (code if isinstance(code, grpc.StatusCode) else grpc.StatusCode.UNKNOWN), _short(exc.details() or "")
    for cls in type(exc).__mro__:
        code = _CODES_BY_NAME.get(cls.__name__)
        if code is not None and cls.__module__.startswith("specdec"):
            return code, _short(str(exc))
    if isinstance(exc, TimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED, _short(str(exc) or "the operation timed out")
    if isinstance(exc, NotImplementedError):
        return grpc.StatusCode.UNIMPLEMENTED, _short(str(exc) or "not implemented")
    text = exc.args[0] if len(exc.args) == 1 and isinstance(exc.args[0], str) else str(exc)
    first = text.strip().splitlines()[0] if text.strip() else ""
    return grpc.StatusCode.INTERNAL, _short(
        f"internal error ({type(exc).__name__}{': ' + first if first else ''}); see the server log"
    )


def _log_failure(exc: BaseException, code: grpc.StatusCode, where: str) -> None:
    if code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN):
        log.error("%s failed", where, exc_info=exc)
    else:
        log.info("%s: %s: %s", where, code.name, exc)


def abort_with(context: grpc.ServicerContext, exc: BaseException, where: str = "rpc") -> None:
    """Abort the RPC with :func:`status_for`'s code and message (raises, like ``context.abort``)."""
    code, message = status_for(exc)
    _log_failure(exc, code, where)
    context.abort(code, message)


async def abort_with_async(context: grpc.aio.ServicerContext, exc: BaseException, where: str = "rpc") -> None:
    """The grpc.aio twin of :func:`abort_with`."""
    code, message = status_for(exc)
    _log_failure(exc, code, where)
    await context.abort(code, message)


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
