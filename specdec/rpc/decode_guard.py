"""Requests whose bytes do not decode are the caller's fault: INVALID_ARGUMENT, not UNKNOWN / INTERNAL.

gRPC Python turns a request deserializer's exception into UNKNOWN (grpc.aio) or INTERNAL (the
thread-pool server) and logs a traceback each time. A server interceptor (:func:`sync_guard`,
:func:`aio_guard`, installed by :mod:`specdec.rpc.server` on every server) wraps each unary-request
handler: its deserializer returns an :class:`Undecodable` marker instead of raising, and its
behaviour answers that marker with INVALID_ARGUMENT "request does not decode: ...", naming the
field where the wire bytes could be traced to one (a BadRequest field violation, as
:mod:`specdec.rpc.errors` builds for every INVALID_ARGUMENT). The log gets one WARNING line, no
traceback, at most once per ``LOG_EVERY_S`` (with a count of those not logged), and the optional
``on_refused`` callback counts it (the router's ``outcome="invalid_argument"``).
"""

from __future__ import annotations

import inspect
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.descriptor import Descriptor, FieldDescriptor

from specdec.rpc.errors import RpcStatusError, abort_with, abort_with_async

log = logging.getLogger(__name__)

__all__ = ["Undecodable", "OnRefused", "find_bad_field", "sync_guard", "aio_guard", "LOG_EVERY_S"]

LOG_EVERY_S = 10.0

# (method, peer, status) -> None; called once per refused request.
OnRefused = Callable[[str, str, RpcStatusError], None]


@dataclass(frozen=True)
class Undecodable:
    """What a guarded deserializer returns for bytes that do not decode."""

    error: RpcStatusError


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[pos]  # IndexError: truncated
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise ValueError("varint too long")


def find_bad_field(data: bytes, desc: Descriptor, prefix: str = "") -> tuple[str | None, str] | None:
    """Where ``data`` stops decoding as ``desc``: (the field's path as in the proto, e.g.
    ``stop[1]`` or ``speculation.mode``, or None when it is not a known field; what is wrong), or
    None when no bad value is found (the decoder objected to something else)."""
    pos, seen = 0, {}
    while pos < len(data):
        name = None
        try:
            key, pos = _varint(data, pos)
            number, wire = key >> 3, key & 7
            field = desc.fields_by_number.get(number)
            if field is not None:
                name = prefix + field.name
                if field.is_repeated:
                    seen[number] = seen.get(number, -1) + 1
                    name += f"[{seen[number]}]"
            if wire == 0:
                _, pos = _varint(data, pos)
            elif wire in (1, 5):
                pos += 8 if wire == 1 else 4
                if pos > len(data):
                    return name, "is truncated"
            elif wire == 2:
                n, pos = _varint(data, pos)
                chunk, pos = data[pos : pos + n], pos + n
                if pos > len(data):
                    return name, "is truncated"
                if field is not None and field.type == FieldDescriptor.TYPE_STRING:
                    chunk.decode("utf-8")
                elif field is not None and field.type == FieldDescriptor.TYPE_MESSAGE:
                    inner = find_bad_field(chunk, field.message_type, name + ".")
                    if inner is not None:
                        return inner if inner[0] is not None else (name, inner[1])
            else:
                return name, f"has an invalid wire type ({wire})"
        except UnicodeDecodeError:
            return name, "is not valid UTF-8"
        except (IndexError, ValueError):
            return name, "is truncated"
    return None


class _RateLimitedWarning:
    def __init__(self, every_s: float):
        self.every_s = every_s
        self._lock = threading.Lock()
        self._last = -float("inf")
        self._skipped = 0

    def __call__(self, msg: str, *args: Any) -> None:
        with self._lock:
            now = time.monotonic()
            if now - self._last < self.every_s:
                self._skipped += 1
                return
            skipped, self._skipped, self._last = self._skipped, 0, now
        more = f" ({skipped} more since the last such line)" if skipped else ""
        log.warning(msg + more, *args)


_warn = _RateLimitedWarning(LOG_EVERY_S)


def _guarded_deserializer(deserialize: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    desc = getattr(getattr(deserialize, "__self__", None), "DESCRIPTOR", None)

    def safe(data: bytes) -> Any:
        try:
            return deserialize(data)
        except Exception as exc:  # noqa: BLE001 - DecodeError and whatever a custom deserializer raises
            what = desc.full_name if isinstance(desc, Descriptor) else "request message"
            field, problem = (find_bad_field(data, desc) if isinstance(desc, Descriptor) else None) or (None, "")
            if field is not None:
                message = f"request does not decode: {field} {problem}"
            elif problem:
                message = f"request does not decode: a field of {what} {problem}"
            else:
                message = f"request does not decode: not a valid {what} ({type(exc).__name__})"
            return Undecodable(RpcStatusError(grpc.StatusCode.INVALID_ARGUMENT, message, field=field))

    return safe


def _refused(method: str, context, marker: Undecodable, on_refused: OnRefused | None) -> None:
    peer = context.peer() if hasattr(context, "peer") else ""
    _warn("%s from %s: %s", method, peer, marker.error.message)
    if on_refused is not None:
        try:
            on_refused(method, peer, marker.error)
        except Exception:  # noqa: BLE001 - counting must not change the answer
            log.exception("on_refused callback failed")


def _wrap(handler, method: str, on_refused: OnRefused | None, aio: bool):
    if handler is None or handler.request_streaming or handler.request_deserializer is None:
        return handler
    kind = "unary_stream" if handler.response_streaming else "unary_unary"
    behaviour = getattr(handler, kind)
    if aio and inspect.isasyncgenfunction(behaviour):

        async def agen(request, context):
            if isinstance(request, Undecodable):
                _refused(method, context, request, on_refused)
                await abort_with_async(context, request.error, method, quiet=True)
            async for item in behaviour(request, context):
                yield item

        guarded = agen
    elif aio and inspect.iscoroutinefunction(behaviour):

        async def coro(request, context):
            if isinstance(request, Undecodable):
                _refused(method, context, request, on_refused)
                await abort_with_async(context, request.error, method, quiet=True)
            return await behaviour(request, context)

        guarded = coro
    elif aio:
        return handler  # a sync behaviour on an aio server: none of ours; leave it as it is
    else:

        def plain(request, context):
            if isinstance(request, Undecodable):
                _refused(method, context, request, on_refused)
                abort_with(context, request.error, method, quiet=True)
            return behaviour(request, context)

        guarded = plain
    return handler._replace(request_deserializer=_guarded_deserializer(handler.request_deserializer), **{kind: guarded})


class _SyncGuard(grpc.ServerInterceptor):
    def __init__(self, on_refused: OnRefused | None):
        self.on_refused = on_refused

    def intercept_service(self, continuation, handler_call_details):
        return _wrap(continuation(handler_call_details), handler_call_details.method, self.on_refused, aio=False)


class _AioGuard(grpc.aio.ServerInterceptor):
    def __init__(self, on_refused: OnRefused | None):
        self.on_refused = on_refused

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        return _wrap(handler, handler_call_details.method, self.on_refused, aio=True)


def sync_guard(on_refused: OnRefused | None = None) -> grpc.ServerInterceptor:
    """The interceptor for a thread-pool ``grpc.server``."""
    return _SyncGuard(on_refused)


def aio_guard(on_refused: OnRefused | None = None) -> grpc.aio.ServerInterceptor:
    """The interceptor for a ``grpc.aio.server``."""
    return _AioGuard(on_refused)
