"""`specdec bench serve --workload mixed`: long-prompt arrivals among short streams.

Short greedy streams run closed loop; once every stream is decoding, a burst of long prompts
arrives at once. Measured per server: the streams' gaps between chunks while the burst is being
prefilled (p50, p99, max), the burst's time to first token and time to finish, and the streams'
tokens (compared across servers: they must not change). Several servers (for example the same
service with the round budget on and off) are measured in turn, ``repeat`` times, alternating, so
load drift on the machine biases none of them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from specdec.bench.stats import percentile
from specdec.core.prompts import Prompt
from specdec.rpc.client import SpecdecClient
from specdec.rpc.client_credentials import ClientCredentials

__all__ = ["MixedOptions", "bench_mixed", "format_mixed"]


@dataclass
class MixedOptions:
    streams: int = 1  # concurrent short streams
    stream_tokens: int = 256  # max_tokens of a short stream (it keeps streaming through the burst)
    long_prompts: int = 4
    long_tokens: int = 3000  # prompt length of each long request
    long_max_tokens: int = 8
    repeat: int = 1
    timeout: float = 900.0


def _long_prompt(encode: Callable[[Prompt], list[int]], prompts: Sequence[Prompt], n: int, salt: int) -> list[int]:
    """``n`` prompt token ids made of the prompt set's own text (distinct per request: no shared prefix)."""
    ids: list[int] = []
    i = salt
    while len(ids) < n:
        ids.extend(encode(prompts[i % len(prompts)]))
        i += 1
    return ids[:n]


def _stream(client: SpecdecClient, ids: list[int], max_tokens: int, timeout: float, rec: dict[str, Any]) -> None:
    """One greedy streamed request; ``rec`` fills as chunks arrive (readable from other threads)."""
    rec.update(t_start=time.perf_counter(), times=[], token_ids=[], error=None)
    try:
        for ch in client.generate_stream(
            prompt_token_ids=ids, max_tokens=max_tokens, temperature=0.0, ignore_eos=True, timeout=timeout
        ):
            if ch.token_ids:
                rec["times"].append(ch.time)
                rec["token_ids"].extend(ch.token_ids)
    except Exception as exc:  # noqa: BLE001 - a failed request is reported, not fatal to the benchmark
        rec["error"] = str(exc)
    rec["t_end"] = time.perf_counter()


def _one_run(
    address: str, stream_ids: list[list[int]], long_ids: list[list[int]], o: MixedOptions, credentials=None
) -> dict:
    """The streams run closed loop (a new request when one ends) until the burst has finished."""
    client = SpecdecClient(address, wait_ready=60.0, credentials=credentials)
    streams: list[list[dict]] = [[] for _ in stream_ids]
    longs: list[dict] = [{} for _ in long_ids]
    burst_done = threading.Event()

    def run_stream(i: int) -> None:
        while True:
            rec: dict[str, Any] = {}
            streams[i].append(rec)
            _stream(client, stream_ids[i], o.stream_tokens, o.timeout, rec)
            if burst_done.is_set() or rec["error"]:
                return

    threads = [threading.Thread(target=run_stream, args=(i,), daemon=True) for i in range(len(stream_ids))]
    for t in threads:
        t.start()
    t_wait = time.perf_counter() + o.timeout
    while not all(s and s[0].get("times") for s in streams) and time.perf_counter() < t_wait:
        time.sleep(0.01)  # every stream is decoding (its first chunk came)
    t_burst = time.perf_counter()
    burst = [
        threading.Thread(target=_stream, args=(client, ids, o.long_max_tokens, o.timeout, longs[i]), daemon=True)
        for i, ids in enumerate(long_ids)
    ]
    for t in burst:
        t.start()
    for t in burst:
        t.join(timeout=o.timeout)
    burst_done.set()
    for t in threads:
        t.join(timeout=o.timeout)
    client.close()
    t_done = max((r.get("t_end", t_burst) for r in longs), default=t_burst)
    gaps, short_ttft = [], []
    for recs in streams:
        for rec in recs:
            times = rec.get("times", [])
            gaps += [b - a for a, b in zip(times, times[1:]) if b > t_burst and a < t_done]
            if rec is not recs[0] and times and rec["t_start"] < t_done:
                short_ttft.append(times[0] - rec["t_start"])
    firsts = [r["times"][0] - r["t_start"] for r in longs if r.get("times")]
    finish = [r["t_end"] - t_burst for r in longs if "t_end" in r]
    return {
        "gap_s_p50": _r(percentile(gaps, 50)),
        "gap_s_p99": _r(percentile(gaps, 99)),
        "gap_s_max": _r(max(gaps, default=None)),
        "stream_ttft_s_max": _r(max(short_ttft, default=None)),  # new short requests during the burst
        "long_ttft_s_mean": _r(sum(firsts) / len(firsts)) if firsts else None,
        "long_finish_s_max": _r(max(finish, default=None)),
        "burst_window_s": _r(t_done - t_burst),
        "stream_tokens": [recs[0].get("token_ids", []) for recs in streams],
        "errors": [r["error"] for r in [x for recs in streams for x in recs] + longs if r.get("error")],
    }


