"""The router: worker clients, one scheduler per target worker, the public gRPC server, metrics.

The router receives *where* the workers are (:class:`TargetBinding`: endpoints — Ray actor
handles or fixed addresses — plus the model names); creating the workers is the launcher's job
(`cluster/`). It never imports torch, Ray, draft_worker or target_worker.

:class:`Router` lives on an asyncio loop (``await router.start()`` / ``await router.stop()``);
:class:`RouterThread` runs one on a background thread for synchronous callers (the launcher's
main thread, tests).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from router.config import RouterConfig
from router.detok import Detokenizer, resolve_model_dir
from router.metrics import Metrics
from router.policy import least_loaded
from router.scheduler import TargetScheduler
from router.service import SERVICE_NAME, GenerationService
from router.workers import Endpoint, WorkerClient, WorkerUnavailable
from specdec.core.params import InvalidParams
from specdec.rpc import generate_pb2, generate_pb2_grpc
from specdec.rpc.errors import RpcStatusError
from specdec.rpc.server import announce_aio_shutdown, start_aio_server

log = logging.getLogger(__name__)

__all__ = ["TargetBinding", "Router", "RouterThread"]


@dataclass
class TargetBinding:
    """One target worker and the draft worker that drafts for it.

    model: the name clients use in ``GenerateRequest.model`` (and ListModels shows).
    tokenizer: pack name or folder with the target's ``tokenizer.json`` (default: ``model``);
      the router decodes text with it (stop strings, streamed text).
    """

    model: str
    target: Endpoint
    draft: Endpoint | None = None
    draft_model: str | None = None
    tokenizer: str | Path | None = None


class Router:
    def __init__(
        self, bindings: Sequence[TargetBinding], config: RouterConfig | None = None, metrics: Metrics | None = None
    ):
        if not bindings:
            raise ValueError("the router needs at least one target worker")
        self.bindings = list(bindings)
        self.config = config or RouterConfig()
        self.metrics = metrics or Metrics()
        self.schedulers: list[TargetScheduler] = []
        self.targets: list[WorkerClient] = []
        self.drafts: list[WorkerClient | None] = []
        self.server: grpc.aio.Server | None = None
        self.port: int | None = None
        self.metrics_port: int | None = None
        self._detoks: dict[Path, Detokenizer] = {}

    # ---- lifecycle -----------------------------------------------------------------------------
    def _on_state(self, w: WorkerClient) -> None:
        self.metrics.worker_up.labels(w.role, w.name).set(1 if w.up else 0)
        if w.up and w.restarts:
            seen = getattr(w, "_restarts_seen", 0)
            if w.restarts > seen:
                self.metrics.worker_restarts.labels(w.role).inc(w.restarts - seen)
                w._restarts_seen = w.restarts

    def _detok(self, spec: str | Path) -> Detokenizer:
        path = resolve_model_dir(spec)
        if path not in self._detoks:
            self._detoks[path] = Detokenizer(path)
        return self._detoks[path]

    async def start(self, connect_timeout: float = 600.0) -> None:
        """Connect to every worker (targets must answer within ``connect_timeout``; a draft
        worker that does not is used once it does), then serve gRPC and /metrics."""
        cfg = self.config
        for b in self.bindings:
            self._detok(b.tokenizer or b.model)  # fail early on a missing tokenizer
            self.targets.append(WorkerClient(b.target, "target", on_state=self._on_state))
            self.drafts.append(WorkerClient(b.draft, "draft", on_state=self._on_state) if b.draft else None)
        for w in self.targets + [d for d in self.drafts if d is not None]:
            self.metrics.worker_up.labels(w.role, w.name).set(0)
        await asyncio.gather(*(t.connect(connect_timeout) for t in self.targets))

        async def connect_draft(d: WorkerClient) -> None:
            try:
                await d.connect(connect_timeout)
            except WorkerUnavailable as exc:
                log.warning("%s; serving without it (fail open) until it answers", exc)

        await asyncio.gather(*(connect_draft(d) for d in self.drafts if d is not None))
        for b, t, d in zip(self.bindings, self.targets, self.drafts):
            detok = self._detok(b.tokenizer or b.model)
            sched = TargetScheduler(b.model, t, d, cfg, self.metrics, detok.decode)
            sched.start()
            self.schedulers.append(sched)
        servicer = GenerationService(self)
        self.server, self.port = await start_aio_server(
            [(generate_pb2_grpc.add_GenerationServicer_to_server, servicer, SERVICE_NAME)], cfg.host, cfg.port
        )
        if cfg.metrics_port is not None:
            self.metrics_port = self.metrics.serve(cfg.metrics_host, cfg.metrics_port)
        log.info(
            "router serving specdec.v1.Generation on %s:%d (%d target worker(s))",
            cfg.host,
            self.port,
            len(self.targets),
        )

    async def stop(self, grace: float | None = None) -> None:
        """Stop accepting, let running requests finish (``grace`` s), end the rest as cancelled."""
        grace = self.config.grace_s if grace is None else grace
        if self.server is not None:
            await announce_aio_shutdown(self.server)  # flip health first: balancers stop sending
        await asyncio.gather(*(s.close(grace) for s in self.schedulers))
        if self.server is not None:
            await self.server.stop(1.0)
        for w in self.targets + [d for d in self.drafts if d is not None]:
            await w.close()
        self.metrics.close()

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.port}"

    # ---- routing -------------------------------------------------------------------------------
    def model_names(self) -> list[str]:
        return list(dict.fromkeys(b.model for b in self.bindings))

    def pick(self, model: str) -> TargetScheduler:
        """The least-loaded scheduler serving ``model`` ("" = the first model)."""
        name = model or self.bindings[0].model
        candidates = [s for s in self.schedulers if s.name == name]
        if not candidates:
            raise InvalidParams("model", f"unknown model {model!r}; this server has {', '.join(self.model_names())}")
        limit = self.config.recovery_timeout_s
        alive = [
            s
            for s in candidates
            if s.target.up or s.link.down_since is None or time.monotonic() - s.link.down_since < limit
        ]
        if not alive:
            raise RpcStatusError(grpc.StatusCode.UNAVAILABLE, f"no target worker for {name!r} is available")
        return alive[least_loaded([(not s.target.up, s.load) for s in alive])]

    def list_models(self) -> generate_pb2.ListModelsResponse:
        out = generate_pb2.ListModelsResponse()
        seen: dict[tuple[str, str], generate_pb2.ModelInfo] = {}
        rows = [(b.model, "target", t) for b, t in zip(self.bindings, self.targets)]
        rows += [
            (b.draft_model or b.draft.name, "draft", d) for b, d in zip(self.bindings, self.drafts) if d is not None
        ]
        for name, role, w in rows:
            info = w.info
            m = seen.get((name, role))
            if m is None:
                m = seen[(name, role)] = out.models.add(
                    name=name,
                    role=role,
                    dtype=info.dtype if info else "",
                    device=info.device if info else "",
                    max_context=info.max_context if info else 0,
                    ready=False,
                )
            m.ready = m.ready or w.up
        return out


class RouterThread:
    """A :class:`Router` on its own event loop in a daemon thread (for synchronous callers)."""

    def __init__(self, bindings: Sequence[TargetBinding], config: RouterConfig | None = None):
        self.router = Router(bindings, config)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="specdec-router", daemon=True)

    def start(self, connect_timeout: float = 600.0) -> RouterThread:
        self._thread.start()
        try:
            self.run(self.router.start(connect_timeout), timeout=connect_timeout + 30)
        except BaseException:
            self.stop(grace=0)
            raise
        return self

    def run(self, coro, timeout: float | None = None):
        """Run a coroutine on the router's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    @property
    def address(self) -> str:
        return self.router.address

    @property
    def metrics(self) -> Metrics:
        return self.router.metrics

    def stop(self, grace: float | None = None) -> None:
        if not self._thread.is_alive():
            return
        try:
            self.run(self.router.stop(grace), timeout=(grace or 0) + 60)
        except Exception:  # noqa: BLE001 - best effort on the way out
            log.exception("router stop failed")
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)

    def __enter__(self) -> RouterThread:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
