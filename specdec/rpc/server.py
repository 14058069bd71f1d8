"""gRPC servers (sync thread pool, or grpc.aio) with health checking and reflection.

Every server answers the standard health service (SERVING for "" and each service, NOT_SERVING
while draining) and server reflection (the services, health and reflection itself), and refuses
requests whose bytes do not decode with INVALID_ARGUMENT (:mod:`specdec.rpc.decode_guard`).
"""

from __future__ import annotations

import logging
import signal
import threading
import weakref
from collections.abc import Callable, Sequence
from concurrent import futures
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from specdec.rpc.decode_guard import OnRefused, aio_guard, sync_guard

log = logging.getLogger(__name__)

__all__ = [
    "Registration",
    "hostport",
    "start_server",
    "start_aio_server",
    "set_serving",
    "stop_server",
    "serve_until_signal",
    "announce_aio_shutdown",
]

# (generated add_*Servicer_to_server, servicer instance, full service name)
Registration = tuple[Callable[[Any, Any], None], object, str]

# Keep the health servicer of each server we started, to flip it on drain / shutdown.
_HEALTH: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def hostport(host: str, port: int) -> str:
    """'host:port', with brackets around IPv6 literals."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def _add_port(server, host: str, port: int, credentials: grpc.ServerCredentials | None) -> int:
    address = hostport(host, port)
    bound = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    if bound == 0:
        raise OSError(f"could not bind a gRPC server to {address} (port in use?)")
    return bound


def _register(server, register: Sequence[Registration]) -> list[str]:
    names = []
    for add, servicer, name in register:
        add(servicer, server)
        names.append(name)
    return names


def start_server(
    register: Sequence[Registration],
    host: str = "127.0.0.1",
    port: int = 0,
    max_workers: int = 4,
    options: Sequence[tuple[str, Any]] = (),
    on_refused: OnRefused | None = None,
    interceptors: Sequence[grpc.ServerInterceptor] = (),
    credentials: grpc.ServerCredentials | None = None,
) -> tuple[grpc.Server, int]:
    """Start a sync gRPC server (thread pool of ``max_workers``); returns (server, bound port).

    ``port=0`` picks a free port. Health reports SERVING for "" and each registered service;
    reflection lists the services, grpc.health.v1.Health and the reflection service.
    ``on_refused(method, peer, error)`` is called for each request that does not decode.
    ``interceptors`` run before the decode guard (authentication first: a refused call is never
    decoded); ``credentials``: TLS (:func:`specdec.rpc.auth.server_tls`), else plaintext.
    """
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grpc-server"),
        interceptors=[*interceptors, sync_guard(on_refused)],
        options=[("grpc.so_reuseport", 0), *options],  # never share a port with another server
    )
    names = _register(server, register)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    bound = _add_port(server, host, port, credentials)
    server.start()
    for name in ["", *names]:
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    _HEALTH[server] = (health_servicer, names)
    log.info("gRPC server on %s serving %s", hostport(host, bound), ", ".join(names))
    return server, bound


async def start_aio_server(
    register: Sequence[Registration],
    host: str = "127.0.0.1",
    port: int = 0,
    options: Sequence[tuple[str, Any]] = (),
    on_refused: OnRefused | None = None,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    credentials: grpc.ServerCredentials | None = None,
) -> tuple[grpc.aio.Server, int]:
    """The grpc.aio twin of :func:`start_server` (servicer methods may be coroutines)."""
    server = grpc.aio.server(
        interceptors=[*interceptors, aio_guard(on_refused)], options=[("grpc.so_reuseport", 0), *options]
    )
    names = _register(server, register)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    bound = _add_port(server, host, port, credentials)
    await server.start()
    for name in ["", *names]:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    _HEALTH[server] = (health_servicer, names)
    log.info("gRPC (aio) server on %s serving %s", hostport(host, bound), ", ".join(names))
    return server, bound


def set_serving(server: grpc.Server, serving: bool) -> None:
    """Flip the health status of a sync server started here (e.g. NOT_SERVING while draining)."""
    entry = _HEALTH.get(server)
    if entry is None:
        return
    health_servicer, names = entry
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ["", *names]:
        health_servicer.set(name, status)


def stop_server(server: grpc.Server, grace: float | None = None) -> None:
    """Report NOT_SERVING to health watchers, then stop a sync server (in-flight RPCs get ``grace`` s)."""
    entry = _HEALTH.get(server)
    if entry is not None:
        entry[0].enter_graceful_shutdown()
    server.stop(grace).wait()


async def announce_aio_shutdown(server: grpc.aio.Server) -> None:
    """Report NOT_SERVING to health watchers of an aio server started here (balancers stop sending)."""
    entry = _HEALTH.get(server)
    if entry is not None:
        await entry[0].enter_graceful_shutdown()


def serve_until_signal(server: grpc.Server, grace: float = 5.0) -> None:
    """Block until SIGINT/SIGTERM, then stop the server gracefully (for the worker entry points)."""
    done = threading.Event()

    def _stop(signum, _frame):
        log.info("signal %d: shutting down", signum)
        done.set()

    previous = {s: signal.signal(s, _stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while not done.wait(1.0):
            pass
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        stop_server(server, grace)
