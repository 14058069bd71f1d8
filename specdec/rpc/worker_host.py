"""What the draft and target workers share (they must not import each other): a servicer served on its
own gRPC server (:class:`WorkerHost`), its Ray actor options, and the `python -m *_worker` entry point."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import socket
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from specdec.core.draft_options import add_draft_option_flags, draft_option_overrides
from specdec.core.dtypes import DTYPE_NAMES
from specdec.rpc import tracing
from specdec.rpc.grpc_options import ConnectionLimits
from specdec.rpc.server import Registration, hostport, serve_until_signal, set_serving, start_server, stop_server
from specdec.rpc.telemetry import TelemetryConfig, TelemetrySampler, WorkerMeter
from specdec.rpc.worker_config import WorkerConfig
from specdec.rpc.worker_secret import SECRET_FILE_ENV, require_secret, worker_interceptor

log = logging.getLogger(__name__)

__all__ = [
    "WorkerHost",
    "actor_options",
    "placement_bundle",
    "add_worker_args",
    "config_from_args",
    "bind_host",
    "advertised_host",
    "worker_limits",
    "worker_main",
]


def actor_options(
    placement: dict | None,
    default_resources: dict[str, float],
    *,
    name: str | None = None,
    max_restarts: int = -1,
    max_task_retries: int = 3,
) -> dict:
    """Ray ``.options(...)`` for a worker actor from a placement dict (built without importing Ray).

    ``placement``: ``{"resources": {...}, "num_gpus": N, "accelerator_type": str | None,
    "num_cpus": N, "memory": bytes, "scheduling_strategy": ..., "runtime_env": {...}}``, all
    optional. None means ``{"resources": default_resources}`` (custom resources such as
    ``{"target_gpu": 1}`` on CPU clusters); GPU clusters give ``num_gpus`` and ``accelerator_type``.
    """
    placement = dict(placement) if placement is not None else {"resources": dict(default_resources)}
    allowed = {"resources", "num_gpus", "accelerator_type", "num_cpus", "memory", "scheduling_strategy", "runtime_env"}
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
    otel = tracing.worker_env()
    if otel:  # an embedded cluster's actors inherit them; a joined cluster's raylets were started elsewhere
        env = dict(opts.get("runtime_env") or {})
        env["env_vars"] = {**otel, **env.get("env_vars", {})}
        opts["runtime_env"] = env
    if name is not None:
        opts["name"] = name
    return opts


def placement_bundle(placement: dict | None, default_resources: dict[str, float]) -> dict[str, float]:
    """The Ray placement-group bundle holding one actor placed by ``placement`` (see :func:`actor_options`)."""
    opts = actor_options(placement, default_resources)
    bundle: dict[str, float] = {"CPU": float(opts["num_cpus"])}
    bundle.update({k: float(v) for k, v in opts.get("resources", {}).items()})
    if opts.get("num_gpus"):
        bundle["GPU"] = float(opts["num_gpus"])
    if opts.get("accelerator_type"):
        bundle[f"accelerator_type:{opts['accelerator_type']}"] = 0.001  # what Ray asks for it
    if opts.get("memory"):
        bundle["memory"] = float(opts["memory"])
    return {k: v for k, v in bundle.items() if v > 0}


def end_worker_actors(handles: list, grace: float = 2.0) -> None:
    """Stop worker actors for good: ask them all to shut down (a tensor-parallel group's supervisor
    then removes its placement group, which would otherwise hold its bundles until the driver
    exits), wait once for all of them, then kill them. Best effort and bounded by grace + 5 s
    however many are hung: a dead or hung actor is killed all the same."""
    import ray

    refs = []
    for handle in handles:
        try:
            refs.append(handle.shutdown.remote(grace))
        except Exception:  # noqa: BLE001 - already gone: the kill below is enough
            pass
    if refs:
        ray.wait(refs, num_returns=len(refs), timeout=grace + 5.0)
    for handle in handles:
        try:
            ray.kill(handle, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass


def add_worker_args(parser: argparse.ArgumentParser, role: str) -> None:
    """The command-line flags of ``python -m draft_worker`` / ``python -m target_worker``."""
    model_help = "pack name, HF folder, .gguf file or hub id" + (", or 'ngram'" if role == "draft" else "")
    parser.add_argument("--model", required=True, help=model_help)
    parser.add_argument("--dtype", default="float32", choices=DTYPE_NAMES)
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument("--num-slots", type=int, default=8, help="KV-cache slots (concurrent sequences)")
    parser.add_argument("--max-len", type=int, default=2048, help="KV-cache tokens per sequence")
    parser.add_argument(
        "--host", default="127.0.0.1", help="bind address ('node': this machine's address; 0.0.0.0 = every interface)"
    )
    parser.add_argument("--port", type=int, default=0, help="gRPC port (0 = any free port)")
    parser.add_argument("--advertise-host", default=None, help="address to print for clients (wildcard hosts)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--grpc-threads", type=int, default=4)
    parser.add_argument("--max-k", type=int, default=16, help="the most draft tokens per sequence a call may ask for")
    if role == "draft":
        parser.add_argument("--top-k-sent", type=int, default=16, help="ids + probs per draft position")
        add_draft_option_flags(parser)
    parser.add_argument(
        "--secret-file",
        default=None,
        help="file holding the shared secret the router sends (default: $SPECDEC_WORKER_SECRET)",
    )
    parser.add_argument("--log-level", default="INFO")


def config_from_args(args: argparse.Namespace) -> WorkerConfig:
    keys = {f.name for f in dataclasses.fields(WorkerConfig)}
    config = {k: v for k, v in vars(args).items() if k in keys}
    draft_options = draft_option_overrides(args)
    if draft_options:
        config["draft_options"] = draft_options
    return WorkerConfig.from_dict(config)


def _own_address() -> str:
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def bind_host(config: WorkerConfig, node_ip: str | None = None) -> str:
    """Where the server binds: ``host``, or for "node" the node's IP (``node_ip``, e.g. from Ray,
    else this machine's resolved host name)."""
    if config.node_bound:
        return node_ip or _own_address()
    return config.host


