"""The driver of bench/vs_vllm.sh: specdec and vLLM on the same models, prompts and token count.

Phases, one process each and never two at once (on a small CPU two busy processes slow each
other several times over), alternating between the stacks so the machine's drift hits both:

1. vLLM target-only                     (bench/vllm_side.py, in vLLM's environment)
2. specdec engine: ``specdec bench generate`` with specdec_target, specdec_draft_adaptive, specdec_ngram
3. vLLM + draft model
4. specdec service: ``specdec serve`` on loopback, ``specdec bench serve --modes off,auto``, stopped
5. vLLM + n-gram

Prompts are loaded with specdec's own loader (specdec/core/prompts.py) and tokenized once here,
with the target's tokenizer and its chat template; vLLM gets those token ids, specdec's benches
load the same prompt set and tokenize it the same way. Everything lands in one JSON (``--json``)
and one table (specdec/bench/peer.py). ``--report RUN.json`` prints the table of a saved run again.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from specdec.bench.peer import ENGINE_CONFIGS, VLLM_CONFIGS, compare, format_comparison

REPO = Path(__file__).resolve().parents[1]
SPECDEC = [sys.executable, "-m", "specdec.cli"]
# vLLM's CPU settings (bench/README.md, "vLLM's settings"; the measurements behind them: docs/results.md,
# section 9); any of them set in the environment wins.
VLLM_ENV_DEFAULTS = {
    # vLLM's engine core and model worker in the benchmark's own process. Split into processes (its
    # default), the scheduler either keeps one of two cores for itself (VLLM_CPU_OMP_THREADS_BIND=auto
    # reserves one) or spin-waits on a core the model's threads need.
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "OMP_NUM_THREADS": "cores",  # in one process vLLM drops torch to 1 thread unless this is set; "cores": all
    "VLLM_CPU_KVCACHE_SPACE": "2",  # GiB: 8 sequences of ~1k tokens need a few hundred MiB
    "VLLM_NO_USAGE_STATS": "1",  # nothing leaves the machine
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",  # models come from local folders only
    "TOKENIZERS_PARALLELISM": "false",
}


def stamp(msg: str) -> None:
    print(f"== {datetime.datetime.now():%H:%M:%S} {msg}", file=sys.stderr, flush=True)


def _ints(text: str) -> list[int]:
    values = [int(x) for x in text.split(",") if x.strip()]
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 1, got {text!r}")
    return values


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench/vs_vllm.sh", description=__doc__.splitlines()[0])
    p.add_argument("--target", default="qwen2.5-coder-1.5b-instruct", help="pack name or HF folder")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct", help="pack name or HF folder")
    p.add_argument("--prompts", default="humaneval:8", help="as `specdec bench generate --prompts`")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--clients", type=_ints, default=[1, 4, 8], metavar="1,4,8", help="concurrent requests")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--k", type=int, default=4, help="draft tokens a round: vLLM's draft and n-gram, specdec's n-gram")
    p.add_argument("--ngram", default="1-3", metavar="MIN-MAX", help="vLLM's prompt-lookup n-gram sizes")
    p.add_argument("--only", choices=["vllm", "specdec"], default=None, help="run one side only")
    p.add_argument("--skip-install", action="store_true", help="use vLLM's environment as it is (no install)")
    p.add_argument("--vllm-python", default=str(REPO / "bench/.venv-vllm/bin/python"), help=argparse.SUPPRESS)
    p.add_argument("--vllm-eager", action="store_true", help="vLLM without torch.compile (faster start, slower steps)")
    p.add_argument("--json", default=None, metavar="OUT", help="the run's JSON (default bench/out/vs_vllm-TIME.json)")
    p.add_argument("--report", default=None, metavar="RUN.json", help="print the table of a saved run and exit")
    return p.parse_args(argv)


# ------------------------------------------------------------------------------------------- inputs
def model_dir(spec: str) -> Path:
    """A pack's folder (prepared) or a Hugging Face folder: what vLLM loads and the tokenizer comes from."""
    from specdec.core import packs

    try:
        path = packs.resolve_pack(spec) if spec in packs.PACKS else Path(spec).expanduser()
    except packs.PackError as exc:
        raise SystemExit(f"error: {exc}") from None
    if not (path / "config.json").is_file():
        raise SystemExit(f"error: {spec}: not a prepared pack or a Hugging Face folder (no config.json in {path})")
    return path.resolve()


def encoded_prompts(spec: str, target: Path) -> list[dict]:
    from transformers import AutoTokenizer

    from specdec.core.prompts import encode, load_prompts

    tokenizer = AutoTokenizer.from_pretrained(str(target))
    return [{"id": p.id, "token_ids": encode(tokenizer, p)} for p in load_prompts(spec)]


def cores() -> str:
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    return ",".join(str(c) for c in cpus)


