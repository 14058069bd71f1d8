"""`specdec bench serve --api http`: the same requests as the gRPC driver, through the OpenAI-compatible
gateway (streaming ``POST /v1/completions``, or ``/v1/chat/completions`` for a chat prompt sent as
text), so the two APIs can be compared in one run.

The records have the gRPC driver's shape (``t_start``, ``t_first``, ``t_last``, ``t_end``, ``tokens``,
...) so :func:`specdec.bench.serve.summarize` reads both alike. An HTTP stream carries text, not token
ids: ``tokens`` is the usage chunk's ``completion_tokens`` and ``token_ids`` is None.

The scenarios (closed loop, Poisson, interleaved) are the gRPC driver's, thread-based; every HTTP
request runs on one event loop with one async client (its connection pool), as an async service's
client would, and each thread waits on its own request's future.

The gateway's own cost is read from its ``/metrics`` (gateway/metrics.py) before and after each
scenario (:meth:`HttpRunner.mark`, :meth:`HttpRunner.cost`): the p50 and p99 of its work per request
and per chunk, measured inside it, since a round on a CPU takes far longer than the milliseconds the
HTTP - gRPC latency difference would have to resolve.
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
import threading
import time
from typing import TYPE_CHECKING, Any

import httpx

from specdec.core.prompts import Prompt
from specdec.rpc.client_credentials import ClientCredentials

if TYPE_CHECKING:
    from collections.abc import Callable

    from specdec.bench.serve import BenchOptions

__all__ = ["HttpRunner", "parse_gateway_metrics", "gateway_cost", "histogram_quantile"]

# The gateway's own-work histograms (gateway/metrics.py), as the cost's keys name them.
_OWN_WORK = {"specdec_gateway_request_seconds": "request", "specdec_gateway_chunk_seconds": "chunk"}

# httpx logs every request at INFO: thousands of lines would bury the benchmark's progress.
logging.getLogger("httpx").setLevel(logging.WARNING)


def parse_gateway_metrics(text: str) -> dict[str, Any]:
    """From the gateway's ``/metrics`` text: requests by (endpoint, status), and for each own-work
    histogram (``request``, ``chunk``) its cumulative bucket counts by upper bound and its count."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, Any] = {
        "requests": {},
        "request": {"buckets": {}, "count": 0.0},
        "chunk": {"buckets": {}, "count": 0.0},
    }
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "specdec_gateway_requests_total":
                out["requests"][(s.labels["endpoint"], s.labels["status"])] = s.value
            elif s.name.removesuffix("_bucket") in _OWN_WORK and s.name.endswith("_bucket"):
                out[_OWN_WORK[s.name.removesuffix("_bucket")]]["buckets"][float(s.labels["le"])] = s.value
            elif s.name.removesuffix("_count") in _OWN_WORK and s.name.endswith("_count"):
                out[_OWN_WORK[s.name.removesuffix("_count")]]["count"] = s.value
    return out


def histogram_quantile(q: float, buckets: dict[float, float]) -> float | None:
    """Prometheus's ``histogram_quantile`` over cumulative counts by upper bound: linear within the
    bucket the rank falls in; the highest finite bound when it falls past it; None with no counts."""
    bounds = sorted(buckets)
    total = buckets[bounds[-1]] if bounds else 0.0
    if total <= 0:
        return None
    rank, lower, below = q * total, 0.0, 0.0
    for upper in bounds:
        count = buckets[upper]
        if count >= rank:
            if upper == float("inf"):
                return lower
            return lower + (upper - lower) * ((rank - below) / (count - below) if count > below else 1.0)
        lower, below = upper, count
    return lower


def gateway_cost(before: dict[str, Any] | None, after: dict[str, Any] | None) -> dict[str, Any] | None:
    """The gateway's own work between two scrapes: ms p50 and p99 per request and per chunk, and how
    many of each it timed. None without both scrapes."""
    if before is None or after is None:
        return None
    out: dict[str, Any] = {}
    for what in ("request", "chunk"):
        b, a = before[what], after[what]
        delta = {le: n - b["buckets"].get(le, 0.0) for le, n in a["buckets"].items()}
        out[f"{what}s"] = int(a["count"] - b["count"])
        for q in (50, 99):
            x = histogram_quantile(q / 100, delta)
            out[f"ms_per_{what}_p{q}"] = None if x is None else round(1000 * x, 3)
    return out


def _tls(credentials: ClientCredentials) -> ssl.SSLContext | bool:
    if not (credentials.ca or credentials.cert):
        return True  # https:// URLs: the system's CAs
    ctx = ssl.create_default_context(cafile=credentials.ca)
    if credentials.cert:
        ctx.load_cert_chain(credentials.cert, credentials.key)
    return ctx


