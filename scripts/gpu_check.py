"""The checks that need a GPU, in one run, since CI and the development machines have none
(figures: docs/results.md, "On a GPU").

    python scripts/gpu_check.py [--out gpu_check.json] [--device cuda] [--quick] [--parts a,b,...]
    python scripts/gpu_check.py --parts engine --out bench/gpu/engine.json

1. telemetry: the worker's TelemetrySampler on the real NVML (nvidia-ml-py), idle, under a large
   bf16 GEMM loop and under a loop of tiny kernels (the "utilization" pitfall: both read busy, only
   GPM's sm_active tells them apart).
2. gemm classes: for the Qwen2.5-1.5B projections, which row counts M give row 0 bitwise the same
   result (bf16, float32): the GPU counterpart of the CPU rule in specdec/core/attention.py.
3. ops: scripts/invariance.py's op probe on this device.
4. invariance: tests/unit/test_invariance.py's property (a row's logits do not depend on the rest of
   the forward) on tiny models and on a 2-layer Qwen2.5-1.5B-shaped random model, on this device.
5. lossless: the engine's speculative greedy and seeded output against k = 0, tiny pair, bf16.
6. bigbatch: a decode beside 15 rows of 8-token verifies (121 GEMM rows) against the same token
   decoded alone, with the runner's CUDA GEMM blocks and without (one GEMM over all rows).
7. prometheus: the real NVML through a draft worker's Info RPC into the router's
   specdec_device_* series.
8. the timing parts of scripts/gpu_costs.py: cost, blockcost, roofline, graphs, bmmblocks.
9. engine: specdec's forward, engine and service on this device against the roofline and
   transformers' graphed forward, speculation at a set acceptance against its bound, every run's
   tokens against k = 0 (scripts/gpu_engine.py; ``--tiny``: toy shapes, the CPU test's run).

Each part runs on its own; a failure is recorded (with its traceback) and the next part runs. The
exit status is 1 when a part raised or reported failures (the engine part's token identity).
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

import gpu_costs  # noqa: E402 - scripts/ is on the path from here
import invariance as probes  # noqa: E402 - scripts/invariance.py (its name is a part here)


def telemetry(device: str) -> dict:
    from specdec.rpc.telemetry import TelemetryConfig, TelemetrySampler, WorkerMeter

    meter = WorkerMeter()
    sampler = TelemetrySampler(device, meter, TelemetryConfig(period_s=1.0))
    out = {"source": "nvml" if sampler.gpu is not None else "process", "phases": {}}
    n = 8192 if device.startswith("cuda") else 256  # a GPU-sized GEMM would take minutes on a CPU
    big = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    tiny = torch.zeros(1, device=device)

    def phase(name: str, work, seconds: float) -> None:
        sampler.sample()
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            if work is not None:
                with meter.compute(steps=0):
                    work()
            else:
                time.sleep(0.05)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        s = sampler.sample()
        out["phases"][name] = {k: v for k, v in vars(s).items() if v not in (None, [], "")}

    phase("idle", None, 2.0)
    phase("bf16 GEMM loop", lambda: big @ big, 3.0)
    phase("tiny kernels loop", lambda: tiny.add_(1), 3.0)
    sampler.stop()
    return out


def gemm_classes(device: str) -> dict:
    """{dtype: {shape: "1:c0 2-16:c1 ..."}}: runs of M and the class of row 0's result (M in one
    class give row 0 bitwise the same numbers)."""
    shapes = dict(probes.LINEAR_SHAPES, **{"qwen1.5b k": (256, 1536), "qwen1.5b lm_head": (151936, 1536)})
    gen = torch.Generator().manual_seed(0)
    out: dict = {}
    for dtype in (torch.bfloat16, torch.float32):
        per = out.setdefault(str(dtype), {})
        for name, (n, k) in shapes.items():
            if not name.startswith("qwen"):
                continue
            w = (torch.randn(n, k, generator=gen) * 0.05).to(device, dtype)
            x = torch.randn(512, k, generator=gen).to(device, dtype)
            seen: dict[bytes, int] = {}
            classes = []
            for m in list(range(1, 129)) + [160, 192, 256, 384, 512] if device.startswith("cuda") else [1, 2, 4, 8]:
                key = F.linear(x[:m], w)[0].float().cpu().numpy().tobytes()
                cls = seen.setdefault(key, len(seen))
                if classes and classes[-1][2] == cls:
                    classes[-1][1] = m
                else:
                    classes.append([m, m, cls])
            per[name] = " ".join(f"{a}-{b}:c{c}" if a != b else f"{a}:c{c}" for a, b, c in classes)
    return out


def ops(device: str) -> list[dict]:
    return probes.probe_ops(device)


def _tiny(root: Path) -> dict[str, Path]:
    from specdec.core.tiny import make_tiny_draft, make_tiny_model

    paths = {arch: make_tiny_model(root / arch, arch=arch, seed=i) for i, arch in enumerate(("llama", "qwen2"))}
    paths["llama-draft"] = make_tiny_draft(paths["llama"], root / "llama-draft")
    return paths


def invariance(device: str, root: Path, examples: int, only: str) -> dict:
    from tests.unit import test_invariance as t

    paths = _tiny(root)
    out = {}
    models = {}
    for arch in ("llama", "qwen2"):
        for dtype in (torch.bfloat16, torch.float32):
            models[f"tiny {arch} {str(dtype)[6:]}"] = lambda a=arch, d=dtype: t.load_hf(paths[a], d).to(device)
    load = probes._load
    for dtype in (torch.bfloat16, torch.float32):
        models[f"qwen1.5b-shape 2 layers {str(dtype)[6:]}"] = lambda d=dtype: load("random:qwen2.5-1.5b", d, device, 2)
    for name, make in models.items():
        if only not in name:
            continue
        model = make()
        seq = [random.Random(0).randrange(model.config.vocab_size) for _ in range(32)]
        row = {}
        for invariant in (True, False):
            case = t.Case(name, model, seq, t._decode_one_by_one(model, seq, invariant), examples=examples)
            try:
                if invariant:
                    t._check_property(case, case.examples)
                else:
                    _fast_property(case)
                row["invariant" if invariant else "fast"] = "equal in every example"
            except AssertionError as exc:
                row["invariant" if invariant else "fast"] = "DIFFERS: " + str(exc).splitlines()[0][:300]
        out[name] = row
        del model
    return out


def _fast_property(case) -> None:
    """The property on the fast forward (SDPA, unpadded GEMMs): expected to fail, which shows the
    comparison can fail on this device."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from tests.unit import test_invariance as t

    @settings(max_examples=case.examples, deadline=None, database=None, derandomize=True)
    @given(st.data())
    def fast(data):
        t._feed_in_chunks(case, data.draw, invariant=False)

    fast()


