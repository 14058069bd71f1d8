"""Serving helpers shared by the workers and the router: gRPC servers, error mapping, worker config.

* :func:`start_server` / :func:`start_aio_server`: a gRPC server (sync thread pool, or grpc.aio)
  with the given servicers, standard health checking (SERVING for "" and every service) and
  server reflection (the services, health and reflection itself).
* :func:`status_for` / :func:`abort_with` / :func:`rpc_method`: our exceptions become gRPC status
  codes with a message a person can act on, never a stack trace (the trace goes to the log).
* :class:`WorkerConfig`, :class:`WorkerHost`, :func:`actor_options`, :func:`add_worker_args`:
  what the draft and target workers share (they must not import each other; DESIGN.md rules of
  the house). :func:`remote_error_message` turns a remote failure (e.g. a Ray actor that died in
  its constructor) into one readable line.

No torch and no Ray here: the router imports this module. Exception classes defined in torch
modules (``specdec.runner``, ``specdec.models``) are matched by class name.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import inspect
import logging
import os
import signal
import socket
import threading
import sys
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

log = logging.getLogger(__name__)

__all__ = [
    "Registration",
    "RpcStatusError",
    "start_server",
    "start_aio_server",
    "stop_server",
    "set_serving",
    "status_for",
    "abort_with",
    "abort_with_async",
    "rpc_method",
    "remote_error_message",
    "hostport",
    "WorkerConfig",
    "DTYPE_NAMES",
    "actor_options",
    "add_worker_args",
    "config_from_args",
    "serve_until_signal",
    "advertised_host",
    "WorkerHost",
]

# (generated add_*Servicer_to_server, servicer instance, full service name)
Registration = tuple[Callable[[Any, Any], None], object, str]

DTYPE_NAMES = ("float32", "bfloat16", "float16")

# Keep the health servicer of each server we started, to flip it on drain / shutdown.
_HEALTH: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


# ---- errors ----------------------------------------------------------------------------------


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
    "InvalidParams": grpc.StatusCode.INVALID_ARGUMENT,  # specdec.sampling
    "SlotsExhausted": grpc.StatusCode.RESOURCE_EXHAUSTED,  # specdec.runner
    "ContextFull": grpc.StatusCode.OUT_OF_RANGE,  # specdec.runner
    "ModelLoadError": grpc.StatusCode.FAILED_PRECONDITION,  # specdec.models
    "IncompatibleModels": grpc.StatusCode.FAILED_PRECONDITION,  # specdec.build
}
_MAX_MESSAGE = 500


def _short(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= _MAX_MESSAGE else text[: _MAX_MESSAGE - 3] + "..."


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The gRPC status code and a one-line message for an exception raised while serving.

    InvalidParams -> INVALID_ARGUMENT ("field: what is wrong"), SlotsExhausted ->
    RESOURCE_EXHAUSTED, ContextFull -> OUT_OF_RANGE, ModelLoadError / IncompatibleModels ->
    FAILED_PRECONDITION, TimeoutError -> DEADLINE_EXCEEDED, NotImplementedError -> UNIMPLEMENTED,
    a grpc.RpcError from a downstream call -> its own code and details, RpcStatusError -> its code;
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
    return grpc.StatusCode.INTERNAL, _short(f"internal error ({type(exc).__name__}{': ' + first if first else ''}); "
                                            "see the server log")


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


# ---- servers ---------------------------------------------------------------------------------


def hostport(host: str, port: int) -> str:
    """'host:port', with brackets around IPv6 literals."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def _register(server, register: Sequence[Registration]) -> list[str]:
    names = []
    for add, servicer, name in register:
        add(servicer, server)
        names.append(name)
    return names


