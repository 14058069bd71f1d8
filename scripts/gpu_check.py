"""The checks that need a GPU, in one run (bench/NOTES.md "GPU check"): what a lent H100/H200
session runs, since CI and the development machines have none.

    python scripts/gpu_check.py [--out gpu_check.json] [--device cuda] [--quick]

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
7. cost: the invariant forward against the fast one, random Qwen2.5-1.5B (28 layers), bf16.
8. blockcost: the CUDA GEMM blocks' own cost, the forwards interleaved call by call.
9. roofline: the runner's forward against the catalog's roofline price for this GPU (issue 14).
10. prometheus: the real NVML through a draft worker's Info RPC into the router's
    specdec_device_* series (issue 11).
11. graphs: transformers' forward with a static cache, eager and replayed from a CUDA graph, against
    the roofline: what the launches cost.
12. bmmblocks: whether one batched GEMM gives the rows of the invariant forward's 64-row blocks.

Each part runs on its own; a failure is recorded (with its traceback) and the next part runs.
"""

from __future__ import annotations

import argparse
import importlib.util
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
sys.path.insert(0, str(ROOT))


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


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
    shapes = dict(
        _script("invariance").LINEAR_SHAPES, **{"qwen1.5b k": (256, 1536), "qwen1.5b lm_head": (151936, 1536)}
    )
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
    return _script("invariance").probe_ops(device)


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
    load = _script("invariance")._load
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
        model = _script("invariance")._load("random:qwen2.5-1.5b", dtype, device, layers=2)
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


def block_cost(device: str, quick: bool) -> dict:
    """Median ms per call of the invariant forward with the GEMM blocks and without, and of the
    fast forward, interleaved call by call (random Qwen2.5-1.5B, 28 layers, bf16, context 256)."""
    import statistics

    from specdec.core.runner import ModelRunner

    runner = ModelRunner(_script("invariance")._load("random:qwen2.5-1.5b", "bfloat16", device), 8, 272)
    block = runner.gemm_block or 64
    slots = [runner.alloc_slot() for _ in range(8)]
    runner.forward(slots, [[i % 200 for i in range(256)]] * 8, num_logits=0)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    variants = {
        "fast": (False, None),
        f"invariant, blocks of {block}": (True, block),
        "invariant, one GEMM": (True, None),
    }
    out = {}
    for name, (batch, new) in {"decode b=1": (1, 1), "decode b=8": (8, 1), "verify 6 b=8": (8, 6)}.items():
        times: dict[str, list[float]] = {v: [] for v in variants}
        for i in range((5 if quick else 20) + 2):
            for v, (invariant, gemm_block) in variants.items():
                runner.gemm_block = gemm_block
                sync()
                t0 = time.perf_counter()
                runner.forward(slots[:batch], [[7] * new] * batch, num_logits=new, invariant=invariant)
                sync()
                if i >= 2:
                    times[v].append((time.perf_counter() - t0) * 1e3)
                for s in slots[:batch]:
                    runner.rollback(s, 256)
        out[name] = {v: round(statistics.median(t), 2) for v, t in times.items()}
    return out


def cost(device: str, quick: bool) -> dict:
    return _script("invariance").time_cost("random:qwen2.5-1.5b", "bfloat16", 256, 5 if quick else 20, device)


ROOFLINE_CASES = {  # name: (rows, tokens per row); decode and verify over a 256-token context
    "decode b=1": (1, 1),
    "decode b=8": (8, 1),
    "decode b=32": (32, 1),
    "decode b=64": (64, 1),
    "verify 5 b=1": (1, 5),
    "verify 5 b=8": (8, 5),
    "verify 5 b=32": (32, 5),
    "prefill 512": (1, 512),
    "prefill 2048": (1, 2048),
    "prefill 4x512": (4, 512),
}


def _median_ms(call, repeat: int, digits: int = 2) -> float:
    """Median wall ms of ``repeat`` calls after two warm-up calls, the GPU synchronized around each."""
    import statistics

    times = []
    for i in range(repeat + 2):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        call()
        torch.cuda.synchronize()
        if i >= 2:
            times.append((time.perf_counter() - t0) * 1e3)
    return round(statistics.median(times), digits)