def advertised_host(config: WorkerConfig, node_ip: str | None = None) -> str:
    """The host clients should dial: the bind host, or for a wildcard bind ``advertise_host``, the
    node's IP (``node_ip``, e.g. from Ray), else this machine's resolved host name."""
    if not config.wildcard:
        return bind_host(config, node_ip)
    if config.advertise_host:
        return config.advertise_host
    return node_ip or _own_address()


def worker_limits(config: WorkerConfig) -> ConnectionLimits:
    """The worker server's bounds: the largest message a legitimate round sends (every slot with a
    full context and a full draft with its sparse distributions), with room to spare, and the
    largest reply: GetTokenizer's tokenizer.json (about 7 MB for the Qwen models)."""
    per_sequence = config.max_len + config.max_k * (1 + 2 * max(config.top_k_sent, 64))
    return ConnectionLimits(max_message_bytes=(32 << 20) + 10 * config.num_slots * per_sequence)


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

    ``info_source`` is the servicer (its ``info_dict()`` describes the model and capacity; its
    ``meter``, a :class:`specdec.rpc.telemetry.WorkerMeter`, gets the device telemetry sampler).
    ``info_source`` is the servicer (its ``info_dict()`` describes the model and capacity).
    ``secret``: what every call but health must carry (:mod:`specdec.rpc.worker_secret`; the actors
    get it as a constructor argument); None: the one in this process's environment.
    """

    role = "worker"

    def __init__(
        self,
        config: WorkerConfig,
        register: Sequence[Registration],
        info_source: Any,
        node_ip: str | None = None,
        secret: str | None = None,
    ):
        self.config = config
        self.info_source = info_source
        self.facts = ray_facts()
        self.meter: WorkerMeter = info_source.meter
        self.meter.bench_step_delay_s = config.bench_step_delay_s
        tcfg = TelemetryConfig.from_dict(config.telemetry)
        self.telemetry = TelemetrySampler(config.device, self.meter, tcfg).start() if tcfg.enabled else None
        self.meter.sampler = self.telemetry
        node_ip = node_ip or self.facts.get("node_ip")
        kind = register[0][2].rsplit(".", 1)[-1].removesuffix("Service").lower()  # a TP rank 0 serves TargetService
        self.traced = tracing.setup(f"specdec-{kind}-worker")
        self.server, self.port = start_server(
            register,
            host=bind_host(config, node_ip),
            port=config.port,
            max_workers=config.grpc_threads,
            options=worker_limits(config).server_options(),
            interceptors=[worker_interceptor(secret or require_secret()), *tracing.server_interceptors()],
        )
        self.host = advertised_host(config, node_ip)
        self.started_at = time.time()
        self.draining = False
        log.info(
            "%s worker %s serving on %s%s",
            self.role,
            config.model,
            self.address(),
            " (restarted)" if self.facts.get("restarted") else "",
        )

    def address(self) -> str:
        """'host:port' of the gRPC server (a restarted actor has a new one when port is 0)."""
        return hostport(self.host, self.port)

    def pid(self) -> int:
        return os.getpid()

    def info(self) -> dict:
        return {
            **self.info_source.info_dict(),
            "address": self.address(),
            "pid": os.getpid(),
            "started_at": self.started_at,
            "draining": self.draining,
            "telemetry": dataclasses.asdict(self.telemetry.latest) if self.telemetry else None,
            **self.facts,
        }

    def set_bench_step_delay(self, seconds: float) -> None:
        """TEST/BENCHMARK KNOB: make every model step ``seconds`` slower from now on (0 = off)."""
        self.meter.bench_step_delay_s = max(0.0, float(seconds))
        log.warning("%s worker %s: bench step delay set to %.3f s", self.role, self.config.model, seconds)

    def drain(self) -> None:
        """Report NOT_SERVING (routers stop sending new work); RPCs are still answered."""
        self.draining = True
        set_serving(self.server, False)

    def shutdown(self, grace: float = 5.0) -> None:
        """Stop the gRPC server (in-flight RPCs get ``grace`` seconds)."""
        self.draining = True
        stop_server(self.server, grace)
        if self.telemetry is not None:
            self.telemetry.stop()
        if self.traced:
            self.traced = False
            tracing.shutdown()  # exports the spans still batched


def worker_main(argv: list[str] | None, role: str, description: str, make_worker: Callable[[WorkerConfig], Any]) -> int:
    """`python -m {role}_worker`: serve one worker without Ray until SIGINT/SIGTERM.

    Prints "{role}_worker serving MODEL on HOST:PORT" once the server is up (scripts wait for it)."""
    prog = f"{role}_worker"
    parser = argparse.ArgumentParser(prog=f"python -m {prog}", description=description)
    add_worker_args(parser, role)
    args = parser.parse_args(argv)
    if args.secret_file:
        os.environ[SECRET_FILE_ENV] = args.secret_file
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        require_secret()  # before the model loads: say at once what is missing
        config = config_from_args(args)
        worker = make_worker(config)
    except Exception as exc:  # noqa: BLE001 - a command line: one readable line, no trace
        print(f"{prog}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    print(f"{prog} serving {config.model} on {worker.address()}", flush=True)
    serve_until_signal(worker.server)
    return 0
