"""What forwards cost on a GPU, the timing parts of scripts/gpu_check.py (which runs them with the
checks, by name, and writes one report): docs/results.md, "On a GPU".

- cost: the invariant forward against the fast one, random Qwen2.5-1.5B (28 layers), bf16.
- blockcost: the CUDA GEMM blocks' own cost, the forwards interleaved call by call.
- roofline: the runner's forward against the planning catalog's roofline price for this GPU.
- graphs: transformers' forward with a static cache, eager and replayed from a CUDA graph, against
  the roofline: what the launches cost.
- bmmblocks: whether one batched GEMM gives the rows of the invariant forward's 64-row blocks.

Their pieces (the runner's forward timed per case, the copy bandwidth, the bytes a forward moves,
the catalog's price, transformers' graphed forward) also serve scripts/gpu_engine.py.
"""

from __future__ import annotations

import statistics
import time

import invariance
import torch
import torch.nn.functional as F


def block_cost(device: str, quick: bool) -> dict:
    """Median ms per call of the invariant forward with the GEMM blocks and without, and of the
    fast forward, interleaved call by call (random Qwen2.5-1.5B, 28 layers, bf16, context 256)."""

    from specdec.core.runner import ModelRunner

    runner = ModelRunner(invariance._load("random:qwen2.5-1.5b", "bfloat16", device), 8, 272)
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
    return invariance.time_cost("random:qwen2.5-1.5b", "bfloat16", 256, 5 if quick else 20, device)


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