def _mean(xs: list[float]) -> float | None:
    return _r(sum(xs) / len(xs)) if xs else None


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def bench_mixed(
    servers: dict[str, str],
    prompts: Sequence[Prompt],
    encode: Callable[[Prompt], list[int]],
    options: MixedOptions,
    progress: Callable[[str], None] | None = None,
    credentials: ClientCredentials | None = None,
) -> dict[str, Any]:
    """Run the mixed workload on each server (``{label: address}``), alternating, ``repeat`` times."""
    progress = progress or (lambda msg: None)
    stream_ids = [encode(prompts[i % len(prompts)]) for i in range(options.streams)]
    runs: dict[str, list[dict]] = {label: [] for label in servers}
    for rep in range(options.repeat):
        for label, address in servers.items():
            # fresh long prompts each run: a server must not answer from a cache of the last one
            long_ids = [
                _long_prompt(encode, prompts, options.long_tokens, salt=1 + rep * 97 + 13 * i)
                for i in range(options.long_prompts)
            ]
            progress(f"{label} ({address}): run {rep + 1}/{options.repeat}")
            runs[label].append(_one_run(address, stream_ids, long_ids, options, credentials))
    first = next(iter(servers))
    reference = runs[first][0]["stream_tokens"]
    result = {"options": options.__dict__, "servers": servers, "runs": runs, "summary": {}}
    for label, rs in runs.items():
        result["summary"][label] = {
            key: _mean([r[key] for r in rs if r[key] is not None])
            for key in (
                "gap_s_p50",
                "gap_s_p99",
                "gap_s_max",
                "stream_ttft_s_max",
                "long_ttft_s_mean",
                "long_finish_s_max",
            )
        }
        result["summary"][label]["gap_s_max_worst"] = max((r["gap_s_max"] or 0.0) for r in rs)
        result["summary"][label]["streams_equal_to_" + first] = all(r["stream_tokens"] == reference for r in rs)
        result["summary"][label]["errors"] = sum(len(r["errors"]) for r in rs)
    if len(runs) > 1:
        base = result["summary"][first]["long_finish_s_max"]
        for s in result["summary"].values():
            finish = s["long_finish_s_max"]
            s["long_finish_vs_" + first] = _r(finish / base) if base and finish else None
    return result


def format_mixed(result: dict[str, Any]) -> str:
    o = result["options"]
    lines = [
        f"mixed workload: {o['streams']} short stream(s) of {o['stream_tokens']} tokens; a burst of "
        f"{o['long_prompts']} prompts of {o['long_tokens']} tokens ({o['repeat']} run(s) per server, alternating)",
        "",
        "| server | stream gap p50 s | p99 s | max s (worst run) | new stream TTFT max s | burst TTFT s | "
        "burst finish s | finish ratio | streams unchanged | errors |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for label, s in result["summary"].items():
        ratio = next((v for k, v in s.items() if k.startswith("long_finish_vs_")), None)
        same = next((v for k, v in s.items() if k.startswith("streams_equal_to_")), None)
        lines.append(
            f"| {label} | {s['gap_s_p50']} | {s['gap_s_p99']} | {s['gap_s_max_worst']} | {s['stream_ttft_s_max']} | "
            f"{s['long_ttft_s_mean']} | "
            f"{s['long_finish_s_max']} | {ratio if ratio is not None else '-'} | {same} | {s['errors']} |"
        )
    return "\n".join(lines)