def vllm_env(vllm_python: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # vLLM's side imports no specdec
    for k, v in VLLM_ENV_DEFAULTS.items():
        env.setdefault(k, v)
    if env["OMP_NUM_THREADS"] == "cores":
        env["OMP_NUM_THREADS"] = str(len(cores().split(",")))  # as many as specdec's torch uses
    # vLLM's CPU notes ask for Intel OpenMP (its speculative decoding warns of a large loss without
    # it) and TCMalloc, preloaded. intel-openmp comes with the wheel; TCMalloc only if installed.
    preload = [p for p in env.get("LD_PRELOAD", "").split(":") if p]
    # (the venv's own path: resolving the symlink would land in the base interpreter's folder)
    iomp = Path(vllm_python).absolute().parents[1] / "lib" / "libiomp5.so"
    for lib in (iomp, *_system_tcmalloc()):
        if lib.is_file() and not any(Path(p).name == lib.name for p in preload):
            preload.append(str(lib))
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    return env


def _system_tcmalloc() -> list[Path]:
    for folder in ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib"):
        for name in ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4"):
            if (Path(folder) / name).is_file():
                return [Path(folder) / name]
    return []


# ------------------------------------------------------------------------------------------- phases
def run_logged(cmd: list[str], log: Path, env: dict | None = None) -> int:
    with log.open("w") as f:
        return subprocess.run(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT).returncode


def tail(log: Path, n: int = 15) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-n:]) if log.is_file() else ""


def run_vllm(name: str, args, work: Path, target: Path, draft: Path, prompts: list[dict], requests: int) -> dict:
    lo, hi = (int(x) for x in args.ngram.split("-"))
    job = {
        "config": name,
        "model": str(target),
        "draft": str(draft),
        "dtype": args.dtype,
        "k": args.k,
        "ngram_min": lo,
        "ngram_max": hi,
        "max_tokens": args.max_tokens,
        "clients": args.clients,
        "requests": requests,
        "prompts": prompts,
        "max_model_len": max(4096, max(len(p["token_ids"]) for p in prompts) + args.max_tokens + 2 * args.k + 16),
        "enforce_eager": args.vllm_eager,
    }
    (work / f"vllm-{name}-job.json").write_text(json.dumps(job))
    out, log = work / f"vllm-{name}.json", work / f"vllm-{name}.log"
    cmd = [args.vllm_python, str(REPO / "bench/vllm_side.py"), "--job", str(work / f"vllm-{name}-job.json")]
    rc = run_logged([*cmd, "--out", str(out)], log, vllm_env(args.vllm_python))
    if rc != 0 or not out.is_file():
        stamp(f"vLLM {name} failed (exit {rc}); its log: {log}\n{tail(log)}")
        return {"config": name, "error": f"exit {rc}: {tail(log, 3)}", "log": str(log)}
    return json.loads(out.read_text())


def run_engine(args, work: Path) -> dict:
    out, log = work / "generate.json", work / "generate.log"
    cmd = [*SPECDEC, "bench", "generate", "--target", args.target, "--draft", args.draft, "--prompts", args.prompts]
    cmd += ["--max-tokens", str(args.max_tokens), "--dtype", args.dtype, "--k", str(args.k)]
    cmd += ["--configs", ",".join(ENGINE_CONFIGS)]
    rc = run_logged([*cmd, "--json", str(out)], log, specdec_env())
    if rc != 0 or not out.is_file():
        stamp(f"specdec bench generate failed (exit {rc}); its log: {log}\n{tail(log)}")
        return {"error": f"exit {rc}: {tail(log, 3)}", "log": str(log)}
    return json.loads(out.read_text())


def specdec_env() -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_service(args, work: Path, requests: int) -> dict:
    port, metrics = free_port(), free_port()
    serve_log, out, log = work / "serve.log", work / "serve.json", work / "bench-serve.log"
    cmd = [*SPECDEC, "serve", "--target", args.target, "--draft", args.draft, "--dtype", args.dtype]
    cmd += ["--port", str(port), "--metrics-port", str(metrics), "--http-port", "0"]
    with serve_log.open("w") as f:
        proc = subprocess.Popen(cmd, cwd=REPO, env=specdec_env(), stdout=f, stderr=subprocess.STDOUT)
    try:
        if not wait_serving(proc, serve_log, timeout=1200):
            stamp(f"specdec serve did not come up; its log: {serve_log}\n{tail(serve_log)}")
            return {"error": f"specdec serve did not start: {tail(serve_log, 3)}", "log": str(serve_log)}
        cmd = [*SPECDEC, "bench", "serve", "--server", f"127.0.0.1:{port}", "--prompts", args.prompts]
        cmd += ["--max-tokens", str(args.max_tokens), "--modes", "off,auto", "--requests", str(requests)]
        cmd += ["--concurrency", ",".join(map(str, args.clients))]
        cmd += ["--metrics-url", f"http://127.0.0.1:{metrics}/metrics"]
        rc = run_logged([*cmd, "--json", str(out)], log, specdec_env())
    finally:
        stop(proc)
    if rc != 0 or not out.is_file():
        stamp(f"specdec bench serve failed (exit {rc}); its log: {log}\n{tail(log)}")
        return {"error": f"exit {rc}: {tail(log, 3)}", "log": str(log)}
    return json.loads(out.read_text())


