"""`specdec bench serve`: drive a running service and put the figures side by side.

Scenarios: closed loop with N concurrent clients (each sends its next request when the previous one
ends) and open loop with Poisson arrivals at a rate. Each scenario runs once per speculation mode
(default ``auto`` = the server's drafter, and ``off`` = plain decoding on the same service,
per-request), one after the other in the same run, so the ratios compare like with like. Requests
are greedy and streamed: TTFT is the first committed chunk, TPOT the mean gap per token after it.

When the router's ``/metrics`` is reachable, each scenario also reports where the round time went
(draft wait, verify, router), the mean draft length and c (draft time per token / verify time),
and the sequential bound tau / (k c + 1) from the measured tau. The single-process engine at batch
1 is passed in by the CLI (an object with ``one(prompt, max_tokens)``; it needs torch, which this
module never imports) and interleaved with the service's closed c=1 requests.

``apis`` (grpc, http): HTTP goes through the OpenAI-compatible gateway (specdec/bench/serve_http.py)
with the same prompts and settings; each result carries its ``api``, and an HTTP result beside a
gRPC one carries the gateway's overhead (latency p50 difference, per request and per streamed
chunk). At one client the APIs' requests alternate prompt by prompt; a closed loop of several
clients splits them between the APIs and runs them at once, so both see the same batches (run one
after the other, the machine's drift between the runs would swamp what the gateway adds).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

import grpc

from specdec.bench.serve_http import HttpRunner
from specdec.bench.serve_metrics import add_cost, phase_split, scrape, sum_splits
from specdec.bench.serve_report import add_engine_ratios, add_gateway_overhead, add_ratios
from specdec.bench.stats import percentile
from specdec.core.prompts import Prompt
from specdec.rpc.client import SpecdecClient
from specdec.rpc.client_credentials import ClientCredentials

log = logging.getLogger(__name__)

__all__ = ["BenchOptions", "BenchError", "bench_serve", "server_info", "summarize", "percentile"]


class BenchError(RuntimeError):
    pass


@dataclass
class BenchOptions:
    max_tokens: int = 128
    concurrency: tuple[int, ...] = (1,)
    rates: tuple[float, ...] = ()  # Poisson arrival rates (requests / s)
    requests: int | None = None  # per scenario; default one per prompt
    modes: tuple[str, ...] = ("auto", "off")
    warmup: bool = True
    seed: int = 0
    metrics_url: str | None = "auto"
    timeout: float = 600.0
    interleave: bool = True  # closed c=1: alternate the modes (and the engine) request by request
    apis: tuple[str, ...] = ("grpc",)  # grpc, http: the same scenarios through each
    http_url: str | None = None  # the gateway (http://HOST:PORT); None: the server's host, port 8000


def _ms(x: float | None) -> float | None:
    return None if x is None else round(1000.0 * x, 2)


# ---- one request -----------------------------------------------------------------------------


class _Runner:
    def __init__(
        self, client: SpecdecClient, options: BenchOptions, encode: Callable[[Prompt], list[int]] | None = None
    ):
        self.client = client
        self.options = options
        self.encode = encode
        self.chat_ok = True
        self._lock = threading.Lock()
        self._ids: dict[str, list[int]] = {}

    def _prompt_kwargs(self, prompt: Prompt) -> dict[str, Any]:
        """Token ids when the caller can tokenize (the same ids the engine sees, response prefix
        included), else the text with the chat flag (the server tokenizes)."""
        if self.encode is None:
            return {"prompt": prompt.text, "chat": self._chat(prompt)}
        with self._lock:
            ids = self._ids.get(prompt.id)
            if ids is None:
                ids = self._ids[prompt.id] = list(self.encode(prompt))
        return {"prompt_token_ids": ids}

    def _chat(self, prompt: Prompt) -> bool:
        return self.chat_ok if prompt.chat is None else prompt.chat

    def one(self, prompt: Prompt, mode: str, max_tokens: int | None = None) -> dict[str, Any]:
        rec: dict[str, Any] = {
            "id": prompt.id,
            "mode": mode,
            "api": "grpc",
            "t_start": time.perf_counter(),
            "t_first": None,
            "t_last": None,
            "t_chunks": [],
            "tokens": 0,
            "token_ids": [],
            "stats": None,
            "finish_reason": None,
            "error": None,
        }
        try:
            self._stream(prompt, mode, max_tokens or self.options.max_tokens, rec)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.FAILED_PRECONDITION and prompt.chat is None and self.chat_ok:
                with self._lock:
                    self.chat_ok = False  # the model has no chat template: send raw prompts
                return self.one(prompt, mode, max_tokens)
            rec["error"] = f"{exc.code().name}: {exc.details()}"
        rec["t_end"] = time.perf_counter()
        return rec

    def _stream(self, prompt: Prompt, mode: str, max_tokens: int, rec: dict) -> None:
        for ch in self.client.generate_stream(
            max_tokens=max_tokens,
            temperature=0.0,
            mode=mode,
            timeout=self.options.timeout,
            **self._prompt_kwargs(prompt),
        ):
            if ch.token_ids:
                rec["t_first"] = rec["t_first"] or ch.time
                rec["t_last"] = ch.time
                rec["t_chunks"].append(ch.time)
                rec["token_ids"].extend(ch.token_ids)
            if ch.finish_reason:
                rec["finish_reason"] = ch.finish_reason
                rec["stats"] = ch.stats
        rec["tokens"] = len(rec["token_ids"])


# ---- scenarios -------------------------------------------------------------------------------


def summarize(records: list[dict[str, Any]], wall: float) -> dict[str, Any]:
    ok = [r for r in records if not r.get("error")]
    tokens = sum(r["tokens"] for r in ok)
    ttft = [r["t_first"] - r["t_start"] for r in ok if r["t_first"] is not None]
    tpot = [
        (r["t_last"] - r["t_first"]) / (r["tokens"] - 1) for r in ok if r["tokens"] > 1 and r["t_first"] is not None
    ]
    latency = [r["t_end"] - r["t_start"] for r in ok if "t_end" in r]
    stats = [r["stats"] for r in ok if r.get("stats")]
    drafted = sum(s["drafted"] for s in stats)
    accepted = sum(s["accepted"] for s in stats)
    rounds = sum(s["rounds"] for s in stats)
    return {
        "requests": len(records),
        "errors": len(records) - len(ok),
        "tokens": tokens,
        "wall_s": round(wall, 3),
        "throughput_tok_s": round(tokens / wall, 3) if wall > 0 else None,
        "requests_per_s": round(len(ok) / wall, 4) if wall > 0 else None,
        "ttft_ms_p50": _ms(percentile(ttft, 50)),
        "ttft_ms_p99": _ms(percentile(ttft, 99)),
        "tpot_ms_p50": _ms(percentile(tpot, 50)),
        "tpot_ms_p99": _ms(percentile(tpot, 99)),
        "latency_s_p50": None if not latency else round(percentile(latency, 50), 3),
        "latency_s_p99": None if not latency else round(percentile(latency, 99), 3),
        "acceptance": round(accepted / drafted, 4) if drafted else None,
        "tau": round(tokens / rounds, 3) if rounds else None,  # tokens per round (per request)
        "k_mean": round(drafted / rounds, 3) if rounds else None,  # draft tokens per round (per request)
        "drafted": drafted,
        "accepted": accepted,
        "rounds": rounds,
        "fail_open_rounds": sum(s.get("fail_open_rounds", 0) for s in stats),
        "first_error": next((r["error"] for r in records if r.get("error")), None),
    }


def _closed_loop(runners: Sequence[Any], prompts: list[Prompt], n: int, clients: int, mode: str) -> tuple[list, float]:
    """``n`` requests from ``clients`` clients; client i sends through ``runners[i % len(runners)]``."""
    jobs = [prompts[i % len(prompts)] for i in range(n)]
    lock = threading.Lock()
    records: list[dict] = []

    def client_loop(runner) -> None:
        while True:
            with lock:
                if not jobs:
                    return
                prompt = jobs.pop(0)
            rec = runner.one(prompt, mode)
            with lock:
                records.append(rec)

    t0 = time.perf_counter()
    threads = [
        threading.Thread(target=client_loop, args=(runners[i % len(runners)],), daemon=True) for i in range(clients)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return records, time.perf_counter() - t0


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Arrival times (s from the start) of ``n`` Poisson arrivals at ``rate`` per second: the same
    ones for the same seed, here and in the capacity simulator's predictions of a run."""
    rng = random.Random(seed)
    arrivals, t = [], 0.0
    for _ in range(n):
        t += rng.expovariate(rate)
        arrivals.append(t)
    return arrivals


