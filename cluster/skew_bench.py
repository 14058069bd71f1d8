"""`specdec bench rebalance`: skewed drafters, the rebalancer against static pairing, in one run.

Two target replicas and two draft workers (Ray actors on an embedded cluster); draft worker 0 is
slowed to ``slow_factor`` x its step time with the workers' TEST/BENCHMARK knob
(``set_bench_step_delay``). Two routers serve the same workers: static pairing
(``rebalance.enabled: false``: target i drafts on drafter i, as before the rebalancer) and the
rebalancer (one shared drafter pool). The same closed-loop load runs against each in turn,
alternating ``repeats`` times; the figure is the throughput ratio, and the outputs of the two
must be identical (greedy). Then the reaction time: a fresh rebalancing router under load, drafter
0 slowed mid-run, and the time until drafts stop reaching it, in telemetry periods.

Device emulation (for CPU machines): ``target_delay_s`` (slept per Verify call: a memory-bound
target step, flat in the tokens verified) and ``draft_delay_s`` (slept per draft token) make tiny
models behave like a large target and a small drafter with c = draft_delay / target_delay.
Figures and the setting they were taken in: docs/results.md, "Rebalancer: skewed drafters".
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cluster.config import ServeConfig

log = logging.getLogger(__name__)

__all__ = ["SkewOptions", "run_skew_bench", "format_skew"]

PROMPTS = [
    "def fibonacci(n):",
    "The quick brown fox jumps over",
    "import numpy as np\nimport",
    "Once upon a time, in a land",
    "SELECT name, count(*) FROM",
    "for i in range(10):\n    print(",
    "Dear Sir or Madam,\nI am writing",
    "class Stack:\n    def __init__(self):",
]


@dataclass
class SkewOptions:
    target: str = "tiny"  # model path/pack, or "tiny": random tiny target + its noisy copy as drafter
    draft: str | None = None
    draft_noise: float = 0.01  # "tiny": the drafter's weight noise (0.01: accepted/drafted ~0.68 at k 4)
    slow_factor: float = 3.0
    target_delay_s: float = 0.1
    draft_delay_s: float = 0.02
    concurrency: int = 4
    requests: int = 16
    max_tokens: int = 64
    repeats: int = 2
    period_s: float = 1.0  # telemetry period (workers) and rebalancer period (router)
    reaction_timeout_s: float = 60.0


def _models(opts: SkewOptions, tmp: Path) -> tuple[str, str]:
    if opts.target != "tiny":
        return opts.target, opts.draft or opts.target
    from specdec.core.tiny import make_tiny_draft, make_tiny_model

    target = make_tiny_model(tmp / "target", seed=0)
    return str(target), str(make_tiny_draft(target, tmp / "draft", noise=opts.draft_noise))


def _serve_config(opts: SkewOptions, target: str, draft: str) -> ServeConfig:
    worker = {
        "dtype": "float32",
        "num_slots": 8,
        "max_len": 1024,
        "threads": 1,
        "telemetry": {"period_s": opts.period_s},
    }
    return ServeConfig.from_dict(
        {
            "ray": {"num_cpus": 4},
            "target": {"model": target, "replicas": 2, "bench_step_delay_s": opts.target_delay_s, **worker},
            "draft": {"model": draft, "replicas": 2, "bench_step_delay_s": opts.draft_delay_s, **worker},
            "router": {
                "port": 0,
                "metrics_port": 0,
                "micro_batches": 1,
                "default_max_tokens": opts.max_tokens,
                "rebalance": {"period_s": opts.period_s},
            },
        }
    )


def _router(bindings, cfg: ServeConfig, enabled: bool):
    from router.server import RouterThread

    rb = dataclasses.replace(cfg.router.rebalance, enabled=enabled)
    return RouterThread(bindings, dataclasses.replace(cfg.router, rebalance=rb)).start(120)


def _load(router, opts: SkewOptions, warmup: bool) -> dict[str, Any]:
    from specdec.bench.serve import BenchOptions, bench_serve
    from specdec.core.prompts import Prompt

    prompts = [Prompt(f"p{i}", text, False) for i, text in enumerate(PROMPTS)]
    options = BenchOptions(
        max_tokens=opts.max_tokens,
        concurrency=(opts.concurrency,),
        requests=opts.requests,
        modes=("auto",),
        warmup=warmup,
        metrics_url=f"http://127.0.0.1:{router.router.metrics_port}/metrics",
        interleave=False,
    )
    (res,) = bench_serve(router.address, prompts, options)["results"]
    outputs = {r["id"]: r["token_ids"] for r in res["records"] if not r.get("error")}
    return {"summary": res["summary"], "outputs": outputs}


def _drafted(router) -> dict[str, float]:
    m = router.metrics
    return {n: m.sample("specdec_draft_sequences_total", {"worker": n}) or 0.0 for n in ("draft-0", "draft-1")}


def _reaction(bindings, cfg: ServeConfig, slow_handle, slow_delay: float, opts: SkewOptions) -> dict[str, Any]:
    """Under load on a fresh rebalancing router, slow drafter 0 and time how long until drafter 0
    gets less than a quarter of the drafts over one period (it had about half)."""
    import ray

    router = _router(bindings, cfg, enabled=True)
    stop = threading.Event()
    try:
        long = dataclasses.replace(opts, requests=10_000, max_tokens=max(opts.max_tokens, 128))
        loader = threading.Thread(target=lambda: _until(stop, router, long), daemon=True)
        loader.start()
        t_end = time.monotonic() + opts.reaction_timeout_s
        while min(_drafted(router).values()) < 20 and time.monotonic() < t_end:
            time.sleep(0.05)
        if min(_drafted(router).values()) < 20:
            log.warning("reaction: the load did not use both drafters (%s)", _drafted(router))
        share_before = _share(_drafted(router))
        ray.get(slow_handle.set_bench_step_delay.remote(slow_delay), timeout=30)
        t_slow = time.monotonic()
        history = [(t_slow, _drafted(router))]
        while time.monotonic() < t_slow + opts.reaction_timeout_s:
            time.sleep(0.05)
            now = time.monotonic()
            history.append((now, _drafted(router)))
            if now - t_slow < opts.period_s:
                continue
            old = next(c for t, c in history if t >= now - opts.period_s)
            window = {k: history[-1][1][k] - old[k] for k in old}
            if sum(window.values()) >= 4 and _share(window) < 0.25:
                reaction = now - t_slow
                moves = router.metrics.sample("specdec_rebalance_actions_total", {"action": "draft_move"})
                return {
                    "reaction_s": round(reaction, 3),
                    "periods": round(reaction / opts.period_s, 2),
                    "moves": moves,
                    "slow_share_before": round(share_before, 3),
                    "slow_share_window": round(_share(window), 3),
                }
        return {"reaction_s": None, "periods": None, "moves": None}
    finally:
        stop.set()
        router.stop(grace=0)


def _share(counts: dict[str, float]) -> float:
    """Drafter 0's share of the drafted sequences."""
    total = sum(counts.values())
    return counts["draft-0"] / total if total else 0.0


