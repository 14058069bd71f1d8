"""``scripts/gpu_check.py --parts engine``: specdec's own forward, engine and service on this device,
beside what the hardware and transformers do, in one run (docs/results.md, "On a GPU").

1. forwards: median ms per forward of the ModelRunner (fast and invariant) beside the roofline
   (the bytes a forward moves over the copy bandwidth measured here, and on a catalog GPU the
   planning catalog's price) and transformers' static-cache forward (eager, and on CUDA replayed
   from a CUDA graph), random Qwen2.5 1.5B and 0.5B shapes, bf16: decode b = 1, 8, 32, verify of
   5 tokens b = 1, 8, and a 2048-token prefill (scripts/gpu_costs.py's pieces).
2. e2e: the engine, target-only against speculative at acceptance 0.6 and 0.8, b = 1 and 8, on a
   random Llama-3.1-8B-shaped target with a Llama-3.2-1B-shaped draft (scripts/gpu_engine_e2e.py).
3. service: the router and workers over gRPC on loopback against the engine, b = 1, same models
   (scripts/gpu_engine_service.py).

Every speculative run's tokens are compared with the same engine's (or service's) at k = 0;
``failures`` lists each difference, each section that raised and each acceptance that was not
what was set, and makes gpu_check.py exit with status 1. ``tiny`` runs the same code on toy sizes
of the same architectures (the CPU test, tests/integration/test_gpu_engine_check.py).
"""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass, field

import gpu_costs
import random_models
import torch
from gpu_engine_e2e import NOT_RUN, engine_e2e
from gpu_engine_service import service_vs_engine
from gpu_engine_table import table

from specdec.core.runner import ModelRunner

FORWARD_CASES = {  # name: (rows, tokens per row); decode and verify over the context
    "decode b=1": (1, 1),
    "decode b=8": (8, 1),
    "decode b=32": (32, 1),
    "verify 5 b=1": (1, 5),
    "verify 5 b=8": (8, 5),
    "prefill 2048": (1, 2048),
}
TINY_FORWARD_CASES = {
    **{c: v for c, v in FORWARD_CASES.items() if not c.startswith("prefill")},
    "prefill 256": (1, 256),
}


@dataclass(frozen=True)
class Settings:
    context: int = 256  # forwards: cached tokens before a decode or verify
    repeat: int = 12  # forwards: timed calls per case (after two warm-up calls)
    copy_mib: int = 2048  # the bandwidth probe's buffer
    batches: tuple[int, ...] = (1, 8)
    rates: tuple[float, ...] = (0.6, 0.8)
    k: int = 4
    prompt_tokens: int = 64
    max_tokens: int = 128
    # what is left after this many seconds is marked not run, so that one run fits the minutes a
    # GPU is lent for, however slow a forward turns out there
    budget_s: float = 420.0

    @classmethod
    def of(cls, quick: bool, tiny: bool) -> Settings:
        if tiny:  # toy models on a CPU: enough rounds for the checks, seconds of work
            return cls(context=32, repeat=3, copy_mib=16, prompt_tokens=16, max_tokens=96)
        return cls(repeat=5, max_tokens=48) if quick else cls()


@dataclass
class ModelPair:
    """The engine's target (invariant forward) and draft (fast forward) runners, one tokenizer."""

    target: ModelRunner
    draft: ModelRunner
    tokenizer: object
    vocab_size: int
    names: tuple[str, str]
    capture_errors: dict[str, str] = field(default_factory=dict)  # name: traceback of a failed capture


def build_pair(device: str, tiny: bool, s: Settings) -> ModelPair:
    names = ("llama-3.1-8b", "llama-3.2-1b")
    target, draft = (random_models.build(n, "bfloat16", device, tiny=tiny, seed=i) for i, n in enumerate(names))
    slots, max_len = max(s.batches), s.prompt_tokens + s.max_tokens + s.k + 16
    vocab = target.config.vocab_size
    # Static shapes on a CPU too (on a GPU they are the default): the toy run then takes the paths
    # a GPU's does, the drafter's greedy steps on the device included.
    runners = (
        ModelRunner(target, num_slots=slots, max_len=max_len, static_shapes=True),
        ModelRunner(draft, num_slots=slots, max_len=max_len, invariant_numerics=False, static_shapes=True),
    )
    labels = tuple(f"random {n}" for n in names)
    errors = {}
    for label, runner in zip(labels, runners):
        try:
            runner.capture()  # as specdec/core/build.py does at start-up: CUDA graphs on a GPU, else nothing
        except Exception:  # noqa: BLE001 - the run goes on eagerly; its report says why
            runner.static, errors[label] = None, traceback.format_exc()[-1500:]
    return ModelPair(*runners, random_models.word_tokenizer(vocab), vocab, labels, errors)


