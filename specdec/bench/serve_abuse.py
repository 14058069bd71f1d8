"""`specdec bench serve --workload abuse`: heavy and hostile load from one client beside another
client's short request, against one running service, each figure beside the same one on the idle
service (docs/results.md, "Heavy and hostile load").

Scenarios, one after the other:

* **wall**: client B's short request (``victim_tokens``) on the idle service; then client A sends
  ``long_prompts`` prompts of ``long_tokens`` tokens at once and B the same short request
  ``victim_after_s`` later. B's time to first token and total, idle and behind the wall; A's
  total for all of its prompts; the router's preemptions meanwhile (``specdec_preemptions_total``).
* **reference** (when the caller passes one: the CLI's ``--engine``): the same prompts, each
  prefilled in one forward in this process, after the service scenarios (the machine's cores
  run one or the other, never both); A's total over it is the chunked prefill's cost.
* **burst**: B sends ``burst`` calls at once on one channel (one HTTP/2 connection): the count of
  each status, and whether every RESOURCE_EXHAUSTED carried a RetryInfo.
* **unread**: ``unread_streams`` streams that take their first chunk and read nothing more for
  ``unread_wait_s`` (a 1 KB flow-control window, so the server's writes block), then read on: the
  status each call ends with as the client sees it; given the server's log, their access lines by
  status and the ERROR lines the scenario left (the wait ends once every access line is there).
* **restart** (when the caller passes a target worker's pid: the CLI's ``--kill-target``): long
  streams, undisturbed and then with the target killed mid-stream (specdec/bench/serve_restart.py).

Who is who: the router tells clients apart by bearer token, else by peer address without the port
(router/client_limit.py). Every client here runs in this process, so without a token of its own
(``abuse_credentials``) A is the same client as B and no fair share can separate them: the result
says so (``same_client``). A server without token auth still keys clients by the token they send.

The prompts are the prompt set's text, tokenized by the server (Tokenize) and cut to exactly
``long_tokens`` ids; prompt i starts at the set's prompt i, so no two share a prefix while there
are no more of them than prompts in the set.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import grpc

from specdec.bench.serve_abuse_report import (
    access_statuses,
    add_ratios,
    burst_summary,
    error_lines,
    preemptions,
)
from specdec.bench.serve_restart import RestartOptions, restart_scenario
from specdec.core.prompts import Prompt
from specdec.rpc import generate_pb2_grpc
from specdec.rpc.client import SpecdecClient, build_request
from specdec.rpc.client_credentials import ClientCredentials
from specdec.rpc.client_errors import from_rpc_error
from specdec.rpc.grpc_options import channel_options

__all__ = ["AbuseOptions", "bench_abuse", "wall_prompts"]

# A stream's receive window that never grows: once the client stops reading, the server's writes
# block after about 1 KB (the way tests/integration/test_security.py's not-reading client does it).
_SMALL_WINDOW = [("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)]
_PROGRESS_S = 15.0


@dataclass
class AbuseOptions:
    long_prompts: int = 8
    long_tokens: int = 4000
    long_max_tokens: int = 1  # the wall's time is then its prefill: what the reference measures
    victim_tokens: int = 16
    victim_after_s: float = 3.0
    burst: int = 200
    burst_tokens: int = 4
    unread_streams: int = 4
    unread_tokens: int = 900  # far more output than the window holds
    # For the server to end the never-reading streams: its write bound (30 s) runs from when a write
    # blocks, after the transport's buffers filled, so the calls end later (60 s on SmolLM2); with
    # the server's log the wait ends as soon as their access lines are there.
    unread_wait_s: float = 120.0
    timeout: float = 1800.0  # per request
    warmup: bool = True

    def check(self) -> None:
        """ValueError naming the flag when a value cannot work."""
        for flag, value in (
            ("--long-prompts", self.long_prompts),
            ("--long-tokens", self.long_tokens),
            ("--burst", self.burst),
            ("--unread-streams", self.unread_streams),
            ("--unread-tokens", self.unread_tokens),
        ):
            if value < 1:
                raise ValueError(f"{flag} must be at least 1 (got {value})")
        for flag, seconds in (
            ("--victim-after", self.victim_after_s),
            ("--unread-wait", self.unread_wait_s),
            ("--timeout", self.timeout),
        ):
            if not seconds > 0:
                raise ValueError(f"{flag} must be above 0 s (got {seconds})")


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def wall_prompts(
    tokenize: Callable[[str], list[int]], prompts: Sequence[Prompt], n: int, length: int
) -> list[list[int]]:
    """``n`` prompts of exactly ``length`` token ids: the set's texts in turn, prompt i from the
    set's i-th on, each text tokenized once."""
    if not prompts:
        raise ValueError("no prompts")
    ids_of: dict[int, list[int]] = {}
    out = []
    for i in range(n):
        ids: list[int] = []
        j = i
        while len(ids) < length:
            k = j % len(prompts)
            if k not in ids_of:
                ids_of[k] = tokenize(prompts[k].text)
                if not ids_of[k]:
                    raise ValueError(f"prompt {prompts[k].id} has no tokens")
            ids.extend(ids_of[k])
            j += 1
        out.append(ids[:length])
    return out