def lossless(device: str, root: Path) -> dict:
    from specdec.core.drafters import ModelDrafter, NgramProposer
    from specdec.core.runner import ModelRunner
    from tests.unit import test_invariance as t

    paths = _tiny(root)
    load = lambda p: t.load_hf(p, dtype=torch.bfloat16).to(device)  # noqa: E731
    target, draft = load(paths["llama"]), load(paths["llama-draft"])
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(paths["llama"])
    prompts = [tok.encode(s) for s in ("def add(a, b):", "The quick brown fox", "1, 2, 3, 4,", "hello hello")]
    drafters = {
        "model": lambda: ModelDrafter(ModelRunner(draft, num_slots=4, max_len=256, invariant_numerics=False)),
        "ngram": NgramProposer,
    }
    try:
        t.assert_speculation_changes_nothing(target, tok, drafters, prompts, 40, {tok.eos_token_id})
        return {"result": "token-identical (greedy: model k=4, ngram k=3, adaptive k; seeded: model, ngram)"}
    except AssertionError as exc:
        return {"result": "DIFFERS: " + str(exc)[:500]}


def big_batch(device: str) -> dict:
    """A decode beside 15 rows verifying 8 tokens each (121 GEMM rows, past the bf16 down
    projection's 88) against the same token decoded alone, with and without the runner's GEMM
    blocks: {dtype: {"blocks of N rows" | "one GEMM": "equal" | "DIFFERS ..."}}."""

    from specdec.core.runner import ModelRunner

    out: dict = {}
    for dtype in (torch.bfloat16, torch.float32):
        model = probes._load("random:qwen2.5-1.5b", dtype, device, layers=2)
        config = model.config
        gen = random.Random(0)
        seq = [gen.randrange(config.vocab_size) for _ in range(12)]
        others = [[gen.randrange(config.vocab_size) for _ in range(20)] for _ in range(15)]
        row = {}
        for blocks in (True, False):
            runner = ModelRunner(model, num_slots=16, max_len=64)
            if not blocks:
                runner.gemm_block = None
            me, *rest = [runner.alloc_slot() for _ in range(16)]
            alone = [runner.forward([me], [[t]])[0] for t in seq]
            runner.rollback(me, 11)
            runner.forward(rest, [o[:12] for o in others], num_logits=0)
            beside = runner.forward([me, *rest], [[seq[11]], *[o[12:20] for o in others]], num_logits=[1] + [8] * 15)
            diff = (beside[0] - alone[11]).abs().max().item()
            key = (
                (f"blocks of {runner.gemm_block} rows" if runner.gemm_block else "runner, no blocks here")
                if blocks
                else "one GEMM"
            )
            row[key] = "equal" if torch.equal(beside[0], alone[11]) else f"DIFFERS: max |diff| {diff:.3g}"
        out[str(dtype)] = row
        del model
    return out