def forwards(device: str, tiny: bool, s: Settings) -> dict:
    cases = TINY_FORWARD_CASES if tiny else FORWARD_CASES
    gbs = gpu_costs.copy_bandwidth_gbs(device, s.copy_mib, s.repeat)
    out: dict = {"context": s.context, "copy bandwidth GB/s": gbs, "models": {}, "captured": {}, "failures": []}
    for size in ("1.5b", "0.5b"):
        model = random_models.build(f"qwen2.5-{size}", "bfloat16", device, tiny=tiny)
        rows, runner = gpu_costs.runner_times(model, cases, s.context, s.repeat)
        name = f"qwen2.5-{size} shape" + (", tiny" if tiny else "")
        out["captured"][name] = runner.capture_summary()
        out["failures"] += [
            f"{name} {case}: the static step's logits differ from the eager forward's"
            for case, row in rows.items()
            if row.get("static logits equal") is False
        ] + [f"{name} {case}: {row['static']}" for case, row in rows.items() if "static" in row]
        costs = gpu_costs.catalog_costs(size)[3] if device.startswith("cuda") else None
        for case, (n, width) in cases.items():
            prefill = case.startswith("prefill")
            ctx = 0 if prefill else s.context
            row = rows[case]
            row["roofline, bytes / copy bandwidth"] = gpu_costs.bytes_roofline_ms(runner, n, width, ctx, gbs)
            if costs is not None:
                price = costs.prefill_s(n, width, 0) if prefill else costs.verify_s(n, width, ctx)
                row["catalog roofline"] = round(price * 1e3, 3)
            if not prefill:  # a prefill is compute-bound: launches, what a graph saves, do not count
                try:
                    row |= {
                        f"transformers {k}": v
                        for k, v in gpu_costs.graph_case(model, device, n, width, ctx, s.repeat).items()
                    }
                except Exception as exc:  # noqa: BLE001 - the reference is optional
                    row["transformers"] = f"failed: {exc!r}"[:300]
        out["models"][name] = rows
        del model, runner
        _free(device)
    return out


def _free(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def engine(device: str, quick: bool, tiny: bool = False) -> dict:
    s = Settings.of(quick, tiny)
    deadline = time.monotonic() + s.budget_s
    out: dict = {"settings": vars(s) | {"tiny": tiny, "dtype": "bfloat16"}, "failures": []}
    pair: list[ModelPair] = []  # built once, for the e2e and service sections

    def models() -> ModelPair:
        if not pair:
            pair.append(build_pair(device, tiny, s))
            out["captured"] = {
                name: pair[0].capture_errors.get(name) or runner.capture_summary()
                for name, runner in zip(pair[0].names, (pair[0].target, pair[0].draft))
            }
            out["failures"] += [f"captured: {name} raised" for name, c in out["captured"].items() if isinstance(c, str)]
        return pair[0]

    run = {
        "forwards": lambda: forwards(device, tiny, s),
        "e2e": lambda: engine_e2e(models(), s.batches, s.rates, s.k, s.prompt_tokens, s.max_tokens, deadline),
        "service": lambda: service_vs_engine(
            models(),
            s.k,
            max(s.rates),
            s.prompt_tokens,
            s.max_tokens,
            {"device": device, "quick": quick, "tiny": tiny},
            deadline,
        ),
    }
    for name in run:
        t0 = time.monotonic()
        if t0 > deadline:
            out[name] = dict(NOT_RUN)
            continue
        try:
            out[name] = run[name]()
            out["failures"] += [f"{name}: {f}" for f in out[name].get("failures", [])]
        except Exception:  # noqa: BLE001 - one section's failure must not hide the others'
            out[name] = {"error": traceback.format_exc()[-3000:]}
            out["failures"].append(f"{name}: raised (see its traceback)")
        out[name]["seconds"] = round(time.monotonic() - t0, 1)
        print(f"-- engine: {name} ({out[name]['seconds']} s)", flush=True)
    pair.clear()
    _free(device)
    print(table(out), flush=True)
    return out