def _stream(client: SpecdecClient, ids: list[int], max_tokens: int, timeout: float, rec: dict[str, Any]) -> None:
    """One greedy streamed request; ``rec`` fills as it goes (other threads read it)."""
    rec.update(t_start=time.perf_counter(), t_first=None, tokens=0, error=None)
    try:
        for ch in client.generate_stream(
            prompt_token_ids=ids, max_tokens=max_tokens, temperature=0.0, ignore_eos=True, timeout=timeout
        ):
            if ch.token_ids:
                rec["t_first"] = rec["t_first"] or ch.time
                rec["tokens"] += len(ch.token_ids)
    except grpc.RpcError as exc:
        rec["error"] = f"{exc.code().name}: {exc.details()}"
    rec["t_end"] = time.perf_counter()


def _victim(rec: dict[str, Any]) -> dict[str, Any]:
    return {
        "ttft_s": _r(rec["t_first"] - rec["t_start"]) if rec.get("t_first") else None,
        "total_s": _r(rec["t_end"] - rec["t_start"]) if "t_end" in rec else None,
        "tokens": rec.get("tokens", 0),
        "error": rec.get("error"),
    }


def _wall(
    a: SpecdecClient,
    b: SpecdecClient,
    wall_ids: list[list[int]],
    victim_ids: list[int],
    o: AbuseOptions,
    progress: Callable[[str], None],
) -> dict[str, Any]:
    longs: list[dict[str, Any]] = [{} for _ in wall_ids]
    victim: dict[str, Any] = {}
    threads = [
        threading.Thread(target=_stream, args=(a, ids, o.long_max_tokens, o.timeout, longs[i]), daemon=True)
        for i, ids in enumerate(wall_ids)
    ]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    time.sleep(o.victim_after_s)
    threads.append(threading.Thread(target=_stream, args=(b, victim_ids, o.victim_tokens, o.timeout, victim)))
    threads[-1].start()
    t_next = t0 + _PROGRESS_S
    while any(t.is_alive() for t in threads):
        time.sleep(0.1)
        if time.perf_counter() >= t_next:
            t_next += _PROGRESS_S
            done = sum("t_end" in r for r in longs)
            v = "done" if "t_end" in victim else "has its first token" if victim.get("t_first") else "waits"
            progress(f"wall: {done}/{len(longs)} of A's prompts done after {time.perf_counter() - t0:.0f} s; B {v}")
    ends = [r["t_end"] for r in longs]
    firsts = [r["t_first"] - t0 for r in longs if r.get("t_first")]
    errors = [r["error"] for r in longs if r.get("error")]
    return {
        "a_total_s": _r(max(ends) - t0),
        "a_first_token_s_max": _r(max(firsts, default=None)),
        "a_errors": len(errors),
        "a_first_error": errors[0] if errors else None,
        "victim": _victim(victim),
    }


def _burst(client: SpecdecClient, ids: list[int], o: AbuseOptions) -> dict[str, Any]:
    """``o.burst`` Generate calls at once on the client's one channel."""
    request = build_request(prompt_token_ids=ids, max_tokens=o.burst_tokens, ignore_eos=True, temperature=0.0)
    t0 = time.perf_counter()
    futures = [client.stub.Generate.future(request, timeout=o.timeout) for _ in range(o.burst)]
    outcomes = []
    for f in futures:
        exc = f.exception()
        if exc is None:
            outcomes.append(("OK", False))
        else:
            outcomes.append((exc.code().name, from_rpc_error(exc).retry_delay is not None))
    return burst_summary(outcomes) | {"wall_s": _r(time.perf_counter() - t0)}


class _Log:
    """The server's log file (None: not given): its size now, and the lines written since a size."""

    def __init__(self, path: str | None):
        self.path = path

    def size(self) -> int:
        if not self.path:
            return 0
        with open(self.path, "rb") as f:
            return f.seek(0, 2)

    def lines_since(self, at: int) -> list[str]:
        if not self.path:
            return []
        with open(self.path, "rb") as f:
            f.seek(at)
            return f.read().decode(errors="replace").splitlines()


