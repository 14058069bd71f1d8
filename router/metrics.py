"""Prometheus metrics of the router (names prefixed ``specdec_``), in their own registry.

Served over HTTP at ``/metrics`` (default 127.0.0.1:9400) by :meth:`Metrics.serve`.

Series:

* ``specdec_requests_total{outcome,model}``: finished requests by outcome (stop, length, cancelled,
  deadline_exceeded, invalid_argument (requests that do not decode included), not_found,
  resource_exhausted (a client over its limit included), unauthenticated, unavailable, error).
  ``model`` is the served model's name, empty for a call turned away before its model was known
  (never the client's string: a client must not be able to add series).
* ``specdec_prompt_tokens_total``, ``specdec_generated_tokens_total``.
* Histograms by ``model``: ``specdec_time_to_first_token_seconds``,
  ``specdec_time_per_output_token_seconds``, ``specdec_request_duration_seconds`` (arrival to last
  token), ``specdec_queue_time_seconds`` (arrival to admission into a batch slot),
  ``specdec_prompt_tokens_per_request`` (each queued request),
  ``specdec_generation_tokens_per_request`` (each request that finished with stop or length).
* ``specdec_queue_depth`` (waiting for a batch slot), ``specdec_running_requests`` (gauges).
* ``specdec_rounds_total``, ``specdec_round_batch_size`` (histogram).
* ``specdec_drafted_tokens_total``, ``specdec_accepted_tokens_total``,
  ``specdec_drafted_tokens_by_position_total{position}``,
  ``specdec_accepted_tokens_by_position_total{position}`` (counters: ``rate(accepted) /
  rate(drafted)`` is the recent acceptance of a router, ``sum(rate(..)) / sum(rate(..))`` that of
  all), ``specdec_acceptance_rate`` (gauge: accepted / drafted since start; it cannot show a recent
  collapse).
* ``specdec_round_phase_seconds{phase}``: where a round's time goes: ``draft_wait`` (the round
  blocked on its drafts), ``verify`` (the Verify RPC, wall, of a round that only verifies), ``rpc``
  (gRPC and queueing part of the Verify call: wall minus the worker's own compute time when the
  worker reports it, see :data:`router.workers.COMPUTE_METADATA_KEY`; absent otherwise),
  ``prefill`` (the Verify RPC, wall, of a round whose forward also caches prompt tokens, and of a
  round of prompt chunks only), ``router`` (the rest: commit, stops, detokenisation), ``round``
  (the whole round).
* ``specdec_fail_open_rounds_total{reason}``: rounds verified with k = 0 because the draft was
  late (``deadline``) or its worker unavailable (``unavailable``).
* ``specdec_predraft_total{result}``: pre-drafts used (``hit``) or discarded (``miss``).
* ``specdec_worker_up{role,worker}`` (gauge), ``specdec_worker_restarts_total{role}``.
* Device telemetry, polled from every worker each ``rebalance.period_s`` (a series is absent while
  its field is not measured): ``specdec_device_utilization{worker,role,device,signal}`` with signal
  ``kernel`` (NVML: a kernel ran), ``memory`` (NVML memory controller), ``sm_active`` and
  ``sm_occupancy`` (GPM), ``busy`` (the worker's compute time / wall time);
  ``specdec_device_memory_used_bytes``, ``specdec_device_memory_total_bytes``,
  ``specdec_device_power_watts``, ``specdec_device_power_limit_watts`` (all
  ``{worker,role,device}``); ``specdec_worker_rss_bytes{worker,role}``,
  ``specdec_worker_threads{worker,role}``.
* Rebalancer: ``specdec_rebalance_actions_total{action}`` (draft_move, draft_failover, depth_deep,
  depth_normal, depth_shallow, spec_off, spec_on, k_cap: a round whose drafts were capped,
  plain_probe: a round decoded plainly to measure it, ngram_on / ngram_off: a request whose draft
  model is off starts or stops drafting by the router's n-gram, route_around),
  ``specdec_target_depth_level{worker}``
  (-1 shallow, 0 normal, 1 deep), ``specdec_drafter_step_seconds{worker}`` (measured seconds per
  draft step), ``specdec_draft_sequences_total{worker}`` (sequences drafted by each
  drafter: a draft worker, or ``ngram``, the router's own n-gram drafter).
* ``specdec_propose_compute_seconds`` (histogram: the draft worker's own compute per Propose of a
  round's drafts, as it reports it; pre-drafts and Proposes that prefill left out),
  ``specdec_propose_rpc_seconds`` (the same calls' wall time less that compute: gRPC,
  serialisation and the worker's scheduling, as the ``rpc`` round phase is for the Verify),
  ``specdec_propose_rows_total`` and ``specdec_propose_steps_total`` (their sequences, and their
  draft steps: the longest k of each call). `specdec profile --serve-json` reads them to price
  the simulated Propose and its RPC as the service's (cluster/planning/calibration.py).
* ``specdec_draft_prefill_compute_seconds`` (histogram: the draft worker's own compute per Prefill
  of prompt chunks, as it reports it) and ``specdec_draft_prefill_tokens_total`` (the tokens those
  calls cached); ``specdec_prefilling_propose_compute_seconds`` (the same per Propose that also
  prefills: a prompt's tail, a request catching up) with ``specdec_prefilling_propose_tokens_total``,
  ``_rows_total`` and ``_steps_total`` (the tokens it prefilled, its sequences and draft steps):
  what the service's draft prefill costs, for the simulator's.
* ``specdec_worker_free_slots{role,worker}``: the KV slots each worker reports free (its Info,
  polled every ``rebalance.period_s`` by router.telemetry_loop): a leak shows as a count that stays low
  when idle. ``specdec_worker_evictions_total{role,worker}``: the KV caches workers evicted (the
  growth of the count each reports in its Info; a restarted worker's count is new): a running
  request whose cache a worker had to give to a new one is recomputed from its tokens, which costs
  its whole context; the router frees finished requests' slots first, so this stays 0 while the
  router keeps up. ``specdec_worker_evicted{role,worker}`` (gauge: the worker's own count since it
  started) is deprecated and goes in the next release.
* ``specdec_build_info{version,python,grpc,torch}``: 1, labelled with the installed versions.
* ``specdec_process_*``: the router process's resident memory, CPU time and open file descriptors
  (prometheus_client's process collector).
"""