def _roofline_model(device: str, spec: str, shape, costs, eff, ctx: int, repeat: int) -> dict:
    from specdec.core.runner import ModelRunner

    model = _script("invariance")._load(spec, "bfloat16", device)
    runner = ModelRunner(model, num_slots=64, max_len=2048 + 8)
    slots = [runner.alloc_slot() for _ in range(64)]
    for i in range(0, 64, 8):
        runner.forward(slots[i : i + 8], [[(7 * j) % 1000 for j in range(ctx)]] * 8, num_logits=0)
    out = {}
    for case, (rows, width) in ROOFLINE_CASES.items():  # the prefills last: they drop the context
        prefill = case.startswith("prefill")
        start, logits = (0, 1) if prefill else (ctx, width)
        row = {}
        for variant, invariant in (("fast", False), ("invariant", True)):

            def call(rows=rows, width=width, invariant=invariant, start=start, logits=logits):
                for slot in slots[:rows]:
                    runner.rollback(slot, start)
                runner.forward(slots[:rows], [[7] * width] * rows, num_logits=logits, invariant=invariant)

            row[variant] = _median_ms(call, repeat)
        predicted = (costs.prefill_s(rows, width, 0) if prefill else costs.verify_s(rows, width, ctx)) * 1e3
        bound = predicted - shape.layers * eff.forward_overhead_ms_per_layer
        row["roofline"] = round(predicted, 3)
        row["fast / roofline"] = round(row["fast"] / predicted, 1)
        row["implied overhead ms per layer (fast)"] = round((row["fast"] - bound) / shape.layers, 3)
        out[case] = row
    try:  # transformers' own eager decode with its cache, for scale
        from transformers import DynamicCache

        for rows in (1, 8):
            cache = DynamicCache()
            with torch.no_grad():
                model(torch.full((rows, ctx), 7, device=device), past_key_values=cache, use_cache=True)

            def hf(rows=rows, cache=cache):
                with torch.no_grad():
                    model(torch.full((rows, 1), 7, device=device), past_key_values=cache, use_cache=True)
                cache.crop(-1)  # drop the decoded token again

            out[f"decode b={rows}"]["transformers eager"] = _median_ms(hf, repeat)
    except Exception as exc:  # noqa: BLE001 - the reference is optional
        out["transformers eager"] = f"failed: {exc!r}"[:300]
    return out


def roofline(device: str, quick: bool) -> dict:
    """The runner's forward on this GPU against the catalog's roofline for it (``specdec plan``'s
    price, cluster/planning/costs.py), random Qwen2.5-Coder 1.5B and 0.5B shapes, bf16, context 256:
    median ms per call of the fast and the invariant forward, transformers' own eager decode beside
    them, and the per-layer overhead the measured time implies over the roofline's bound."""
    from cluster.planning.catalog import load_catalog
    from cluster.planning.costs import RooflineCosts

    catalog = load_catalog()
    gpu = "H200-SXM" if "H200" in torch.cuda.get_device_name(0) else "H100-SXM"
    eff, ctx = catalog.efficiency, 256
    out: dict = {"catalog device": gpu, "efficiency": vars(eff), "context": ctx, "models": {}}
    for size in ("1.5b", "0.5b"):
        spec, name = f"random:qwen2.5-{size}", f"qwen2.5-coder-{size}-instruct"
        shape = catalog.model(name)
        costs = RooflineCosts(shape, catalog.device(gpu), 1, None, None, catalog)
        out["models"][name] = _roofline_model(device, spec, shape, costs, eff, ctx, 5 if quick else 12)
        torch.cuda.empty_cache()
    return out


GRAPH_CASES = {
    "decode b=1": (1, 1),
    "decode b=8": (8, 1),
    "decode b=32": (32, 1),
    "decode b=64": (64, 1),
    "verify 5 b=8": (8, 5),
}


def _graph_case(model, device: str, rows: int, width: int, ctx: int, repeat: int) -> dict:
    from transformers import StaticCache

    # room for every call's tokens: transformers 5.x advances the cache's own position whatever
    # cache_position says, in eager calls and (on the device) in graph replays alike
    cache = StaticCache(config=model.config, max_cache_len=ctx + width * (2 * repeat + 16))
    with torch.no_grad():
        model(
            torch.full((rows, ctx), 7, device=device),
            past_key_values=cache,
            cache_position=torch.arange(ctx, device=device),
        )
        ids = torch.full((rows, width), 7, device=device)
        positions = torch.arange(ctx, ctx + width, device=device)

        def step():
            return model(ids, past_key_values=cache, cache_position=positions)

        out = {"eager, static cache": _median_ms(step, repeat)}
        if device.startswith("cuda"):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):
                    step()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
            out["CUDA graph replay"] = _median_ms(graph.replay, repeat)
    return out