def sync() -> None:
    """Wait for the GPU's queued work, if this process uses one (a CPU has nothing queued)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _median_ms(call, repeat: int, digits: int = 2) -> float:
    """Median wall ms of ``repeat`` calls after two warm-up calls, the GPU synchronized around each."""

    times = []
    for i in range(repeat + 2):
        sync()
        t0 = time.perf_counter()
        call()
        sync()
        if i >= 2:
            times.append((time.perf_counter() - t0) * 1e3)
    return round(statistics.median(times), digits)


def runner_times(model, cases: dict[str, tuple[int, int]], ctx: int, repeat: int) -> dict:
    """{case: {"fast": ms, "invariant": ms}}: the median ms of specdec's ModelRunner eager forward
    per case (rows, tokens per row): a "prefill" case from an empty cache, the others after ``ctx``
    tokens of context in every row. The decode and verify cases are timed again at the static steps'
    bucketed shapes ("fast static", "invariant static"; specdec/core/static_step.py), on a GPU
    replayed from CUDA graphs captured for these cases' buckets in both numerics (elsewhere run
    eagerly), and "static logits equal" says whether the invariant static step's logits are bitwise
    the eager forward's. Returns the runner too (its sizes price the roofline;
    ``runner.capture_summary()`` says what the graphs took)."""
    from specdec.core.runner import ModelRunner

    rows_max = max(rows for rows, _ in cases.values())
    longest = max(width + (0 if case.startswith("prefill") else ctx) for case, (_, width) in cases.items())
    runner = ModelRunner(model, num_slots=rows_max, max_len=longest + 8, static_shapes=True)
    slots = [runner.alloc_slot() for _ in range(rows_max)]
    static, runner.static = runner.static, None  # first the eager forward alone
    bucketed = {
        case: static.bucket_of(rows, width, ctx + width)
        for case, (rows, width) in cases.items()
        if static is not None and not case.startswith("prefill") and static.fits([width] * rows)
    }
    out: dict = {case: {} for case in cases}

    def time_cases(names, suffix: str) -> dict:
        logits = {}
        for i in range(0, rows_max, 8):  # the context, anew: a prefill case drops it
            for slot in slots[i : i + 8]:
                runner.rollback(slot, 0)
            context = [[(7 * j) % 1000 for j in range(ctx)]] * len(slots[i : i + 8])
            runner.forward(slots[i : i + 8], context, num_logits=0, invariant=True)
        for case in sorted(names, key=lambda c: c.startswith("prefill")):  # the prefills last: they drop the context
            rows, width = cases[case]
            start, n_logits = (0, 1) if case.startswith("prefill") else (ctx, width)
            for variant, invariant in (("fast", False), ("invariant", True)):

                def call(rows=rows, width=width, invariant=invariant, start=start, n_logits=n_logits):
                    for slot in slots[:rows]:
                        runner.rollback(slot, start)
                    return runner.forward(slots[:rows], [[7] * width] * rows, num_logits=n_logits, invariant=invariant)

                out[case][variant + suffix] = _median_ms(call, repeat)
                if invariant:
                    logits[case] = [t.cpu() for t in call()]
        return logits

    eager = time_cases(cases, "")
    if bucketed:
        try:
            for invariant in (False, True):
                static.capture(invariant, sorted(set(bucketed.values())))  # on a GPU; elsewhere nothing
        except Exception as exc:  # noqa: BLE001 - the eager figures stand without the graphs
            for case in bucketed:
                out[case]["static"] = f"capture failed: {exc!r}"[:300]
            return out, runner
        runner.static = static
        replayed = time_cases(bucketed, " static")
        for case in bucketed:
            out[case]["static logits equal"] = all(torch.equal(a, b) for a, b in zip(eager[case], replayed[case]))
    return out, runner


def copy_bandwidth_gbs(device: str, mib: int, repeat: int) -> float:
    """The device's measured memory bandwidth, GB/s: a copy of ``mib`` MiB reads it and writes it."""
    src = torch.ones(mib << 20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = _median_ms(lambda: dst.copy_(src), repeat, digits=4)
    return round(2 * (mib << 20) / (ms / 1e3) / 1e9, 1)


def bytes_roofline_ms(runner, rows: int, width: int, ctx: int, gbs: float) -> float:
    """What a forward of ``rows`` x ``width`` new tokens after ``ctx`` cached ones costs if it only
    moved its bytes at ``gbs``: every weight it multiplies by (the embedding is a lookup of a few
    rows), and the keys and values of every row's context and new tokens, read once."""
    # Packed CPU weights (specdec/core/packed.py) read as many bytes as plain ones.
    weights = sum(w.nbytes for layer in runner.layers for w in vars(layer).values() if hasattr(w, "nbytes"))
    weights += runner.lm_head.nbytes + runner.final_norm.nbytes
    kv_per_token = runner.k_cache[:, 0, :, 0].nbytes * 2  # keys and values, every layer and KV head
    return round((weights + rows * (ctx + width) * kv_per_token) / (gbs * 1e9) * 1e3, 3)


def _roofline_model(device: str, spec: str, shape, costs, eff, ctx: int, repeat: int) -> dict:
    model = invariance._load(spec, "bfloat16", device)
    out, runner = runner_times(model, ROOFLINE_CASES, ctx, repeat)
    del runner
    for case, (rows, width) in ROOFLINE_CASES.items():
        prefill = case.startswith("prefill")
        row = out[case]
        predicted = (costs.prefill_s(rows, width, 0) if prefill else costs.verify_s(rows, width, ctx)) * 1e3
        bound = predicted - shape.layers * eff.forward_overhead_ms_per_layer
        row["roofline"] = round(predicted, 3)
        row["fast / roofline"] = round(row["fast"] / predicted, 1)
        row["implied overhead ms per layer (fast)"] = round((row["fast"] - bound) / shape.layers, 3)
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


def catalog_costs(size: str):
    """(catalog, its row for this GPU, the model's shape, RooflineCosts): ``specdec plan``'s price
    (cluster/planning/costs.py) of Qwen2.5-Coder ``size`` ("1.5b" or "0.5b") on this GPU."""
    from cluster.planning.catalog import load_catalog
    from cluster.planning.costs import RooflineCosts

    catalog = load_catalog()
    gpu = "H200-SXM" if "H200" in torch.cuda.get_device_name(0) else "H100-SXM"
    shape = catalog.model(f"qwen2.5-coder-{size}-instruct")
    return catalog, gpu, shape, RooflineCosts(shape, catalog.device(gpu), 1, None, None, catalog)


def roofline(device: str, quick: bool) -> dict:
    """The runner's forward on this GPU against the catalog's roofline for it (``specdec plan``'s
    price, cluster/planning/costs.py), random Qwen2.5-Coder 1.5B and 0.5B shapes, bf16, context 256:
    median ms per call of the fast and the invariant forward, transformers' own eager decode beside
    them, and the per-layer overhead the measured time implies over the roofline's bound."""
    ctx = 256
    out: dict = {"context": ctx, "models": {}}
    for size in ("1.5b", "0.5b"):
        catalog, gpu, shape, costs = catalog_costs(size)
        out |= {"catalog device": gpu, "efficiency": vars(catalog.efficiency)}
        spec, eff = f"random:qwen2.5-{size}", catalog.efficiency
        out["models"][shape.name] = _roofline_model(device, spec, shape, costs, eff, ctx, 5 if quick else 12)
        torch.cuda.empty_cache()
    return out


GRAPH_CASES = {
    "decode b=1": (1, 1),
    "decode b=8": (8, 1),
    "decode b=32": (32, 1),
    "decode b=64": (64, 1),
    "verify 5 b=8": (8, 5),
}


def graph_case(model, device: str, rows: int, width: int, ctx: int, repeat: int) -> dict:
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
    out: dict = {"context": 256, "models": {}}
    for size in ("1.5b", "0.5b"):
        _, out["catalog device"], shape, costs = catalog_costs(size)
        model = invariance._load(f"random:qwen2.5-{size}", "bfloat16", device)
        rows_out = out["models"][shape.name] = {}
        for case, (rows, width) in GRAPH_CASES.items():
            try:
                row = graph_case(model, device, rows, width, 256, 5 if quick else 20)
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

    shapes = invariance.LINEAR_SHAPES  # the lm_head prefills no logits: left out
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