def wait_serving(proc: subprocess.Popen, log: Path, timeout: float) -> bool:
    """`specdec serve` logs this line once its workers are loaded and the router listens."""
    t_end = time.monotonic() + timeout
    while time.monotonic() < t_end and proc.poll() is None:
        if "specdec serving specdec.v1.Generation" in log.read_text(errors="replace"):
            return True
        time.sleep(1)
    return False


def stop(proc: subprocess.Popen) -> None:
    """SIGINT, as a person's Ctrl-C: serve shuts its Ray cluster down cleanly; killed if it hangs."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)


# ------------------------------------------------------------------------------------------- the run
def git_commit() -> str | None:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True)
        return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "") if head.returncode == 0 else None
    except OSError:
        return None


def title(meta: dict) -> str:
    vllm = meta.get("vllm_version") or "-"
    return (
        f"specdec vs vLLM {vllm} (CPU, {meta['machine']['cpus']} cores): target {meta['target']}, "
        f"draft {meta['draft']}, {meta['dtype']}, {meta['prompts']} ({len(meta['prompt_ids'])} prompts, "
        f"{meta['requests']} requests per client count), {meta['max_tokens']} tokens, greedy; "
        f"commit {meta['commit']}"
    )


def report(result: dict) -> str:
    m = result["meta"]
    cmp = compare(result["vllm"], result["specdec"].get("generate"), result["specdec"].get("serve"), m["clients"])
    return format_comparison(cmp, title(m))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.report:
        print(report(json.loads(Path(args.report).read_text())))
        return 0
    run_vllm_side, run_specdec_side = args.only in (None, "vllm"), args.only in (None, "specdec")
    if run_vllm_side and not Path(args.vllm_python).is_file():
        raise SystemExit(
            f"error: no vLLM environment at {args.vllm_python}: run bench/vs_vllm.sh without --skip-install"
        )
    started, t0 = datetime.datetime.now(datetime.UTC), time.perf_counter()
    load_start = list(os.getloadavg())
    if load_start[0] > 1.0:
        stamp(f"load average {load_start[0]:.2f} before the run: other work on this machine will skew both sides")
    out = Path(args.json or REPO / f"bench/out/vs_vllm-{started:%Y%m%dT%H%M%S}.json")
    work = out.with_suffix("")
    work.mkdir(parents=True, exist_ok=True)
    target, draft = model_dir(args.target), model_dir(args.draft)
    prompts = encoded_prompts(args.prompts, target)
    requests = max(len(prompts), max(args.clients))  # every client busy at the largest count
    vllm: dict[str, dict] = {}
    specdec: dict[str, dict] = {}
    phases = []
    plan = [("vllm", "target"), ("specdec", "generate"), ("vllm", "draft"), ("specdec", "serve"), ("vllm", "ngram")]
    for side, name in plan:
        if (side == "vllm" and not run_vllm_side) or (side == "specdec" and not run_specdec_side):
            continue
        stamp(f"{side} {name}")
        t = time.perf_counter()
        if side == "vllm":
            vllm[name] = run_vllm(name, args, work, target, draft, prompts, requests)
        elif name == "generate":
            specdec[name] = run_engine(args, work)
        else:
            specdec[name] = run_service(args, work, requests)
        phases.append({"phase": f"{side} {name}", "seconds": round(time.perf_counter() - t, 1)})
    meta = {
        "target": args.target,
        "draft": args.draft,
        "target_dir": str(target),
        "draft_dir": str(draft),
        "dtype": args.dtype,
        "prompts": args.prompts,
        "prompt_ids": [p["id"] for p in prompts],
        "prompt_tokens": [len(p["token_ids"]) for p in prompts],
        "max_tokens": args.max_tokens,
        "clients": args.clients,
        "requests": requests,
        "k": args.k,
        "ngram": args.ngram,
        "vllm_configs": [c for c in VLLM_CONFIGS if c in vllm],
        "vllm_version": next((r["versions"]["vllm"] for r in vllm.values() if "versions" in r), None),
        "vllm_env": next((r["env"] for r in vllm.values() if "env" in r), None),
        "vllm_concurrency": "c requests given to LLM.generate as one batch, batch after batch",
        "specdec_concurrency": "closed loop of c clients (specdec bench serve); the engine at one client",
        "commit": git_commit(),
        "date": started.isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(),
            "cpus": len(cores().split(",")),
            "load_avg_start": load_start,
            "load_avg_end": list(os.getloadavg()),
        },
        "phases": phases,
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    result = {"meta": meta, "vllm": vllm, "specdec": specdec}
    result["comparison"] = compare(vllm, specdec.get("generate"), specdec.get("serve"), args.clients)
    out.write_text(json.dumps(result, indent=1))
    print(format_comparison(result["comparison"], title(meta)))
    stamp(f"wrote {out} (logs and the benches' own JSON in {work}/); {meta['wall_s']:.0f} s")
    lossless = result["comparison"]["lossless"]
    return 0 if not lossless["checks"] or lossless["all_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