def start_server(register: Sequence[Registration], host: str = "127.0.0.1", port: int = 0,
                 max_workers: int = 4, options: Sequence[tuple[str, Any]] = ()) -> tuple[grpc.Server, int]:
    """Start a sync gRPC server (thread pool of ``max_workers``); returns (server, bound port).

    ``port=0`` picks a free port. Health reports SERVING for "" and each registered service;
    reflection lists the services, grpc.health.v1.Health and the reflection service.
    """
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grpc-server"),
        options=[("grpc.so_reuseport", 0), *options],  # never share a port with another server
    )
    names = _register(server, register)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    bound = server.add_insecure_port(hostport(host, port))
    if bound == 0:
        raise OSError(f"could not bind a gRPC server to {hostport(host, port)} (port in use?)")
    server.start()
    for name in ["", *names]:
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    _HEALTH[server] = (health_servicer, names)
    log.info("gRPC server on %s serving %s", hostport(host, bound), ", ".join(names))
    return server, bound


async def start_aio_server(register: Sequence[Registration], host: str = "127.0.0.1", port: int = 0,
                           options: Sequence[tuple[str, Any]] = ()) -> tuple[grpc.aio.Server, int]:
    """The grpc.aio twin of :func:`start_server` (servicer methods may be coroutines)."""
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0), *options])
    names = _register(server, register)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    bound = server.add_insecure_port(hostport(host, port))
    if bound == 0:
        raise OSError(f"could not bind a gRPC server to {hostport(host, port)} (port in use?)")
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


# ---- worker configuration (shared by draft_worker and target_worker) ---------------------------