def prometheus(device: str, root: Path) -> dict:
    """The real NVML, end to end to the router's Prometheus series: a draft worker started by hand
    (``python -m draft_worker``, tiny model, this GPU) is polled through its Info RPC as
    router/telemetry_loop.py polls it, idle and while this process runs a bf16 GEMM loop on the same
    GPU; the sample goes through the router's ``Metrics.record_device`` and the specdec_device_*
    lines of its /metrics text are kept."""
    import os
    import subprocess
    import threading

    from router.metrics import Metrics
    from specdec.rpc import worker_pb2, worker_pb2_grpc
    from specdec.rpc.telemetry import sample_from_proto
    from specdec.rpc.worker_secret import SECRET_ENV, worker_channel

    paths = _tiny(root)
    os.environ[SECRET_ENV] = "gpu-check-secret-0123456789"
    proc = subprocess.Popen(
        [sys.executable, "-m", "draft_worker", "--model", str(paths["llama-draft"]), "--device", device]
        + ["--dtype", "bfloat16", "--port", "0"],
        cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    out: dict = {}
    try:
        line = proc.stdout.readline()
        if "serving" not in line:
            err = proc.stderr.read()[-2000:] if proc.poll() is not None else ""
            return {"error": f"worker did not start: {line!r} {err}"}
        metrics = Metrics()
        big = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
        with worker_channel(line.split()[-1]) as channel:
            stub = worker_pb2_grpc.DraftServiceStub(channel)

            def poll(phase: str) -> None:
                info = stub.Info(worker_pb2.InfoRequest(), timeout=10)
                sample = sample_from_proto(info.telemetry) if info.HasField("telemetry") else None
                if sample is not None:
                    metrics.record_device("draft-0", "draft", sample)
                lines = [ln for ln in metrics.text().decode().splitlines() if ln.startswith("specdec_device_")]
                out[phase] = {"sample": vars(sample) if sample else None, "metrics": lines}

            time.sleep(3.0)
            poll("idle")
            stop = threading.Event()

            def load() -> None:
                while not stop.is_set():
                    for _ in range(20):
                        big @ big
                    torch.cuda.synchronize()

            worker = threading.Thread(target=load)
            worker.start()
            time.sleep(3.0)
            poll("another process's bf16 GEMM loop on the GPU")
            stop.set()
            worker.join()
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
    return out


def engine(device: str, quick: bool, tiny: bool) -> dict:
    import gpu_engine  # scripts/gpu_engine.py, imported here: the other parts never need it

    return gpu_engine.engine(device, quick, tiny)


def failures(report: dict) -> list[str]:
    """The parts that raised or reported failures, one line each."""
    found = []
    for name, part in report.items():
        if isinstance(part, dict):
            found += [f"{name}: raised"] if "error" in part else [f"{name}: {f}" for f in part.get("failures", [])]
    return found


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default="gpu_check.json")
    p.add_argument("--quick", action="store_true", help="fewer examples and repeats")
    p.add_argument("--tiny", action="store_true", help="engine: toy shapes of the same models (a CPU's run)")
    p.add_argument("--examples", type=int, default=10, help="invariance: hypothesis examples per model")
    p.add_argument("--only", default="", help="invariance: only the models whose name holds this")
    p.add_argument("--parts", default="telemetry,gemm,ops,invariance,lossless,bigbatch,cost")
    args = p.parse_args(argv)
    report: dict = {"device": args.device, "torch": torch.__version__}
    if args.device.startswith("cuda"):
        report["gpu"] = torch.cuda.get_device_name(0)
    root = functools.cache(lambda: Path(tempfile.mkdtemp(prefix="gpu_check.")))  # made by the parts that write
    parts = {
        "telemetry": lambda: telemetry(args.device),
        "gemm": lambda: gemm_classes(args.device),
        "ops": lambda: ops(args.device),
        "invariance": lambda: invariance(args.device, root() / "inv", 3 if args.quick else args.examples, args.only),
        "lossless": lambda: lossless(args.device, root() / "e2e"),
        "bigbatch": lambda: big_batch(args.device),
        "cost": lambda: gpu_costs.cost(args.device, args.quick),
        "blockcost": lambda: gpu_costs.block_cost(args.device, args.quick),
        "roofline": lambda: gpu_costs.roofline(args.device, args.quick),
        "prometheus": lambda: prometheus(args.device, root() / "prom"),
        "graphs": lambda: gpu_costs.graphs(args.device, args.quick),
        "bmmblocks": lambda: gpu_costs.bmm_blocks(args.device, args.quick),
        "engine": lambda: engine(args.device, args.quick, args.tiny),
    }
    for name in args.parts.split(","):
        t0 = time.monotonic()
        try:
            report[name] = parts[name]()
        except Exception:  # noqa: BLE001 - one part's failure must not hide the others'
            report[name] = {"error": traceback.format_exc()[-3000:]}
        print(
            f"== {name} ({time.monotonic() - t0:.1f} s)\n{json.dumps(report[name], indent=1, default=str)[:6000]}",
            flush=True,
        )
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1, default=str))
    failed = failures(report)
    print("FAILED:\n  " + "\n  ".join(failed) if failed else "no failures", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
