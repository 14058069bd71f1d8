"""vLLM's side of bench/vs_vllm.sh: one vLLM configuration over the prompts at each client count.

Runs with the Python of vLLM's own environment (bench/.venv-vllm) and imports vLLM, never specdec:
the driver (bench/vs_vllm.py) hands it a job file with the prompts already as token ids, made with
specdec's prompt loading and the target's tokenizer, so both stacks decode the very same ids.

Configurations: ``target`` (the target alone), ``draft`` (a draft model, k tokens a round) and
``ngram`` (prompt lookup, k tokens a round, n-grams of ngram_min..ngram_max). Greedy, bf16 by
default. Concurrency c means the requests go to vLLM's offline ``LLM.generate`` as batches of c,
one batch after the other; tokens/s is the output tokens over the batches' summed wall time.
Before each client count one short batch of that size runs unmeasured, so the first call's costs
(compilation, allocation) stay out of the figures.

Prefix caching is off: the same prompts come back at every client count, and a cache hit would
skip prefills that specdec (which caches no prefixes across requests) does every time.

    bench/.venv-vllm/bin/python bench/vllm_side.py --job JOB.json --out RESULT.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

SPEC_COUNTERS = (
    "vllm:spec_decode_num_drafts",
    "vllm:spec_decode_num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens",
)
WARMUP_TOKENS = 8


def speculative_config(job: dict) -> dict | None:
    if job["config"] == "target":
        return None
    if job["config"] == "draft":
        return {"method": "draft_model", "model": job["draft"], "num_speculative_tokens": job["k"]}
    if job["config"] == "ngram":
        return {
            "method": "ngram",
            "num_speculative_tokens": job["k"],
            "prompt_lookup_min": job["ngram_min"],
            "prompt_lookup_max": job["ngram_max"],
        }
    raise SystemExit(f"unknown vLLM configuration {job['config']!r}: target, draft or ngram")


def _counters(llm) -> dict[str, int]:
    try:
        return {m.name: int(m.value) for m in llm.get_metrics() if m.name in SPEC_COUNTERS}
    except Exception:  # noqa: BLE001 - the acceptance figures are context; the run stands without them
        return {}


def _spec_stats(before: dict, after: dict) -> dict | None:
    d = {name.split("spec_decode_num_")[-1]: after.get(name, 0) - before.get(name, 0) for name in SPEC_COUNTERS}
    if not d["draft_tokens"]:
        return None
    return {
        **d,
        "acceptance": round(d["accepted_tokens"] / d["draft_tokens"], 4),
        # tokens a request commits per verify round: its accepted drafts plus the target's own
        "tau": round(1 + d["accepted_tokens"] / d["drafts"], 3) if d["drafts"] else None,
    }


def run_clients(llm, job: dict, clients: int) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = job["prompts"]
    jobs = [prompts[i % len(prompts)] for i in range(job["requests"])]
    params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"])
    if job.get("warmup", True):
        warm = [TokensPrompt(prompt_token_ids=jobs[i % len(jobs)]["token_ids"]) for i in range(clients)]
        llm.generate(warm, SamplingParams(temperature=0.0, max_tokens=WARMUP_TOKENS), use_tqdm=False)
    before = _counters(llm)
    records, wall = [], 0.0
    for start in range(0, len(jobs), clients):
        batch = jobs[start : start + clients]
        t0 = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p["token_ids"]) for p in batch], params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        wall += seconds
        for p, out in zip(batch, outs):
            done = out.outputs[0]
            records.append(
                {
                    "id": p["id"],
                    "token_ids": list(done.token_ids),
                    "tokens": len(done.token_ids),
                    "finish_reason": done.finish_reason,
                    "batch_s": round(seconds, 5),
                }
            )
    tokens = sum(r["tokens"] for r in records)
    return {
        "clients": clients,
        "requests": len(records),
        "tokens": tokens,
        "wall_s": round(wall, 4),
        "throughput_tok_s": round(tokens / wall, 3) if wall > 0 else None,
        "spec": _spec_stats(before, _counters(llm)),
        "records": records,
    }


def run(job: dict) -> dict:
    import torch
    import vllm
    from vllm import LLM

    # the settings as given, before vLLM adds its own for its processes
    env = {k: v for k, v in sorted(os.environ.items()) if k.startswith(("VLLM_", "OMP_", "KMP_", "LD_PRELOAD"))}
    t0 = time.perf_counter()
    llm = LLM(
        model=job["model"],
        tokenizer=job["model"],
        dtype=job["dtype"],
        seed=0,
        max_model_len=job["max_model_len"],
        max_num_seqs=max(job["clients"]),
        enable_prefix_caching=False,
        speculative_config=speculative_config(job),
        enforce_eager=job.get("enforce_eager", False),
        disable_log_stats=False,  # the speculative counters (acceptance) come from the stats
    )
    load_s = time.perf_counter() - t0
    levels = []
    for c in job["clients"]:
        print(f"... vLLM {job['config']}: {c} client(s), {job['requests']} requests", file=sys.stderr, flush=True)
        levels.append(run_clients(llm, job, c))
    return {
        "config": job["config"],
        "speculative_config": speculative_config(job),
        "model": job["model"],
        "draft": job["draft"] if job["config"] == "draft" else None,
        "dtype": job["dtype"],
        "max_tokens": job["max_tokens"],
        "load_s": round(load_s, 2),
        "levels": levels,
        "versions": {"vllm": vllm.__version__, "torch": torch.__version__, "python": platform.python_version()},
        "env": env,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--job", required=True, help="the job file bench/vs_vllm.py writes")
    p.add_argument("--out", required=True, help="where the result goes (JSON)")
    args = p.parse_args(argv)
    with open(args.job) as f:
        job = json.load(f)
    result = run(job)
    with open(args.out, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