def graphs(device: str, quick: bool) -> dict:
    """What the launches cost: transformers' forward with a static KV cache, run eagerly and
    captured once in a CUDA graph then replayed, random Qwen2.5-Coder 1.5B and 0.5B shapes, bf16,
    context 256, with the catalog's roofline price beside (its efficiencies assume a tuned engine:
    does a graphed forward reach them?)."""
    from cluster.planning.catalog import load_catalog
    from cluster.planning.costs import RooflineCosts

    catalog = load_catalog()
    gpu = "H200-SXM" if "H200" in torch.cuda.get_device_name(0) else "H100-SXM"
    out: dict = {"catalog device": gpu, "context": 256, "models": {}}
    for size in ("1.5b", "0.5b"):
        shape = catalog.model(f"qwen2.5-coder-{size}-instruct")
        costs = RooflineCosts(shape, catalog.device(gpu), 1, None, None, catalog)
        model = _script("invariance")._load(f"random:qwen2.5-{size}", "bfloat16", device)
        rows_out = out["models"][shape.name] = {}
        for case, (rows, width) in GRAPH_CASES.items():
            try:
                row = _graph_case(model, device, rows, width, 256, 5 if quick else 20)
            except Exception as exc:  # noqa: BLE001 - one case's failure must not hide the others'
                row = {"error": f"{exc!r}"[:500]}
            row["roofline"] = round(costs.verify_s(rows, width, 256) * 1e3, 3)
            rows_out[case] = row
            torch.cuda.empty_cache()
        del model
    return out


def bmm_blocks(device: str, quick: bool) -> dict:
    """Can one batched GEMM replace the invariant forward's loop over 64-row blocks (32 launches a
    weight for a 2048-token prefill)? For the Qwen2.5-1.5B projections in bf16: is block 0 of
    ``torch.bmm`` over n blocks (the weight expanded, stride 0) bitwise the same for every n, and
    the same as the 64-row GEMM the runner uses now; and the median ms of the three ways at 2048 rows."""

    shapes = _script("invariance").LINEAR_SHAPES  # the lm_head prefills no logits: left out
    gen = torch.Generator().manual_seed(0)
    block, out = 64, {}
    for name, (n, k) in shapes.items():
        if not name.startswith("qwen"):
            continue
        w = (torch.randn(n, k, generator=gen) * 0.05).to(device, torch.bfloat16)
        x = torch.randn(2048, k, generator=gen).to(device, torch.bfloat16)
        gemm = F.linear(x[:block], w)

        def bmm(rows: int, w=w, x=x, k=k):
            blocks = rows // block
            return torch.bmm(x[:rows].view(blocks, block, k), w.t().expand(blocks, k, w.shape[0]))

        firsts = {nb: bmm(nb * block)[0] for nb in (1, 2, 3, 4, 8, 16, 32)}
        row = {
            "bmm block 0 the same for every n": all(torch.equal(v, firsts[1]) for v in firsts.values()),
            "bmm equals the 64-row GEMM": torch.equal(firsts[1], gemm),
            "bmm every block equals its own 64-row GEMM": all(
                torch.equal(b, F.linear(x[i * block : (i + 1) * block], w)) for i, b in enumerate(bmm(2048))
            ),
        }
        ways = {
            "loop of 64-row GEMMs": lambda w=w, x=x: torch.cat([F.linear(b, w) for b in x.split(block)]),
            "one bmm": lambda: bmm(2048),
            "one GEMM (not invariant)": lambda w=w, x=x: F.linear(x, w),
        }
        for way, call in ways.items():
            row[f"{way}, ms"] = _median_ms(call, 5 if quick else 20, digits=3)
        out[name] = row
    return out


def prometheus(device: str, root: Path) -> dict:
    """The real NVML, end to end to the router's Prometheus series: a draft worker started by hand
    (``python -m draft_worker``, tiny model, this GPU) is polled through its Info RPC as
    router/rebalancer.py polls it, idle and while this process runs a bf16 GEMM loop on the same
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default="gpu_check.json")
    p.add_argument("--quick", action="store_true", help="fewer examples and repeats")
    p.add_argument("--examples", type=int, default=10, help="invariance: hypothesis examples per model")
    p.add_argument("--only", default="", help="invariance: only the models whose name holds this")
    p.add_argument("--parts", default="telemetry,gemm,ops,invariance,lossless,bigbatch,cost")
    args = p.parse_args()
    report: dict = {"device": args.device, "torch": torch.__version__}
    if args.device.startswith("cuda"):
        report["gpu"] = torch.cuda.get_device_name(0)
    root = Path(tempfile.mkdtemp(prefix="gpu_check."))
    parts = {
        "telemetry": lambda: telemetry(args.device),
        "gemm": lambda: gemm_classes(args.device),
        "ops": lambda: ops(args.device),
        "invariance": lambda: invariance(args.device, root / "inv", 3 if args.quick else args.examples, args.only),
        "lossless": lambda: lossless(args.device, root / "e2e"),
        "bigbatch": lambda: big_batch(args.device),
        "cost": lambda: cost(args.device, args.quick),
        "blockcost": lambda: block_cost(args.device, args.quick),
        "roofline": lambda: roofline(args.device, args.quick),
        "prometheus": lambda: prometheus(args.device, root / "prom"),
        "graphs": lambda: graphs(args.device, args.quick),
        "bmmblocks": lambda: bmm_blocks(args.device, args.quick),
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
        Path(args.out).write_text(json.dumps(report, indent=1, default=str))


if __name__ == "__main__":
    main()
