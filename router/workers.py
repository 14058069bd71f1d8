"""The router's view of one worker: where it is, whether it is up, and its gRPC stub.

An :class:`Endpoint` says where a worker's gRPC server is. :class:`StaticEndpoint` is a fixed
``host:port``; :class:`ActorEndpoint` asks a Ray actor handle for its ``address()`` — after a
restart the actor listens on a new port, and the call waits for the restart. The router never
imports Ray (nor torch): the handle is used duck-typed (``handle.address.remote()`` returns an
ObjectRef whose ``future()`` is a concurrent future).

A :class:`WorkerClient` wraps the channel and stub. Transport failures (the worker is gone,
restarting, or not answering) raise :class:`WorkerUnavailable` and mark the worker down; a
single background task then re-resolves the endpoint and probes ``Info`` until the worker answers
again (``up`` flips back). Drafters are used only while up (fail open otherwise); target calls
wait for the recovery (:meth:`WorkerClient.wait_up`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, Protocol

import grpc

from router import clock
from specdec.rpc import tracing, worker_pb2, worker_pb2_grpc
from specdec.rpc.telemetry import COMPUTE_METADATA_KEY
from specdec.rpc.worker_secret import secret_metadata

log = logging.getLogger(__name__)

__all__ = [
    "COMPUTE_METADATA_KEY",
    "Endpoint",
    "StaticEndpoint",
    "ActorEndpoint",
    "WorkerClient",
    "WorkerUnavailable",
    "TRANSPORT_CODES",
]

# Status codes that mean "this worker cannot answer now" rather than "this request is bad".
TRANSPORT_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED})

_CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
    # A restarted worker may come back on the same address: reconnect quickly.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.enable_retries", 0),
]


class WorkerUnavailable(Exception):
    """The worker did not answer (gone, restarting, overloaded past the timeout)."""


class Endpoint(Protocol):
    name: str

    async def resolve(self, timeout: float) -> str: ...


class StaticEndpoint:
    def __init__(self, address: str, name: str | None = None):
        self.address = address
        self.name = name or address

    async def resolve(self, timeout: float) -> str:
        return self.address

    def __repr__(self) -> str:
        return f"StaticEndpoint({self.address!r})"


class ActorEndpoint:
    """A Ray actor with an ``address()`` method (draft_worker / target_worker actors)."""

    def __init__(self, handle: Any, name: str | None = None):
        self.handle = handle
        self.name = name or repr(handle)

    async def resolve(self, timeout: float) -> str:
        ref = self.handle.address.remote()
        fut = asyncio.wrap_future(ref.future())
        try:
            return str(await asyncio.wait_for(fut, timeout))
        except TimeoutError:
            raise WorkerUnavailable(f"{self.name}: address() did not answer in {timeout:.0f} s") from None
        except Exception as exc:  # RayActorError & co., without importing ray
            raise WorkerUnavailable(
                f"{self.name}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            ) from exc

    def __repr__(self) -> str:
        return f"ActorEndpoint({self.name!r})"


class WorkerClient:
    """One draft or target worker, seen from the router's event loop."""

    def __init__(
        self,
        endpoint: Endpoint,
        role: str,
        *,
        resolve_timeout: float = 60.0,
        on_state: Callable[[WorkerClient], None] | None = None,
    ):
        if role not in ("draft", "target"):
            raise ValueError(f"role must be 'draft' or 'target' (got {role!r})")
        self.endpoint = endpoint
        self.role = role
        self.resolve_timeout = resolve_timeout
        self.on_state = on_state
        self.address: str | None = None
        self.channel: grpc.aio.Channel | None = None
        self.stub: Any = None
        self._secret: tuple[tuple[str, str], ...] = ()  # the worker secret's metadata, sent with every call
        self.info: worker_pb2.WorkerInfo | None = None
        self._info_address: str | None = None  # where `info` came from
        self.telemetry = None  # latest specdec.rpc.telemetry.DeviceSample (router/telemetry_loop.py polls it)
        self.up = False
        # New worker processes seen after the first (a new address, or a new WorkerInfo.instance at
        # the same one): each one lost every KV cache the previous one held.
        self.restarts = 0
        self.down_since: float | None = None  # clock.now() when it went down
        self.last_recovery_s: float | None = None  # how long its last recovery took (for RetryInfo)
        self.lock = asyncio.Lock()  # batch RPCs (Propose / Verify) go one at a time
        self._releasing: set[asyncio.Task] = set()  # Release calls in flight: later calls wait for them
        self._recovery: asyncio.Task | None = None
        self._closed = False
        self._auth_warned = False

    @property
    def name(self) -> str:
        return self.endpoint.name

    def __repr__(self) -> str:
        return f"WorkerClient({self.role}, {self.name}, {self.address}, up={self.up})"

    # ---- connection --------------------------------------------------------------------------
    async def _open(self, address: str) -> None:
        if address == self.address and self.channel is not None:
            return
        old = self.channel
        self.channel = grpc.aio.insecure_channel(address, options=_CHANNEL_OPTIONS)
        # every call carries the deployment's worker secret (specdec.rpc.worker_secret)
        self._secret = secret_metadata()
        stub_cls = worker_pb2_grpc.DraftServiceStub if self.role == "draft" else worker_pb2_grpc.TargetServiceStub
        self.stub = stub_cls(self.channel)
        if self.address is not None and address != self.address:
            log.info("%s worker %s moved from %s to %s (restarted)", self.role, self.name, self.address, address)
        self.address = address
        if old is not None:
            await old.close(grace=None)

    async def _probe(self) -> None:
        address = await self.endpoint.resolve(self.resolve_timeout)
        await self._open(address)
        try:
            self.record_info(await self.fetch_info(timeout=10.0), address)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNAUTHENTICATED and not self._auth_warned:
                self._auth_warned = True
                log.warning(
                    "%s worker %s refused the router's worker secret: both must have the same "
                    "SPECDEC_WORKER_SECRET (specdec serve passes its own to the workers it starts)",
                    self.role,
                    self.name,
                )
            raise WorkerUnavailable(
                f"{self.role} worker {self.name} at {address}: Info: {exc.code().name}: {exc.details()}"
            ) from None

    def record_info(self, info: worker_pb2.WorkerInfo, address: str | None) -> None:
        """Keep the Info the worker at ``address`` answered; one from another address or another
        ``instance`` than the last is a new process (``restarts``), even one that came back on the
        same address between two calls without any call failing."""
        if self.info is not None and (address != self._info_address or info.instance != self.info.instance):
            self.restarts += 1
        self.info, self._info_address = info, address

    def _set_up(self, up: bool) -> None:
        if up != self.up:
            self.up = up
            if self.on_state is not None:
                self.on_state(self)

    async def connect(self, timeout: float) -> None:
        """First connection: resolve and probe until the worker answers or ``timeout`` passes."""
        self._ensure_recovery()
        await self.wait_up(timeout)

    def mark_down(self, why: str) -> None:
        if self.up:
            log.warning("%s worker %s (%s) is down: %s", self.role, self.name, self.address, why)
            self.down_since = clock.now()
        self._set_up(False)
        self._ensure_recovery()

    def _ensure_recovery(self) -> None:
        if self._closed or (self._recovery is not None and not self._recovery.done()):
            return
        self._recovery = asyncio.get_running_loop().create_task(self._recover(), name=f"recover-{self.role}")

    async def _recover(self) -> None:
        delay = 0.05
        t0 = clock.now()
        while not self._closed:
            try:
                await self._probe()
            except (WorkerUnavailable, OSError) as exc:
                log.debug("%s worker %s not back yet: %s", self.role, self.name, exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)
                continue
            if self.down_since is not None:
                self.last_recovery_s = clock.now() - self.down_since
            if self.restarts or clock.now() - t0 > 1:
                log.info(
                    "%s worker %s is up at %s (after %.1f s)", self.role, self.name, self.address, clock.now() - t0
                )
            self._set_up(True)
            return

    async def wait_up(self, timeout: float) -> None:
        """Return once the worker is up; WorkerUnavailable after ``timeout`` seconds."""
        if self.up:
            return
        self._ensure_recovery()
        task = self._recovery
        if task is None:
            raise WorkerUnavailable(f"{self.role} worker {self.name} is closed")
        try:
            await asyncio.wait_for(asyncio.shield(task), timeout)
        except TimeoutError:
            raise WorkerUnavailable(
                f"{self.role} worker {self.name} is not available (waited {timeout:.0f} s)"
            ) from None
        if not self.up:
            raise WorkerUnavailable(f"{self.role} worker {self.name} is not available")

    async def close(self) -> None:
        self._closed = True
        if self._recovery is not None and not self._recovery.done():
            self._recovery.cancel()
        if self.channel is not None:
            await self.channel.close(grace=None)

    # ---- calls -------------------------------------------------------------------------------
    async def fetch_info(self, timeout: float) -> worker_pb2.WorkerInfo:
        """The worker's Info, as it answers now (AioRpcError if it does not)."""
        return await self.stub.Info(worker_pb2.InfoRequest(), timeout=timeout, metadata=self._secret)

    async def call(self, method: str, request: Any, timeout: float) -> Any:
        """Call ``method`` on the stub. Transport failures mark the worker down and raise
        WorkerUnavailable; other gRPC errors (the worker rejected the request) propagate."""
        resp, _ = await self.call_timed(method, request, timeout)
        return resp

    async def call_timed(self, method: str, request: Any, timeout: float) -> tuple[Any, float | None]:
        """:meth:`call`, also returning the worker's own compute time when it reports one in the
        trailing metadata (``specdec-compute-seconds``), else None."""
        if self._releasing and method != "Release":
            await asyncio.wait(tuple(self._releasing))
        if self.stub is None or not self.up:
            raise WorkerUnavailable(f"{self.role} worker {self.name} is down")
        address = self.address
        try:
            # the current span (a round's phase, a request) is the parent of the worker's span
            traced = tracing.outgoing() if tracing.active and method in tracing.WORKER_RPCS else ()
            call = getattr(self.stub, method)(request, timeout=timeout, metadata=(*self._secret, *traced))
            resp = await call
            compute = None
            for key, value in (await call.trailing_metadata()) or ():
                if key == COMPUTE_METADATA_KEY:
                    try:
                        compute = float(value)
                    except ValueError:
                        pass
            return resp, compute
        except grpc.aio.AioRpcError as exc:
            if exc.code() in TRANSPORT_CODES or (
                exc.code() == grpc.StatusCode.UNKNOWN and "Stream removed" in (exc.details() or "")
            ):
                if self.address == address:  # not already replaced by a recovery
                    self.mark_down(f"{method}: {exc.code().name}: {exc.details()}")
                raise WorkerUnavailable(
                    f"{self.role} worker {self.name}: {method}: {exc.code().name}: {exc.details()}"
                ) from None
            raise

    def release(self, request_ids: list[str]) -> asyncio.Future:
        """Free KV slots (best effort: a worker that is down has lost them anyway). The call starts
        now, and every call made after this one waits for it: a worker with every slot taken places
        a new request by evicting its least recently used one, a running request whenever the one
        that finished was not the oldest of its batch, and that request's next call then recomputes
        its whole context (seconds on a CPU)."""
        if not request_ids or not self.up:
            done = asyncio.get_running_loop().create_future()
            done.set_result(None)
            return done
        task = asyncio.get_running_loop().create_task(self._release(request_ids))
        self._releasing.add(task)
        task.add_done_callback(self._releasing.discard)
        return task

    async def _release(self, request_ids: list[str]) -> None:
        try:
            await self.call("Release", worker_pb2.ReleaseRequest(request_ids=request_ids), timeout=10.0)
        except (WorkerUnavailable, grpc.aio.AioRpcError) as exc:
            log.debug("%s release failed: %s", self.role, exc)
