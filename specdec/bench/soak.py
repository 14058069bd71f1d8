"""`specdec bench serve --workload soak`: N minutes of mixed load on a running service, with memory
and KV slots sampled over time: what grows without bound, or never comes back, shows here.

Each of ``clients`` threads loops over: a whole completion, a stream read to its end, a stream
cancelled after its first chunks, a stream with a deadline too short to finish, and a request the
server refuses. Every ``sample_s`` seconds (and once the load has stopped and the service is idle):
the router's resident memory and open file descriptors, the running and queued requests, and each
worker's free KV slots (the router's ``/metrics``: ``specdec_process_*``,
``specdec_worker_free_slots``); and the worker processes' memory, through ``/proc`` when the
service runs on this machine (found under the process that listens on the server's port), else
from their own telemetry (``specdec_worker_rss_bytes``).
"""

from __future__ import annotations

import random
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import grpc
import psutil

from specdec.core.prompts import Prompt
from specdec.rpc.client import SpecdecClient
from specdec.rpc.client_credentials import ClientCredentials

__all__ = ["SoakOptions", "soak", "format_soak", "ACTIONS"]

# action -> share of the requests
ACTIONS = {"generate": 0.3, "stream": 0.25, "cancel": 0.2, "deadline": 0.15, "invalid": 0.1}


@dataclass
class SoakOptions:
    minutes: float = 5.0
    clients: int = 4
    max_tokens: int = 64
    sample_s: float = 15.0
    deadline_s: float = 0.3  # the "deadline" requests' deadline: shorter than a full completion
    timeout_s: float = 120.0
    seed: int = 0


def _metrics(url: str | None) -> dict[str, float]:
    if not url:
        return {}
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            text = resp.read().decode()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        if line.startswith("specdec_") and " " in line:
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def _local_processes(address: str) -> dict[str, psutil.Process]:
    """{"router": the process listening on the port, "target-N"/"draft-N": its worker actors} when
    the service runs on this machine; {} otherwise."""
    port = int(address.rsplit(":", 1)[1])
    try:
        pids = [c.pid for c in psutil.net_connections("tcp") if c.status == "LISTEN" and c.laddr.port == port]
    except psutil.Error:
        return {}
    if not pids or pids[0] is None:
        return {}
    router = psutil.Process(pids[0])
    found = {"router": router}
    counts = {"target": 0, "draft": 0}
    for p in router.children(recursive=True):
        try:
            title = " ".join(p.cmdline())
        except psutil.Error:
            continue
        for role, cls in (("target", "TargetWorker"), ("draft", "DraftWorker")):
            if f"ray::{cls}" in title:
                found[f"{role}-{counts[role]}"] = p
                counts[role] += 1
    return found


def _label(series: str, name: str) -> str:
    return series.split(f'{name}="', 1)[1].split('"', 1)[0]


def _sample(t0: float, url: str | None, procs: dict[str, psutil.Process], done: int) -> dict[str, Any]:
    m = _metrics(url)
    rss = {}
    for name, p in procs.items():
        try:
            rss[name] = round(p.memory_info().rss / 2**20, 1)
        except psutil.Error:
            rss[name] = None
    if "router" not in rss and "specdec_process_resident_memory_bytes" in m:
        rss["router"] = round(m["specdec_process_resident_memory_bytes"] / 2**20, 1)
    for key, value in m.items():  # the workers' own telemetry, when they are not on this machine
        if key.startswith("specdec_worker_rss_bytes{"):
            rss.setdefault(_label(key, "worker"), round(value / 2**20, 1))
    slots = {_label(k, "worker"): int(v) for k, v in m.items() if k.startswith("specdec_worker_free_slots{")}
    return {
        "t_s": round(time.monotonic() - t0, 1),
        "rss_mb": rss,
        "open_fds": m.get("specdec_process_open_fds"),
        "running": m.get("specdec_running_requests"),
        "queued": m.get("specdec_queue_depth"),
        "free_slots": slots,
        "requests_done": done,
    }