class HttpRunner:
    """``one(prompt, mode, max_tokens) -> record`` over the gateway at ``url`` (http://HOST:PORT)."""

    def __init__(
        self,
        url: str,
        options: BenchOptions,
        encode: Callable[[Prompt], list[int]] | None = None,
        credentials: ClientCredentials | None = None,
    ):
        self.url = url.rstrip("/")
        self.options = options
        self.encode = encode
        self.chat_ok = True
        self._lock = threading.Lock()
        self._ids: dict[str, list[int]] = {}
        self._mark: dict[str, Any] | None = None
        credentials = credentials or ClientCredentials()
        self._headers = {"authorization": f"Bearer {credentials.token}"} if credentials.token else {}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="bench-http", daemon=True)
        self._thread.start()
        # Pool as large as the most clients any scenario runs: no request waits for a connection.
        self._client = httpx.AsyncClient(
            timeout=options.timeout,
            verify=_tls(credentials),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
        )

    def scrape(self) -> dict[str, Any] | None:
        """The gateway's metrics now (None when it serves none: an older gateway)."""
        try:
            resp = asyncio.run_coroutine_threadsafe(
                self._client.get(self.url + "/metrics", headers=self._headers), self._loop
            ).result()
        except httpx.HTTPError:
            return None
        return parse_gateway_metrics(resp.text) if resp.status_code == 200 else None

    def mark(self) -> None:
        """Before a scenario: where the gateway's counts stand."""
        self._mark = self.scrape()

    def cost(self) -> dict[str, Any] | None:
        """After it: the gateway's own work since :meth:`mark` (:func:`gateway_cost`)."""
        return gateway_cost(self._mark, self.scrape())

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self._client.aclose(), self._loop).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def one(self, prompt: Prompt, mode: str, max_tokens: int | None = None) -> dict[str, Any]:
        rec = asyncio.run_coroutine_threadsafe(
            self._one(prompt, mode, max_tokens or self.options.max_tokens), self._loop
        ).result()
        if rec.pop("no_chat_template", False):
            with self._lock:
                self.chat_ok = False  # the model has no chat template: send raw prompts
            return self.one(prompt, mode, max_tokens)
        return rec

    def _path_and_body(self, prompt: Prompt) -> tuple[str, dict[str, Any]]:
        """The gRPC driver's choice: token ids when the caller can tokenize (the same ids as over gRPC,
        response prefix included), else the text, through the chat template when it is a chat prompt."""
        if self.encode is not None:
            with self._lock:
                ids = self._ids.get(prompt.id)
                if ids is None:
                    ids = self._ids[prompt.id] = list(self.encode(prompt))
            return "/v1/completions", {"prompt": ids}
        chat = self.chat_ok if prompt.chat is None else prompt.chat
        if chat:
            return "/v1/chat/completions", {"messages": [{"role": "user", "content": prompt.text}]}
        return "/v1/completions", {"prompt": prompt.text}

    async def _one(self, prompt: Prompt, mode: str, max_tokens: int) -> dict[str, Any]:
        path, body = self._path_and_body(prompt)
        body.update(
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            speculation={"mode": mode},
        )
        rec: dict[str, Any] = {
            "id": prompt.id,
            "mode": mode,
            "api": "http",
            "t_start": time.perf_counter(),
            "t_first": None,
            "t_last": None,
            "t_chunks": [],
            "tokens": 0,
            "token_ids": None,
            "stats": None,
            "finish_reason": None,
            "error": None,
        }
        try:
            async with self._client.stream("POST", self.url + path, json=body, headers=self._headers) as resp:
                if resp.status_code != 200:
                    err = _error(json.loads(await resp.aread() or b"{}"))
                    if err.get("code") == "failed_precondition" and prompt.chat is None and self.chat_ok:
                        rec["no_chat_template"] = True
                    rec["error"] = f"HTTP {resp.status_code}: {err.get('message')}"
                else:
                    await self._read(resp, rec)
        except (httpx.HTTPError, ValueError) as exc:
            rec["error"] = f"{type(exc).__name__}: {exc}"
        rec["t_end"] = time.perf_counter()
        return rec

    async def _read(self, resp: httpx.Response, rec: dict[str, Any]) -> None:
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue  # the blank line that ends each event
            now = time.perf_counter()
            data = line[len("data: ") :]
            if data == "[DONE]":
                return
            event = json.loads(data)
            if "error" in event:  # the status was sent already: the gateway reports it as an event
                rec["error"] = f"stream: {_error(event).get('message')}"
                return
            if event.get("usage"):
                rec["tokens"] = event["usage"]["completion_tokens"]
                rec["prompt_tokens"] = event["usage"]["prompt_tokens"]
            for choice in event.get("choices") or ():
                # one event per speculation round's committed tokens, as the gRPC stream's chunks
                rec["t_first"] = rec["t_first"] or now
                rec["t_last"] = now
                rec["t_chunks"].append(now)
                if choice.get("finish_reason"):
                    rec["finish_reason"] = choice["finish_reason"]


def _error(body: dict) -> dict:
    err = body.get("error")
    return err if isinstance(err, dict) else {"message": str(body)}