@dataclass
class WorkerConfig:
    """One worker's configuration; the dict form is what the Ray actors take.

    model: pack name, HF folder, .gguf file, hub id, or "ngram" (draft workers only).
    dtype / device: compute dtype ("float32" | "bfloat16" | "float16") and device ("cpu" | "cuda").
    num_slots / max_len: KV-cache sequences and tokens per sequence.
    host / port: where gRPC binds (port 0 = any free port). A wildcard host ("0.0.0.0", "::")
    binds every interface and advertises ``advertise_host`` (or the node's address under Ray).
    threads: torch.set_num_threads (None = leave as is). grpc_threads: the server's thread pool.
    top_k_sent: ids + probs per draft position in rejection mode (model drafters).
    draft_options: keyword arguments of :class:`specdec.build.DraftOptions` (quant, vocab) for
    model drafters; None = its defaults, the same as ``specdec generate``.
    max_ngram / min_ngram: n-gram drafter window (model "ngram").
    """

    model: str
    dtype: str = "float32"
    device: str = "cpu"
    num_slots: int = 8
    max_len: int = 2048
    host: str = "127.0.0.1"
    port: int = 0
    threads: int | None = None
    advertise_host: str | None = None
    grpc_threads: int = 4
    top_k_sent: int = 16
    draft_options: dict | None = None
    max_ngram: int = 3
    min_ngram: int = 1

    def __post_init__(self) -> None:
        def bad(key: str, why: str) -> ValueError:
            return ValueError(f"worker config {key!r}: {why}")

        if not isinstance(self.model, str) or not self.model:
            raise bad("model", "must be a non-empty string (pack name, folder, .gguf file, hub id or 'ngram')")
        if self.dtype not in DTYPE_NAMES:
            raise bad("dtype", f"must be one of {DTYPE_NAMES} (got {self.dtype!r})")
        if not isinstance(self.device, str) or self.device.split(":")[0] not in ("cpu", "cuda"):
            raise bad("device", f"must be 'cpu' or 'cuda[:N]' (got {self.device!r})")
        for key in ("num_slots", "max_len", "grpc_threads", "top_k_sent", "max_ngram", "min_ngram"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise bad(key, f"must be an integer >= 1 (got {value!r})")
        if self.min_ngram > self.max_ngram:
            raise bad("min_ngram", f"must be <= max_ngram ({self.max_ngram})")
        if not isinstance(self.port, int) or not 0 <= self.port < 65536:
            raise bad("port", f"must be in [0, 65535], 0 = any free port (got {self.port!r})")
        if self.threads is not None and (not isinstance(self.threads, int) or self.threads < 1):
            raise bad("threads", f"must be an integer >= 1 or None (got {self.threads!r})")
        if self.draft_options is not None and not isinstance(self.draft_options, dict):
            raise bad("draft_options", f"must be a dict of DraftOptions fields or None (got {self.draft_options!r})")

    @classmethod
    def from_dict(cls, config: dict | WorkerConfig) -> WorkerConfig:
        if isinstance(config, WorkerConfig):
            return config
        if "model" not in config:
            raise ValueError("worker config: 'model' is required")
        return strict_from_dict(cls, config, "worker config")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @property
    def wildcard(self) -> bool:
        return self.host in ("0.0.0.0", "::", "", "[::]")


def actor_options(placement: dict | None, default_resources: dict[str, float], *, name: str | None = None,
                  max_restarts: int = -1, max_task_retries: int = 3) -> dict:
    """Ray ``.options(...)`` for a worker actor from a placement dict (built without importing Ray).

    ``placement``: ``{"resources": {...}, "num_gpus": N, "accelerator_type": str | None,
    "num_cpus": N, "memory": bytes, "scheduling_strategy": ..., "runtime_env": {...}}``, all
    optional. None means ``{"resources": default_resources}`` (custom resources such as
    ``{"target_gpu": 1}`` on CPU clusters); GPU clusters give ``num_gpus`` and ``accelerator_type``.
    """
    placement = dict(placement) if placement is not None else {"resources": dict(default_resources)}
    allowed = {"resources", "num_gpus", "accelerator_type", "num_cpus", "memory", "scheduling_strategy",
               "runtime_env"}
    unknown = sorted(set(placement) - allowed)
    if unknown:
        raise ValueError(f"placement: unknown keys {unknown} (known: {sorted(allowed)})")
    opts: dict[str, Any] = {
        "num_cpus": placement.get("num_cpus", 1),
        "max_restarts": max_restarts,
        "max_task_retries": max_task_retries if max_restarts != 0 else 0,
    }
    if placement.get("resources"):
        opts["resources"] = dict(placement["resources"])
    for key in ("num_gpus", "accelerator_type", "memory", "scheduling_strategy", "runtime_env"):
        if placement.get(key) is not None:
            opts[key] = placement[key]
    if name is not None:
        opts["name"] = name
    return opts


def add_worker_args(parser: argparse.ArgumentParser, role: str) -> None:
    """The command-line flags of ``python -m draft_worker`` / ``python -m target_worker``."""
    model_help = "pack name, HF folder, .gguf file or hub id" + (", or 'ngram'" if role == "draft" else "")
    parser.add_argument("--model", required=True, help=model_help)
    parser.add_argument("--dtype", default="float32", choices=DTYPE_NAMES)
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument("--num-slots", type=int, default=8, help="KV-cache slots (concurrent sequences)")
    parser.add_argument("--max-len", type=int, default=2048, help="KV-cache tokens per sequence")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (0.0.0.0 = every interface)")
    parser.add_argument("--port", type=int, default=0, help="gRPC port (0 = any free port)")
    parser.add_argument("--advertise-host", default=None, help="address to print for clients (wildcard hosts)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--grpc-threads", type=int, default=4)
    if role == "draft":
        parser.add_argument("--top-k-sent", type=int, default=16, help="ids + probs per draft position")
        parser.add_argument("--draft-quant", choices=["int8", "none"], default=None,
                            help="weight-only int8 for the draft model (default: as `specdec generate`)")
        parser.add_argument("--draft-vocab", type=int, default=None,
                            help="draft lm_head over the N most frequent ids (0 = full vocabulary; "
                                 "default: as `specdec generate`)")
    parser.add_argument("--log-level", default="INFO")


def config_from_args(args: argparse.Namespace) -> WorkerConfig:
    keys = {f.name for f in dataclasses.fields(WorkerConfig)}
    config = {k: v for k, v in vars(args).items() if k in keys}
    draft_options = {}
    if getattr(args, "draft_quant", None) is not None:
        draft_options["quant"] = args.draft_quant
    if getattr(args, "draft_vocab", None) is not None:
        draft_options["vocab"] = args.draft_vocab or None
    if draft_options:
        config["draft_options"] = draft_options
    return WorkerConfig.from_dict(config)


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


def advertised_host(config: WorkerConfig, node_ip: str | None = None) -> str:
    """The host clients should dial: the bind host, or for a wildcard bind ``advertise_host``, the
    node's IP (``node_ip``, e.g. from Ray), else this machine's resolved host name."""
    if not config.wildcard:
        return config.host
    if config.advertise_host:
        return config.advertise_host
    if node_ip:
        return node_ip
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def ray_facts() -> dict:
    """Node IP and restart flag when running inside a Ray actor; {} otherwise (ray is not imported)."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return {}
    ctx = ray.get_runtime_context()
    facts = {"node_ip": ray.util.get_node_ip_address()}
    if ctx.get_actor_id() is not None:
        facts["restarted"] = bool(ctx.was_current_actor_reconstructed)
    return facts


class WorkerHost:
    """A servicer served on its own gRPC server: what the worker actors and entry points share.

    ``info_source`` is the servicer (its ``info_dict()`` describes the model and capacity).
    """

    role = "worker"

    def __init__(self, config: WorkerConfig, register: Sequence[Registration], info_source: Any,
                 node_ip: str | None = None):
        self.config = config
        self.info_source = info_source
        self.facts = ray_facts()
        self.server, self.port = start_server(register, host=config.host, port=config.port,
                                              max_workers=config.grpc_threads)
        self.host = advertised_host(config, node_ip or self.facts.get("node_ip"))
        self.started_at = time.time()
        self.draining = False
        log.info("%s worker %s serving on %s%s", self.role, config.model, self.address(),
                 " (restarted)" if self.facts.get("restarted") else "")

    def address(self) -> str:
        """'host:port' of the gRPC server (a restarted actor has a new one when port is 0)."""
        return hostport(self.host, self.port)

    def pid(self) -> int:
        return os.getpid()

    def info(self) -> dict:
        return {**self.info_source.info_dict(), "address": self.address(), "pid": os.getpid(),
                "started_at": self.started_at, "draining": self.draining, **self.facts}

    def drain(self) -> None:
        """Report NOT_SERVING (routers stop sending new work); RPCs are still answered."""
        self.draining = True
        set_serving(self.server, False)

    def shutdown(self, grace: float = 5.0) -> None:
        """Stop the gRPC server (in-flight RPCs get ``grace`` seconds)."""
        self.draining = True
        stop_server(self.server, grace)


def strict_from_dict(cls, d: dict[str, Any] | None, section: str):
    """Build dataclass `cls` from `d`, refusing unknown keys with a message naming the section."""
    d = dict(d or {})
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise ValueError(f"{section}: unknown keys {unknown} (known: {sorted(known)})")
    return cls(**d)


def worker_main(argv: list[str] | None, role: str, description: str, make_worker: Callable[[WorkerConfig], Any]) -> int:
    """`python -m {role}_worker`: serve one worker without Ray until SIGINT/SIGTERM.

    Prints "{role}_worker serving MODEL on HOST:PORT" once the server is up (scripts wait for it)."""
    prog = f"{role}_worker"
    parser = argparse.ArgumentParser(prog=f"python -m {prog}", description=description)
    add_worker_args(parser, role)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = config_from_args(args)
        worker = make_worker(config)
    except Exception as exc:  # noqa: BLE001 - a command line: one readable line, no trace
        print(f"{prog}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    print(f"{prog} serving {config.model} on {worker.address()}", flush=True)
    serve_until_signal(worker.server)
    return 0
