"""The restart scenario of `specdec bench serve --workload abuse` (``--kill-target PID``): the target
worker is killed (SIGKILL) while long-context streams run, and the service recovers them
(docs/design.md, "Recovery").

First the streams run undisturbed: their output, and their prefill time (until every stream has its
first token; they are prefilled together). Then the same streams again, and once each has its first
token and ``kill_after_s`` more have passed, the bench kills the process ``pid`` (a target worker on
this machine; Ray starts a new one). Reported: the stall (each stream's longest wait for a token
from the kill on, the new process's start-up included; the longest over the streams), the stall
over the prefill time, any stream error (a DEADLINE_EXCEEDED among them), and whether each
stream's tokens equal the undisturbed run's (greedy: they must).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from specdec.rpc.client import SpecdecClient

__all__ = ["RestartOptions", "restart_scenario"]


@dataclass
class RestartOptions:
    streams: int = 2
    tokens: int = 3500  # prompt tokens per stream
    max_tokens: int = 64
    kill_after_s: float = 1.0  # after every stream has its first token
    timeout: float = 1800.0

    def check(self) -> None:
        for flag, value in (("--restart-streams", self.streams), ("--restart-tokens", self.tokens)):
            if value < 1:
                raise ValueError(f"{flag} must be at least 1 (got {value})")
        if self.max_tokens < 2:
            raise ValueError(f"--restart-max-tokens must be at least 2 tokens (got {self.max_tokens})")


def _stream(client: SpecdecClient, ids: list[int], o: RestartOptions, rec: dict[str, Any]) -> None:
    """One greedy stream; ``rec`` gets each chunk's arrival time and the tokens (other threads read it)."""
    rec.update(t_start=time.perf_counter(), times=[], tokens=[], error=None)
    try:
        for ch in client.generate_stream(
            prompt_token_ids=ids, max_tokens=o.max_tokens, temperature=0.0, ignore_eos=True, timeout=o.timeout
        ):
            if ch.token_ids:
                rec["times"].append(time.perf_counter())
                rec["tokens"].extend(ch.token_ids)
    except grpc.RpcError as exc:
        rec["error"] = f"{exc.code().name}: {exc.details()}"
    rec["t_end"] = time.perf_counter()


def _run(
    client: SpecdecClient, prompts: list[list[int]], o: RestartOptions, kill: Callable[[], None] | None
) -> tuple[list[dict[str, Any]], float, float | None]:
    """The streams at once; with ``kill``, called once all have a first token. Returns the records,
    the start, and when the kill happened."""
    recs: list[dict[str, Any]] = [{} for _ in prompts]
    threads = [threading.Thread(target=_stream, args=(client, p, o, r), daemon=True) for p, r in zip(prompts, recs)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    t_kill = None
    while any(t.is_alive() for t in threads):
        time.sleep(0.02)
        if kill is not None and t_kill is None and all(r.get("times") for r in recs):
            time.sleep(o.kill_after_s)
            if not all(t.is_alive() for t in threads):  # a stream ended first: no kill mid-stream
                kill = None
                continue
            t_kill = time.perf_counter()
            kill()
    return recs, t0, t_kill


def _longest_gap(t_kill: float, times: list[float]) -> float | None:
    after = [t_kill] + [t for t in times if t > t_kill]
    return max((b - a for a, b in zip(after, after[1:])), default=None)


def restart_scenario(
    client: SpecdecClient, prompts: list[list[int]], pid: int, o: RestartOptions, progress: Callable[[str], None]
) -> dict[str, Any]:
    o.check()
    progress(f"restart: {len(prompts)} streams of {o.tokens} prompt tokens, undisturbed")
    ref, t0, _ = _run(client, prompts, o, None)
    prefill_s = max((r["times"][0] - t0 for r in ref if r["times"]), default=None)
    progress(f"restart: the same streams; SIGKILL to pid {pid} once each has its first token")
    got, _, t_kill = _run(client, prompts, o, lambda: os.kill(pid, signal.SIGKILL))
    # A stream's stall: its longest wait for a token from the kill on (a chunk already on its way
    # arrives first; the wait for the new process comes after it).
    stalls = [_longest_gap(t_kill, r["times"]) for r in got] if t_kill else []
    stall_s = None if not stalls or None in stalls else round(max(stalls), 3)
    prefill_s = None if prefill_s is None else round(prefill_s, 3)
    return {
        "pid": pid,
        "prompt_tokens": o.tokens,
        "streams": len(prompts),
        "killed": t_kill is not None,
        "prefill_s": prefill_s,
        "stall_s": stall_s,
        "stall_vs_prefill": round(stall_s / prefill_s, 3) if stall_s is not None and prefill_s else None,
        "errors": [r["error"] for r in ref + got if r["error"]],
        "identical": [r["tokens"] == g["tokens"] for r, g in zip(ref, got)],
        "tokens": [len(g["tokens"]) for g in got],
    }
