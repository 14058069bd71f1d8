"""The router: worker clients, one scheduler per target worker, the public gRPC server, metrics.

The router receives *where* the workers are (:class:`TargetBinding`: endpoints — Ray actor
handles or fixed addresses — plus the model names); creating the workers is the launcher's job
(`cluster/`). It never imports torch, Ray, draft_worker or target_worker.

The draft workers named by the bindings form one pool shared by every target
(router/drafter_pool.py); a binding's drafter is its target's own only while the rebalancer is off
(``rebalance.enabled: false``, static pairing). Requests go to the target replica with the least
load per slot (router/target_choice.py:pick_target).

:class:`Router` lives on an asyncio loop (``await router.start()`` / ``await router.stop()``);
:class:`RouterThread` runs one on a background thread for synchronous callers (the launcher's
main thread, tests).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from router import clock
from router.autoscaler import Autoscaler, PoolActuator
from router.client_limit import ClientLimiter
from router.config import RouterConfig
from router.detok import Detokenizer, resolve_model_dir
from router.drafter_pool import DrafterPool
from router.metrics import Metrics
from router.retry import worker_recovery_estimate
from router.scheduler import TargetScheduler
from router.service import SERVICE_NAME, GenerationService
from router.target_choice import pick_target
from router.telemetry_loop import TelemetryLoop
from router.tokenizer_link import TokenizerMismatch, drafter_mismatch, fetch_detokenizer
from router.workers import Endpoint, WorkerClient, WorkerUnavailable
from specdec.core.tokenizer_spec import vocab_fingerprint
from specdec.rpc import generate_pb2, generate_pb2_grpc, tracing
from specdec.rpc.api_security import SecurityConfig
from specdec.rpc.errors import RpcStatusError
from specdec.rpc.server import announce_aio_shutdown, start_aio_server

log = logging.getLogger(__name__)

__all__ = ["TargetBinding", "Router", "RouterThread"]


@dataclass
class TargetBinding:
    """One target worker and its own draft worker (with the rebalancer on, a member of the pool
    every target drafts from).

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
    """``security``: TLS and bearer tokens on the public port (none by default; the calls to the
    workers carry the worker secret of this process's environment either way)."""

    def __init__(
        self,
        bindings: Sequence[TargetBinding],
        config: RouterConfig | None = None,
        metrics: Metrics | None = None,
        actuator: PoolActuator | None = None,
        security: SecurityConfig | None = None,
    ):
        if not bindings:
            raise ValueError("the router needs at least one target worker")
        self.bindings = list(bindings)
        self.config = config or RouterConfig()
        self.security = security or SecurityConfig()
        self.metrics = metrics or Metrics()
        self.schedulers: list[TargetScheduler] = []
        self.targets: list[WorkerClient] = []
        self.pool = DrafterPool(self.config, self.metrics)
        self.draft_models: dict[str, str] = {}  # drafter name -> model name (ListModels)
        self.telemetry = TelemetryLoop(
            lambda: self.targets + self.pool.clients, lambda: self.schedulers, self.config.rebalance, self.metrics
        )
        self.server: grpc.aio.Server | None = None
        self.port: int | None = None
        self.metrics_port: int | None = None
        self._detoks: dict[Path, Detokenizer] = {}
        self.target_fingerprints: dict[str, str] = {}  # target name -> tokenizer fingerprint
        self.refused: dict[str, str] = {}  # drafter name -> why (tokenizer mismatch)
        self.traced = False  # whether start() turned tracing on (specdec.rpc.tracing)
        self.draining: set[str] = set()  # target replicas taking no new requests (router/autoscaler.py)
        self.autoscaler = (
            Autoscaler(self, actuator, self.config.scaling) if actuator and self.config.scaling.enabled else None
        )

    # ---- lifecycle -----------------------------------------------------------------------------
    def _on_state(self, w: WorkerClient) -> None:
        if w.role == "draft" and w.up and w.info is not None:
            why = drafter_mismatch(w.info.tokenizer_fingerprint, w.name, self.target_fingerprints)
            if why is not None:  # checked at start-up and at every (re)join
                log.error("%s", why)
                self.refused[w.name] = why
                self.pool.remove(w.name)
                w.up = False
                asyncio.get_running_loop().create_task(w.close())
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

    async def _target_detok(self, b: TargetBinding, t: WorkerClient) -> Detokenizer:
        """A local tokenizer when the binding names one, else the target's own (GetTokenizer)."""
        if b.tokenizer is not None:
            detok = self._detok(b.tokenizer)
            fingerprint = vocab_fingerprint(detok.vocab())
        else:
            detok, fingerprint = await fetch_detokenizer(t, self.config.rpc_timeout_s)
        self.target_fingerprints[t.name] = fingerprint
        return detok

    async def start(self, connect_timeout: float = 600.0) -> None:
        """Connect to every worker (targets must answer within ``connect_timeout``; a draft
        worker that does not is used once it does), then serve gRPC and /metrics."""
        cfg = self.config
        self.traced = tracing.setup("specdec-router")
        for b in self.bindings:
            if b.tokenizer is not None:
                self._detok(b.tokenizer)  # fail early on a missing local tokenizer
            self.targets.append(WorkerClient(b.target, "target", on_state=self._on_state))
            if b.draft is not None and self.pool.client(b.draft.name) is None:
                self.pool.add(WorkerClient(b.draft, "draft", on_state=self._on_state))
                self.draft_models[b.draft.name] = b.draft_model or b.draft.name
        for w in self.targets + self.pool.clients:
            self.metrics.worker_up.labels(w.role, w.name).set(0)
        await asyncio.gather(*(t.connect(connect_timeout) for t in self.targets))
        detoks = [await self._target_detok(b, t) for b, t in zip(self.bindings, self.targets)]

        async def connect_draft(d: WorkerClient) -> None:
            try:
                await d.connect(connect_timeout)
            except WorkerUnavailable as exc:
                log.warning("%s; serving without it (fail open) until it answers", exc)

        await asyncio.gather(*(connect_draft(d) for d in self.pool.clients))
        for b, t, detok in zip(self.bindings, self.targets, detoks):
            home = b.draft.name if b.draft is not None else None
            sched = TargetScheduler(b.model, t, self.pool, home, cfg, self.metrics, detok.decode)
            sched.start()
            self.schedulers.append(sched)
        self.telemetry.start()
        if self.autoscaler is not None:
            self.autoscaler.start(cfg.rebalance.period_s)
        servicer = GenerationService(self)
        limiter = ClientLimiter(cfg.max_inflight_per_client, servicer.limited)
        self.server, self.port = await start_aio_server(
            [(generate_pb2_grpc.add_GenerationServicer_to_server, servicer, SERVICE_NAME)],
            cfg.host,
            cfg.port,
            on_refused=servicer.refused,
            options=cfg.connection_limits().server_options(),
            interceptors=[*self.security.aio_interceptors(servicer.denied), limiter],
            credentials=self.security.server_credentials(),
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
        await self.telemetry.stop()
        if self.autoscaler is not None:
            await self.autoscaler.stop()
        if self.server is not None:
            await self.server.stop(1.0)
        for w in self.targets + self.pool.clients:
            await w.close()
        self.metrics.close()
        if self.traced:
            self.traced = False
            await asyncio.to_thread(tracing.shutdown)  # exports the last spans; may wait on the collector

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.port}"

    # ---- pool membership (router/autoscaler.py) -------------------------------------------------
    async def add_target(self, endpoint: Endpoint, timeout: float) -> None:
        """A new target replica of the first model: connected, tokenizer checked, then routed to."""
        b0 = self.bindings[0]
        b = TargetBinding(model=b0.model, target=endpoint, tokenizer=b0.tokenizer)
        t = WorkerClient(endpoint, "target", on_state=self._on_state)
        try:
            await t.connect(timeout)
            detok = await self._target_detok(b, t)
        except BaseException:
            await t.close()
            raise
        ref = self.target_fingerprints.get(self.targets[0].name) if self.targets else None
        if ref is not None and self.target_fingerprints[t.name] != ref:
            del self.target_fingerprints[t.name]
            await t.close()
            raise TokenizerMismatch(f"target replica {t.name} has another tokenizer than {self.targets[0].name}")
        sched = TargetScheduler(b.model, t, self.pool, None, self.config, self.metrics, detok.decode)
        sched.start()
        self.bindings.append(b)
        self.targets.append(t)
        self.schedulers.append(sched)

    async def add_drafter(self, endpoint: Endpoint, timeout: float) -> None:
        """A new drafter in the shared pool (refused on a tokenizer mismatch when it comes up)."""
        d = WorkerClient(endpoint, "draft", on_state=self._on_state)
        self.draft_models[d.name] = next(iter(self.draft_models.values()), d.name)
        self.pool.add(d)
        try:
            await d.connect(timeout)
        except BaseException:
            self.pool.remove(d.name)
            await d.close()
            raise
        if d.name in self.refused:
            raise TokenizerMismatch(self.refused[d.name])

    def replica_busy(self, pool: str, name: str) -> bool:
        """Whether a draining replica still has work (requests queued or running; Proposes in flight)."""
        if pool == "target":
            return any(s.load > 0 for s in self.schedulers if s.target.name == name)
        return any(v.in_flight > 0 for v in self.pool.views() if v.name == name)

    async def remove_replica(self, pool: str, name: str) -> None:
        if pool == "draft":
            client = self.pool.client(name)
            self.pool.remove(name)
            if client is not None:
                await client.close()
            return
        for i, s in enumerate(self.schedulers):
            if s.target.name == name:
                del self.schedulers[i], self.targets[i], self.bindings[i]
                await s.close(self.config.grace_s)
                await s.target.close()
                break
        self.draining.discard(name)
        self.target_fingerprints.pop(name, None)

    # ---- routing -------------------------------------------------------------------------------
    def model_names(self) -> list[str]:
        return list(dict.fromkeys(b.model for b in self.bindings))

    def schedulers_for(self, model: str) -> list[TargetScheduler]:
        """The schedulers serving ``model`` ("" = the first model); NOT_FOUND listing the models."""
        name = model or self.bindings[0].model
        candidates = [s for s in self.schedulers if s.name == name]
        open_ = [s for s in candidates if s.target.name not in self.draining]
        candidates = open_ or candidates  # a draining replica serves only when it is the last one
        if not candidates:
            shown = model if len(model) <= 64 else model[:61] + "..."
            raise RpcStatusError(
                grpc.StatusCode.NOT_FOUND,
                f"model {shown!r} is not served here; models: {', '.join(self.model_names())}",
            )
        return candidates

    def pick(self, model: str) -> TargetScheduler:
        """The scheduler serving ``model`` ("" = the first model) that router/target_choice.py picks
        (least load per KV slot, saturated last); UNAVAILABLE with a recovery estimate when every
        target for it has been down past ``recovery_timeout_s``."""
        candidates = self.schedulers_for(model)
        limit = self.config.recovery_timeout_s
        now = clock.now()
        alive = [s for s in candidates if s.target.up or s.link.down_since is None or now - s.link.down_since < limit]
        if not alive:
            raise RpcStatusError(
                grpc.StatusCode.UNAVAILABLE,
                f"no target worker for {candidates[0].name!r} is available",
                retry_after=min(worker_recovery_estimate(s.target) for s in candidates),
            )
        route = pick_target([s.balance.view() for s in alive], self.config.target_choice)
        if route.around:
            self.metrics.rebalance_actions.labels("route_around").inc()
            log.info("route_around: skipped a saturated target; request to %s", alive[route.index].target.name)
        return alive[route.index]

    def list_models(self) -> generate_pb2.ListModelsResponse:
        out = generate_pb2.ListModelsResponse()
        seen: dict[tuple[str, str], generate_pb2.ModelInfo] = {}
        rows = [(b.model, "target", t) for b, t in zip(self.bindings, self.targets)]
        rows += [(self.draft_models.get(d.name, d.name), "draft", d) for d in self.pool.clients]
        for name, role, w in rows:
            info = w.info
            m = seen.get((name, role))
            if m is None:
                m = seen[(name, role)] = out.models.add(name=name, role=role, ready=False)
                if info is not None:
                    m.dtype, m.device, m.max_context, m.vocab_size = (
                        info.dtype,
                        info.device,
                        info.max_context,
                        info.vocab_size,
                    )
                    m.eos_token_ids.extend(info.eos_token_ids)
                    m.has_chat_template = role == "target" and info.has_chat_template
            m.ready = m.ready or w.up
        return out


class RouterThread:
    """A :class:`Router` on its own event loop in a daemon thread (for synchronous callers)."""

    def __init__(
        self,
        bindings: Sequence[TargetBinding],
        config: RouterConfig | None = None,
        actuator: PoolActuator | None = None,
        security: SecurityConfig | None = None,
    ):
        self.router = Router(bindings, config, actuator=actuator, security=security)
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