def _poisson(runner: _Runner, prompts: list[Prompt], n: int, rate: float, mode: str, seed: int) -> tuple[list, float]:
    arrivals = poisson_arrivals(n, rate, seed)
    t0 = time.perf_counter()

    def fire(i: int) -> dict:
        delay = t0 + arrivals[i] - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        return runner.one(prompts[i % len(prompts)], mode)

    with ThreadPoolExecutor(max_workers=max(1, n)) as pool:
        records = list(pool.map(fire, range(n)))
    return records, time.perf_counter() - t0


def _interleaved(
    runners: dict[str, Any], prompts: list[Prompt], n: int, modes: Sequence[str], engine: Any, url: str | None
) -> list[dict]:
    """Closed loop at c=1 with the modes and APIs (and the engine) alternating request by request, so
    a machine whose load drifts during the run biases none of them. Wall per (api, mode) = the sum of
    its requests' durations; the round split is scraped around each service request."""
    names: list[tuple[str | None, str]] = [(api, m) for m in modes for api in runners]
    if engine is not None:
        names.append((None, "engine"))
    max_tokens = next(iter(runners.values())).options.max_tokens
    recs: dict[tuple, list] = {name: [] for name in names}
    splits: dict[tuple, list] = {name: [] for name in names}
    for i in range(n):
        prompt = prompts[i % len(prompts)]
        for api, m in names:
            if api is None:
                recs[(api, m)].append(engine.one(prompt, max_tokens))
                continue
            before = scrape(url)
            recs[(api, m)].append(runners[api].one(prompt, m))
            splits[(api, m)].append((before, scrape(url)))
    out = []
    for api, m in names:
        wall = sum(r["t_end"] - r["t_start"] for r in recs[(api, m)])
        summary = summarize(recs[(api, m)], wall)
        if api is not None and url:
            summary["split"] = sum_splits(splits[(api, m)])
        out.append(
            {
                "scenario": "closed c=1",
                "kind": "closed",
                "x": 1,
                "mode": m,
                "api": api,
                "summary": summary,
                "records": recs[(api, m)],
                **({"config": engine.config} if api is None else {}),
            }
        )
    return out