from __future__ import annotations

import logging

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
    start_http_server,
)

from router.build_info import build_versions

log = logging.getLogger(__name__)

__all__ = ["Metrics"]


_LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    1.5,
    2.0,
    3.0,
    5.0,
    10.0,
    30.0,
    60.0,
)
_DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
_LENGTH_BUCKETS = (1, 4, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
_MAX_POSITIONS = 16
_REBALANCE_ACTIONS = (
    "draft_move",
    "draft_failover",
    "depth_deep",
    "depth_normal",
    "depth_shallow",
    "spec_off",
    "spec_on",
    "k_cap",
    "plain_probe",
    "ngram_on",
    "ngram_off",
    "route_around",
)
# the outcomes a request of a known model can end with (unauthenticated calls have no model)
_MODEL_OUTCOMES = (
    "stop",
    "length",
    "cancelled",
    "deadline_exceeded",
    "invalid_argument",
    "resource_exhausted",
    "unavailable",
    "error",
)


def _set(gauge: Gauge, labels: tuple[str, ...], value: float | None) -> None:
    if value is not None:
        gauge.labels(*labels).set(value)
        return
    try:
        gauge.remove(*labels)
    except KeyError:
        pass


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        # ``model`` last: readers that match a series' text by its first label keep working
        self.requests = Counter("specdec_requests", "Finished requests by outcome", ["outcome", "model"], registry=r)
        self.prompt_tokens = Counter("specdec_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generated_tokens = Counter("specdec_generated_tokens", "Generated (committed) tokens", registry=r)
        self.ttft = Histogram(
            "specdec_time_to_first_token_seconds",
            "Time from arrival to the first token",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "specdec_time_per_output_token_seconds",
            "Mean time per output token after the first, per request",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.duration = Histogram(
            "specdec_request_duration_seconds",
            "Time from arrival to the last token",
            ["model"],
            buckets=_DURATION_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            "specdec_queue_time_seconds",
            "Time from arrival to admission into a batch slot",
            ["model"],
            buckets=(0.001, *_LATENCY_BUCKETS),
            registry=r,
        )
        self.prompt_len = Histogram(
            "specdec_prompt_tokens_per_request",
            "Prompt tokens of each admitted request",
            ["model"],
            buckets=_LENGTH_BUCKETS,
            registry=r,
        )
        self.generation_len = Histogram(
            "specdec_generation_tokens_per_request",
            "Tokens generated for each request that finished (stop or length)",
            ["model"],
            buckets=_LENGTH_BUCKETS,
            registry=r,
        )
        self.inter_token = Histogram(
            "specdec_inter_token_seconds",
            "Gap between two chunks of tokens streamed to a client",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.prefill_chunks = Counter("specdec_prefill_chunks", "Prompt chunks cached on the target", registry=r)
        self.round_tokens = Histogram(
            "specdec_round_tokens",
            "Tokens per round on the target: verify rows plus prompt chunks",
            buckets=(1, 4, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192),
            registry=r,
        )
        self.queue_depth = Gauge("specdec_queue_depth", "Requests waiting for a batch slot", registry=r)
        self.running = Gauge("specdec_running_requests", "Requests being decoded", registry=r)
        self.rounds = Counter("specdec_rounds", "Speculation rounds (one Verify per micro-batch)", registry=r)
        self.batch_size = Histogram(
            "specdec_round_batch_size", "Requests per round", buckets=_BATCH_BUCKETS, registry=r
        )
        self.preemptions = Counter(
            "specdec_preemptions",
            "Running requests that gave their KV slots up to a client below its fair share (and waited again)",
            registry=r,
        )
        self.recached = Counter(
            "specdec_recached_requests",
            "Running requests whose KV cache a target restart lost, cached again in chunks",
            registry=r,
        )
        self.tree_nodes = Histogram(
            "specdec_draft_tree_nodes",
            "Nodes of a token tree sent for verification (its depth counts as drafted tokens)",
            buckets=_BATCH_BUCKETS,
            registry=r,
        )
        self.drafted = Counter("specdec_drafted_tokens", "Draft tokens sent for verification", registry=r)
        self.accepted = Counter("specdec_accepted_tokens", "Draft tokens accepted by the target", registry=r)
        self.drafted_pos = Counter(
            "specdec_drafted_tokens_by_position",
            "Draft tokens sent, by position in the draft (0-based)",
            ["position"],
            registry=r,
        )
        self.accepted_pos = Counter(
            "specdec_accepted_tokens_by_position",
            "Draft tokens accepted, by position in the draft (0-based)",
            ["position"],
            registry=r,
        )
        self.acceptance = Gauge("specdec_acceptance_rate", "Accepted / drafted tokens since start", registry=r)
        self.phase = Histogram(
            "specdec_round_phase_seconds", "Round time by phase", ["phase"], buckets=_LATENCY_BUCKETS, registry=r
        )
        self.fail_open = Counter(
            "specdec_fail_open_rounds",
            "Request-rounds verified with k = 0 because the draft was late or its worker unavailable",
            ["reason"],
            registry=r,
        )
        self.predraft = Counter("specdec_predraft", "Pre-drafts used or discarded", ["result"], registry=r)
        self.draft_catch_up = Counter(
            "specdec_draft_catch_up",
            "Request-rounds verified without a draft while the drafter caught up (speculation back on)",
            registry=r,
        )
        self.worker_up = Gauge("specdec_worker_up", "1 while a worker answers", ["role", "worker"], registry=r)
        self.worker_restarts = Counter(
            "specdec_worker_restarts",
            "Workers that came back as a new process (their KV caches lost)",
            ["role"],
            registry=r,
        )
        dev = ["worker", "role", "device"]
        self.device_util = Gauge(
            "specdec_device_utilization", "Device busy share by signal", [*dev, "signal"], registry=r
        )
        self.device_mem = Gauge("specdec_device_memory_used_bytes", "Device memory in use", dev, registry=r)
        self.device_mem_total = Gauge("specdec_device_memory_total_bytes", "Device memory in total", dev, registry=r)
        self.device_power = Gauge("specdec_device_power_watts", "Device power draw", dev, registry=r)
        self.device_power_limit = Gauge("specdec_device_power_limit_watts", "Device power limit", dev, registry=r)
        self.worker_rss = Gauge(
            "specdec_worker_rss_bytes", "Worker process resident memory", ["worker", "role"], registry=r
        )
        self.worker_threads = Gauge("specdec_worker_threads", "Worker process threads", ["worker", "role"], registry=r)
        self.pool_replicas = Gauge(
            "specdec_pool_replicas",
            "Replicas per pool (state: serving, pending, draining)",
            ["pool", "state"],
            registry=r,
        )
        self.rebalance_actions = Counter(
            "specdec_rebalance_actions", "Actions taken by the rebalancer", ["action"], registry=r
        )
        self.depth_level = Gauge(
            "specdec_target_depth_level",
            "Depth level of a target (-1 shallow, 0 normal, 1 deep)",
            ["worker"],
            registry=r,
        )
        self.drafter_step = Gauge(
            "specdec_drafter_step_seconds",
            "Measured seconds per draft step (queueing included)",
            ["worker"],
            registry=r,
        )
        self.draft_sequences = Counter(
            "specdec_draft_sequences",
            "Sequences drafted, by draft worker (ngram: the router's own)",
            ["worker"],
            registry=r,
        )
        self.propose_compute = Histogram(
            "specdec_propose_compute_seconds",
            "Draft worker compute per Propose of a round's drafts (no pre-drafts, no prefills)",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.propose_rpc = Histogram(
            "specdec_propose_rpc_seconds",
            "Wall time of each timed Propose less the draft worker's compute",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.propose_rows = Counter("specdec_propose_rows", "Sequences in the timed Proposes", registry=r)
        self.propose_steps = Counter(
            "specdec_propose_steps", "Draft steps of the timed Proposes (the longest k of each)", registry=r
        )
        self.draft_prefill_compute = Histogram(
            "specdec_draft_prefill_compute_seconds",
            "Draft worker compute per Prefill of prompt chunks",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.draft_prefill_tokens = Counter(
            "specdec_draft_prefill_tokens", "Prompt tokens the draft workers' Prefills cached", registry=r
        )
        self.prefilling_propose_compute = Histogram(
            "specdec_prefilling_propose_compute_seconds",
            "Draft worker compute per Propose that also prefills (a prompt's tail, catching up)",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.prefilling_propose_tokens = Counter(
            "specdec_prefilling_propose_tokens", "Tokens the prefilling Proposes prefilled", registry=r
        )
        self.prefilling_propose_rows = Counter(
            "specdec_prefilling_propose_rows", "Sequences in the prefilling Proposes", registry=r
        )
        self.prefilling_propose_steps = Counter(
            "specdec_prefilling_propose_steps", "Draft steps of the prefilling Proposes (the longest k)", registry=r
        )
        self.worker_free_slots = Gauge(
            "specdec_worker_free_slots", "KV-cache slots a worker reports free", ["role", "worker"], registry=r
        )
        # deprecated (a cumulative count as a gauge: rate() cannot use it); kept for one release
        self.worker_evicted = Gauge(
            "specdec_worker_evicted", "KV caches a worker evicted since it started", ["role", "worker"], registry=r
        )
        self.worker_evictions = Counter(
            "specdec_worker_evictions",
            "KV caches workers evicted (from the counts they report)",
            ["role", "worker"],
            registry=r,
        )
        self.build_info = Gauge(
            "specdec_build_info",
            "Versions the router runs (always 1)",
            ["version", "python", "grpc", "torch"],
            registry=r,
        )
        self.build_info.labels(*build_versions()).set(1)
        ProcessCollector(namespace="specdec", registry=r)
        for role in ("target", "draft"):  # at 0 from the start: increase() sees the first restart
            self.worker_restarts.labels(role)
        for action in _REBALANCE_ACTIONS:  # the same for the rebalancer's actions (the autoscaler's come as used)
            self.rebalance_actions.labels(action)
        # every position's series exists from the start (at 0), and a round increments them without
        # looking its labels up
        self._drafted_at = [self.drafted_pos.labels(str(j)) for j in range(_MAX_POSITIONS)]
        self._accepted_at = [self.accepted_pos.labels(str(j)) for j in range(_MAX_POSITIONS)]
        self._evicted_seen: dict[tuple[str, str], int] = {}
        self._drafted_n = 0
        self._accepted_n = 0
        self._server = None
        self._thread = None
        self.port: int | None = None

    # ---- recording helpers -------------------------------------------------------------------
    def add_model(self, model: str) -> None:
        """Create a served model's request series at 0, so that PromQL over them (error ratios,
        quantiles, the alert rules) has a series before the first request of each outcome."""
        for outcome in _MODEL_OUTCOMES:
            self.requests.labels(outcome, model)
        for h in (self.ttft, self.tpot, self.duration, self.queue_time, self.prompt_len, self.generation_len):
            h.labels(model)

    def record_propose(self, compute_s: float, wall_s: float, rows: int, steps: int) -> None:
        self.propose_compute.observe(compute_s)
        self.propose_rpc.observe(max(0.0, wall_s - compute_s))
        self.propose_rows.inc(rows)
        self.propose_steps.inc(steps)

    def record_draft_prefill(self, compute_s: float, tokens: int) -> None:
        self.draft_prefill_compute.observe(compute_s)
        self.draft_prefill_tokens.inc(tokens)

    def record_prefilling_propose(self, compute_s: float, rows: int, steps: int, tokens: int) -> None:
        self.prefilling_propose_compute.observe(compute_s)
        self.prefilling_propose_rows.inc(rows)
        self.prefilling_propose_steps.inc(steps)
        self.prefilling_propose_tokens.inc(tokens)

    def record_draft(self, drafted: int, accepted: int, tree_nodes: int | None = None) -> None:
        """A verified draft: `drafted` tokens deep (a chain's length, a tree's depth), `accepted` of
        them taken; a tree's nodes too."""
        if tree_nodes is not None:
            self.tree_nodes.observe(tree_nodes)
        if drafted <= 0:
            return
        self._drafted_n += drafted
        self._accepted_n += accepted
        self.drafted.inc(drafted)
        self.accepted.inc(accepted)
        for c in self._drafted_at[:drafted]:
            c.inc()
        for c in self._accepted_at[:accepted]:
            c.inc()
        self.acceptance.set(self._accepted_n / self._drafted_n)

    def record_evicted(self, role: str, worker: str, evicted: int) -> None:
        """A worker's reported eviction count (cumulative since it started): the gauge shows it,
        the counter grows by what is new. A count lower than the last one is a restarted worker,
        whose whole count is new."""
        key = (role, worker)
        last = self._evicted_seen.get(key)
        self._evicted_seen[key] = evicted
        new = evicted if last is None or evicted < last else evicted - last
        counter = self.worker_evictions.labels(role, worker)  # the series exists from the first poll, at 0
        if new > 0:
            counter.inc(new)
        self.worker_evicted.labels(role, worker).set(evicted)

    def record_device(self, worker: str, role: str, s) -> None:
        """Set the device series from a :class:`specdec.rpc.telemetry.DeviceSample` (a field not
        measured removes its series: absent, not zero)."""
        dev = (worker, role, s.device)
        signals = {
            "kernel": s.utilization,
            "memory": s.memory_utilization,
            "sm_active": s.sm_active,
            "sm_occupancy": s.sm_occupancy,
            "busy": s.busy,
        }
        for signal, v in signals.items():
            _set(self.device_util, (*dev, signal), v)
        _set(self.device_mem, dev, s.memory_used_bytes)
        _set(self.device_mem_total, dev, s.memory_total_bytes)
        _set(self.device_power, dev, s.power_w)
        _set(self.device_power_limit, dev, s.power_limit_w)
        _set(self.worker_rss, (worker, role), s.rss_bytes)
        _set(self.worker_threads, (worker, role), s.threads)

    def sample(self, name: str, labels: dict[str, str] | None = None) -> float | None:
        """Current value of a series (for tests and the benchmark), summed over the labels not
        given (e.g. every ``model``); None when no series matches."""
        want = (labels or {}).items()
        found = [
            s.value
            for family in self.registry.collect()
            for s in family.samples
            if s.name == name and want <= s.labels.items()
        ]
        return sum(found) if found else None

    def text(self) -> bytes:
        return generate_latest(self.registry)

    # ---- HTTP --------------------------------------------------------------------------------
    def serve(self, host: str = "127.0.0.1", port: int = 9400) -> int:
        """Serve /metrics over HTTP in a daemon thread; returns the bound port."""
        self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        self.port = self._server.server_address[1]
        log.info("metrics on http://%s:%d/metrics", host, self.port)
        return self.port

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