def _until(stop: threading.Event, router, opts: SkewOptions) -> None:
    from specdec.rpc.client import SpecdecClient

    with SpecdecClient(router.address) as client:

        def loop(i: int) -> None:
            while not stop.is_set():
                try:
                    client.generate(PROMPTS[i % len(PROMPTS)], max_tokens=opts.max_tokens, ignore_eos=True, timeout=60)
                except Exception as exc:  # noqa: BLE001 - the router is being stopped
                    if not stop.is_set():
                        log.warning("reaction load: request failed: %s", exc)
                    return

        threads = [threading.Thread(target=loop, args=(i,), daemon=True) for i in range(opts.concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()


def run_skew_bench(opts: SkewOptions, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    from cluster.launch import launch

    progress = progress or (lambda msg: None)
    with tempfile.TemporaryDirectory(prefix="specdec-skew-") as tmp:
        target, draft = _models(opts, Path(tmp))
        cfg = _serve_config(opts, target, draft)
        progress("starting 2 target and 2 draft workers")
        dep = launch(cfg, connect_timeout=600)
        import ray  # only now: Ray reads RAY_AUTH_MODE at import, and launch sets it (token auth)

        try:
            bindings = dep.router.router.bindings
            static = _router(bindings, cfg, enabled=False)
            routers = {"static": static, "rebalancer": dep.router}
            slow_delay = opts.draft_delay_s * opts.slow_factor
            ray.get(dep.drafts[0].set_bench_step_delay.remote(slow_delay), timeout=30)
            runs: dict[str, list] = {"static": [], "rebalancer": []}
            for r in range(opts.repeats):
                for name, router in routers.items():
                    progress(f"repeat {r + 1}/{opts.repeats}: {name}")
                    runs[name].append(_load(router, opts, warmup=r == 0))
            steps = {
                n: dep.router.metrics.sample("specdec_drafter_step_seconds", {"worker": n})
                for n in ("draft-0", "draft-1")
            }
            static.stop(grace=0)
            ray.get(dep.drafts[0].set_bench_step_delay.remote(opts.draft_delay_s), timeout=30)
            progress("reaction time: drafter 0 slowed under load")
            reaction = _reaction(bindings, cfg, dep.drafts[0], slow_delay, opts)
        finally:
            dep.stop(grace=0)
    tput = {n: [x["summary"]["throughput_tok_s"] for x in v] for n, v in runs.items()}
    same = all(a["outputs"] == b["outputs"] for a, b in zip(runs["static"], runs["rebalancer"]))
    return {
        "options": dataclasses.asdict(opts),
        "throughput_tok_s": tput,
        "ratio": round(statistics.mean(tput["rebalancer"]) / statistics.mean(tput["static"]), 3),
        "ratio_per_repeat": [round(b / a, 3) for a, b in zip(tput["static"], tput["rebalancer"])],
        "identical_outputs": same,
        "drafter_step_s": steps,
        "summaries": {n: [x["summary"] for x in v] for n, v in runs.items()},
        "reaction": reaction,
    }


def format_skew(result: dict[str, Any]) -> str:
    o, t, re = result["options"], result["throughput_tok_s"], result["reaction"]
    steps = {k: None if v is None else round(1000 * v, 1) for k, v in result["drafter_step_s"].items()}
    return "\n".join(
        [
            f"skewed drafters: drafter 0 slowed {o['slow_factor']}x (emulated target step {o['target_delay_s']} s, "
            f"draft step {o['draft_delay_s']} s), {o['concurrency']} clients, {o['requests']} requests x "
            f"{o['max_tokens']} tokens, {o['repeats']} repeats",
            f"  static pairing tok/s: {t['static']}",
            f"  rebalancer     tok/s: {t['rebalancer']}",
            f"  ratio: {result['ratio']} (per repeat {result['ratio_per_repeat']}); identical outputs: "
            f"{result['identical_outputs']}",
            f"  measured drafter step (ms, queueing included): {steps}",
            f"  reaction: {re['reaction_s']} s = {re['periods']} telemetry periods ({re['moves']} requests moved)",
        ]
    )