def server_info(address: str, credentials: ClientCredentials | None = None) -> dict[str, Any]:
    """What the service serves (ListModels): target, draft, dtype, device."""
    with SpecdecClient(address, wait_ready=30.0, credentials=credentials) as client:
        try:
            models = client.list_models()
        except grpc.RpcError as exc:
            raise BenchError(f"{address}: ListModels failed: {exc.code().name}: {exc.details()}") from None
    targets = [m for m in models if m["role"] == "target"]
    drafts = [m for m in models if m["role"] == "draft"]
    if not targets:
        raise BenchError(f"{address} serves no target model")
    return {
        "address": address,
        "target": targets[0]["name"],
        "draft": drafts[0]["name"] if drafts else None,
        "dtype": targets[0]["dtype"],
        "device": targets[0]["device"],
        "models": models,
    }


def bench_serve(
    address: str,
    prompts: list[Prompt],
    options: BenchOptions,
    progress: Callable[[str], None] | None = None,
    engine: Any = None,
    encode: Callable[[Prompt], list[int]] | None = None,
    credentials: ClientCredentials | None = None,
) -> dict[str, Any]:
    """Run the scenarios. ``engine``: an object with ``one(prompt, max_tokens) -> record`` and a
    ``config`` dict (the single-process engine, run by the CLI), interleaved into closed c=1.
    ``encode``: prompt -> token ids with the target's tokenizer (sent as prompt_token_ids, so the
    service and the engine see the same ids); None sends the text (the server tokenizes)."""
    progress = progress or (lambda msg: None)
    if not prompts:
        raise BenchError("no prompts")
    if not options.apis or set(options.apis) - {"grpc", "http"}:
        raise BenchError(f"--api: grpc and/or http (got {','.join(options.apis)})")
    info = server_info(address, credentials)
    client = SpecdecClient(address, wait_ready=30.0, credentials=credentials)
    url = options.metrics_url
    if url == "auto":
        url = f"http://{address.rsplit(':', 1)[0]}:9400/metrics"
    elif url in ("none", ""):
        url = None
    if url and scrape(url) is None:
        progress(f"no router metrics at {url}: no time split")
        url = None
    runners = _runners(address, client, options, encode, credentials)
    n = options.requests or len(prompts)
    try:
        if options.warmup:
            progress("warm-up")
            for api, runner in runners.items():
                for mode in options.modes:
                    rec = runner.one(prompts[0], mode, max_tokens=8)
                    if api == "http" and rec["error"]:  # the gateway is not there: say so once, not per request
                        raise BenchError(f"{runner.url}: {rec['error']}")
        results = _scenarios(runners, prompts, n, options, engine, url, progress)
    finally:
        client.close()
        if "http" in runners:
            runners["http"].close()
    for r in results:
        add_cost(r["summary"])
    add_ratios(results, options.modes)
    add_engine_ratios(results)
    add_gateway_overhead(results)
    return {"server": info, "options": asdict(options), "results": results}