class _Load:
    def __init__(self, client: SpecdecClient, prompts: Sequence[Prompt], o: SoakOptions, encode):
        self.client, self.prompts, self.o, self.encode = client, prompts, o, encode
        self.lock = threading.Lock()
        self.outcomes: dict[str, dict[str, int]] = {a: {} for a in ACTIONS}
        self.done = 0

    def _prompt(self, rng: random.Random) -> dict[str, Any]:
        p = rng.choice(self.prompts)
        return {"prompt_token_ids": self.encode(p)} if self.encode else {"prompt": p.text}

    def one(self, rng: random.Random) -> None:
        action = rng.choices(list(ACTIONS), weights=list(ACTIONS.values()))[0]
        kw = dict(max_tokens=self.o.max_tokens, temperature=rng.choice([0.0, 0.8]), **self._prompt(rng))
        code = "OK"
        try:
            if action == "generate":
                self.client.generate(timeout=self.o.timeout_s, **kw)
            elif action == "stream":
                for _ in self.client.generate_stream(timeout=self.o.timeout_s, **kw):
                    pass
            elif action == "cancel":
                stream = self.client.generate_stream(timeout=self.o.timeout_s, **kw)
                for i, _ in enumerate(stream):
                    if i >= rng.randint(0, 3):
                        stream.close()  # cancels the call
                        code = "CANCELLED"
                        break
            elif action == "deadline":
                for _ in self.client.generate_stream(timeout=self.o.deadline_s, **kw):
                    pass
            else:
                self.client.generate(timeout=self.o.timeout_s, top_p=2.0, **kw)
        except grpc.RpcError as exc:
            code = exc.code().name
        with self.lock:
            self.outcomes[action][code] = self.outcomes[action].get(code, 0) + 1
            self.done += 1


def soak(
    address: str,
    prompts: Sequence[Prompt],
    options: SoakOptions,
    *,
    metrics_url: str | None = None,
    encode: Callable[[Prompt], list[int]] | None = None,
    credentials: ClientCredentials | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    progress = progress or (lambda msg: None)
    procs = _local_processes(address)
    progress(f"processes found on this machine: {', '.join(procs) or 'none (memory from /metrics only)'}")
    client = SpecdecClient(address, wait_ready=30.0, credentials=credentials)
    load = _Load(client, prompts, options, encode)
    t0 = time.monotonic()
    t_end = t0 + 60.0 * options.minutes
    samples = [_sample(t0, metrics_url, procs, 0)]

    def worker(i: int) -> None:
        rng = random.Random(options.seed * 1000 + i)
        while time.monotonic() < t_end:
            load.one(rng)

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(options.clients)]
    for t in threads:
        t.start()
    while time.monotonic() < t_end:
        time.sleep(max(0.0, min(options.sample_s, t_end - time.monotonic())))
        samples.append(_sample(t0, metrics_url, procs, load.done))
        progress(f"{samples[-1]['t_s']:.0f} s: {load.done} requests, RSS MiB {samples[-1]['rss_mb']}")
    for t in threads:  # the requests in flight finish
        t.join()
    # idle again: the router polls the workers' slots every rebalance.period_s (a second by default)
    time.sleep(12.0)
    samples.append(_sample(t0, metrics_url, procs, load.done))
    client.close()
    return {
        "address": address,
        "options": asdict(options),
        "outcomes": load.outcomes,
        "requests": load.done,
        "samples": samples,
    }


def format_soak(result: dict[str, Any]) -> str:
    samples = result["samples"]
    names = sorted({n for s in samples for n in s["rss_mb"]})
    slots = sorted({n for s in samples for n in s["free_slots"]})
    head = ["t_s", "done", "running", "queued", "fds"] + [f"rss:{n}" for n in names] + [f"free:{n}" for n in slots]
    rows = [head]
    for s in samples:
        rows.append(
            [str(s["t_s"]), str(s["requests_done"]), str(s["running"]), str(s["queued"]), str(s["open_fds"])]
            + [str(s["rss_mb"].get(n)) for n in names]
            + [str(s["free_slots"].get(n)) for n in slots]
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    lines.append("outcomes: " + "; ".join(f"{a} {o}" for a, o in result["outcomes"].items()))
    return "\n".join(lines)