def _unread(
    address: str, credentials: ClientCredentials, ids: list[int], o: AbuseOptions, log: _Log, progress
) -> dict[str, Any]:
    """Streams that read one chunk and no more; the statuses they end with, on both sides."""
    nonce = uuid.uuid4().hex[:8]
    request_ids = [f"abuse-unread-{nonce}-{i}" for i in range(o.unread_streams)]
    at = log.size()
    channel = credentials.channel(address, channel_options(64 << 20) + _SMALL_WINDOW)
    try:
        stub = generate_pb2_grpc.GenerationStub(channel)
        calls = []
        for rid in request_ids:
            req = build_request(
                prompt_token_ids=ids, max_tokens=o.unread_tokens, ignore_eos=True, mode="off", request_id=rid
            )
            calls.append(stub.GenerateStream(req, timeout=o.unread_wait_s + o.timeout))
        first_read = 0
        for call in calls:
            try:
                next(call)
                first_read += 1
            except (grpc.RpcError, StopIteration):
                pass
        progress(f"unread: {len(calls)} streams took a chunk and stopped reading; waiting for the server to end them")
        # The client learns a call's status only once it has read what is buffered before it, so the
        # bench waits (for the calls' access lines when it has the log, else the whole wait) and then
        # reads on: a call the server ended gives its status, one it left running streams to its end (OK).
        lines: list[str] = []
        t_end = time.perf_counter() + o.unread_wait_s
        while time.perf_counter() < t_end:
            lines = log.lines_since(at)
            if log.path and sum(access_statuses(lines, request_ids).values()) >= len(request_ids):
                break
            time.sleep(0.2)
        statuses: dict[str, int] = {}
        for call in calls:
            try:
                for _ in call:
                    pass
                name = "OK"
            except grpc.RpcError as exc:
                name = exc.code().name
            statuses[name] = statuses.get(name, 0) + 1
    finally:
        channel.close()
    out: dict[str, Any] = {"streams": len(calls), "first_chunk_read": first_read, "client_status": statuses}
    if log.path:
        out["server_status"] = access_statuses(lines, request_ids)
        out["server_error_lines"] = error_lines(log.lines_since(at))
    return out


def bench_abuse(
    address: str,
    prompts: Sequence[Prompt],
    options: AbuseOptions,
    *,
    credentials: ClientCredentials | None = None,
    abuse_credentials: ClientCredentials | None = None,
    metrics_url: str | None = None,
    server_log: str | None = None,
    reference: Callable[[list[list[int]]], dict[str, Any]] | None = None,
    restart: tuple[int, RestartOptions] | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """The scenarios against the service at ``address``. ``credentials``: client B's (and the
    burst's and the unread streams'); ``abuse_credentials``: client A's (None: B's, so the router
    sees one client). ``reference(prompts)``: each prefilled in one forward (the CLI passes
    specdec.bench.runner.unchunked_prefills); None: no ratio. ``restart``: (a local target worker's
    pid, the restart scenario's options); None: no restart scenario."""
    options.check()
    progress = progress or (lambda msg: None)
    credentials = credentials or ClientCredentials.load()
    abuse_credentials = abuse_credentials or credentials
    log = _Log(server_log)
    start = log.size()  # the whole run's ERROR lines count from here
    result: dict[str, Any] = {
        "address": address,
        "options": asdict(options),
        "same_client": abuse_credentials.token == credentials.token,
    }
    if result["same_client"]:
        progress("A and B send the same token (or none): the router sees one client (--abuse-token-file: A's own)")
    with (
        SpecdecClient(address, wait_ready=30.0, credentials=credentials) as b,
        SpecdecClient(address, wait_ready=30.0, credentials=abuse_credentials) as a,
    ):
        victim_ids = b.tokenize(prompts[0].text).token_ids
        wall_ids = wall_prompts(
            lambda text: b.tokenize(text).token_ids, prompts, options.long_prompts, options.long_tokens
        )
        if options.warmup:
            _stream(b, victim_ids, options.victim_tokens, options.timeout, {})
        progress(f"idle: B's request of {options.victim_tokens} tokens")
        idle: dict[str, Any] = {}
        _stream(b, victim_ids, options.victim_tokens, options.timeout, idle)
        progress(
            f"wall: A sends {options.long_prompts} prompts of {options.long_tokens} tokens, "
            f"B its request {options.victim_after_s:g} s later"
        )
        before = preemptions(metrics_url)
        if metrics_url and before is None:
            progress(f"no router metrics at {metrics_url}: no preemption count")
        wall = _wall(a, b, wall_ids, victim_ids, options, progress)
        after = preemptions(metrics_url)
        wall["victim_idle"] = _victim(idle)
        wall["preemptions"] = None if before is None or after is None else int(after - before)
        result["wall"] = wall
        progress(f"burst: {options.burst} calls at once on one channel")
        result["burst"] = _burst(b, victim_ids, options)
    progress(f"unread: {options.unread_streams} streams that never read")
    result["unread"] = _unread(address, credentials, victim_ids, options, log, progress)
    if restart is not None:
        pid, ro = restart
        with SpecdecClient(address, wait_ready=30.0, credentials=credentials) as b:
            ids = wall_prompts(lambda text: b.tokenize(text).token_ids, prompts, ro.streams, ro.tokens)
            result["restart"] = restart_scenario(b, ids, pid, ro, progress)
    result["server_error_lines"] = error_lines(log.lines_since(start)) if server_log else None
    if reference is not None:
        progress(f"reference: the same {len(wall_ids)} prompts, each in one forward, in this process")
        result["reference"] = reference(wall_ids)
    add_ratios(result)
    return result