def _runners(
    address: str,
    client: SpecdecClient,
    options: BenchOptions,
    encode: Callable[[Prompt], list[int]] | None,
    credentials: ClientCredentials | None,
) -> dict[str, Any]:
    runners: dict[str, Any] = {}
    for api in options.apis:
        if api == "grpc":
            runners[api] = _Runner(client, options, encode)
        else:
            url = options.http_url or f"http://{address.rsplit(':', 1)[0]}:8000"
            runners[api] = HttpRunner(url, options, encode, credentials)
    return runners


def _scenarios(
    runners: dict[str, Any],
    prompts: list[Prompt],
    n: int,
    options: BenchOptions,
    engine: Any,
    url: str | None,
    progress: Callable[[str], None],
) -> list[dict]:
    scenarios = [("closed", c) for c in options.concurrency] + [("poisson", r) for r in options.rates]
    results = []
    for kind, x in scenarios:
        if kind == "closed" and x == 1 and options.interleave:
            progress(
                f"closed c=1, modes {', '.join(options.modes)}{' + engine' if engine else ''}, "
                f"api {', '.join(runners)} interleaved: {n} requests each"
            )
            _mark_gateway(runners)
            results.extend(_with_gateway_cost(runners, _interleaved(runners, prompts, n, options.modes, engine, url)))
            continue
        name = f"closed c={x}" if kind == "closed" else f"poisson {x}/s"
        shared = kind == "closed" and int(x) > 1 and len(runners) > 1
        for mode in options.modes:
            # (the APIs of a run, its runners): one run for all APIs when a closed loop shares them
            runs = [(list(runners), list(runners.values()))] if shared else [([a], [r]) for a, r in runners.items()]
            for apis, run_runners in runs:
                progress(f"{name}, mode {mode}, api {' + '.join(apis)}{' at once' if shared else ''}: {n} requests")
                before = scrape(url)
                _mark_gateway(runners, apis)
                if kind == "closed":
                    records, wall = _closed_loop(run_runners, prompts, n, int(x), mode)
                else:
                    records, wall = _poisson(run_runners[0], prompts, n, float(x), mode, options.seed)
                split = phase_split(before, scrape(url))
                gateway_cost = runners["http"].cost() if "http" in apis else None
                for api in apis:
                    own = [r for r in records if r["api"] == api]
                    summary = summarize(own, wall)
                    if split is not None:
                        summary["split"] = split  # the service's, for the run: shared by its APIs
                    if api == "http" and gateway_cost is not None:
                        summary["gateway_cost"] = gateway_cost  # measured inside the gateway
                    results.append(
                        {
                            "scenario": name,
                            "kind": kind,
                            "x": x,
                            "mode": mode,
                            "api": api,
                            "shared": shared,
                            "summary": summary,
                            "records": own,
                        }
                    )
    return results


def _mark_gateway(runners: dict[str, Any], apis: Sequence[str] | None = None) -> None:
    if "http" in runners and (apis is None or "http" in apis):
        runners["http"].mark()


def _with_gateway_cost(runners: dict[str, Any], results: list[dict]) -> list[dict]:
    """The gateway's own cost over an interleaved run, on its HTTP results (all modes together)."""
    cost = runners["http"].cost() if "http" in runners else None
    for r in results:
        if r["api"] == "http" and cost is not None:
            r["summary"]["gateway_cost"] = cost
    return results
