"""The service against the engine at batch 1: what a round's gRPC hops cost at this device's
forward times.

The router (router.server.RouterThread) and the two workers' gRPC servers run in this process,
without Ray, on loopback, over the very runners the engine uses (so the same weights): the
target's TargetServicer and a DraftServicer over the fixed-acceptance drafter, each on its own
sync gRPC server with the worker-secret check, as tests/integration/test_tokenizer_rpc.py serves
them. The router runs the engine's round: fixed k, one micro-batch, no pre-drafting, drafts
always awaited. One prompt goes through the engine and through the service at k = 0 and with
speculation; the difference of their mean time per round (after the first, which holds the
prefill) is the hops' overhead per round. The router's own round phases (router/metrics.py) say
where it goes: the Verify's transport and the servers' threads (rpc), the router's work (router),
the drafter's call (draft wait).

The router and the workers need grpcio, protobuf and prometheus_client; where this Python lacks
them the section is skipped, saying which.
"""

from __future__ import annotations

import os
import secrets
from contextlib import ExitStack

from fixed_acceptance import FixedAcceptanceDrafter
from gpu_engine_e2e import acceptance, make_prompts, run_engine

from specdec.core.engine import KPolicy


def _missing() -> str | None:
    try:
        import draft_worker.servicer  # noqa: F401 - the imports the service needs, tried at once
        import router.server  # noqa: F401
        import specdec.rpc.client  # noqa: F401
        import target_worker.servicer  # noqa: F401
    except ImportError as exc:
        return exc.name or str(exc)
    return None


def _serve(stack: ExitStack, add, servicer, service: str, secret: str) -> str:
    from specdec.rpc.server import start_server, stop_server
    from specdec.rpc.worker_secret import worker_interceptor

    server, port = start_server([(add, servicer, service)], interceptors=[worker_interceptor(secret)])
    stack.callback(stop_server, server, 0)
    return f"127.0.0.1:{port}"


def _start(stack: ExitStack, pair, drafter, k: int, max_tokens: int):
    """The workers and the router; returns (client, draft servicer, the router's metrics)."""
    from draft_worker.servicer import SERVICE_NAME as DRAFT_SERVICE
    from draft_worker.servicer import DraftServicer
    from router.config import RebalanceConfig, RouterConfig
    from router.server import RouterThread, TargetBinding
    from router.workers import StaticEndpoint
    from specdec.core.target import TargetVerifier
    from specdec.core.tokenizer_spec import vocab_fingerprint
    from specdec.rpc import worker_pb2_grpc
    from specdec.rpc.client import SpecdecClient
    from specdec.rpc.worker_secret import SECRET_ENV, current_secret
    from target_worker.servicer import TargetServicer

    # the router sends this process's worker secret; a bench run makes one as `specdec serve` does
    secret = current_secret() or os.environ.setdefault(SECRET_ENV, secrets.token_urlsafe(32))
    device = pair.target.device.type
    target = TargetServicer(
        TargetVerifier(pair.target), pair.tokenizer, model_name=pair.names[0], dtype="bfloat16", device=device
    )
    draft = DraftServicer(
        drafter,
        model_name=pair.names[1],
        dtype="bfloat16",
        device=device,
        vocab_size=pair.vocab_size,
        max_context=pair.draft.max_len,
        num_slots=pair.draft.num_slots,
        tokenizer_fingerprint=vocab_fingerprint(pair.tokenizer.get_vocab()),
    )
    target_name = "specdec.v1.TargetService"
    t_addr = _serve(stack, worker_pb2_grpc.add_TargetServiceServicer_to_server, target, target_name, secret)
    d_addr = _serve(stack, worker_pb2_grpc.add_DraftServiceServicer_to_server, draft, DRAFT_SERVICE, secret)
    config = RouterConfig(
        port=0,
        metrics_port=None,
        http_port=None,
        k_policy=KPolicy(k=k, adaptive=False, k_min=1, k_max=k),
        micro_batches=1,
        predraft=False,
        draft_deadline_factor=0.0,  # always the 5 s deadline: no round fails open on timing noise
        rebalance=RebalanceConfig(enabled=False),
        default_max_tokens=max_tokens,
    )
    binding = TargetBinding(
        "bench", StaticEndpoint(t_addr, "target-0"), StaticEndpoint(d_addr, "draft-0"), "bench-draft", tokenizer=None
    )
    router = RouterThread([binding], config).start(connect_timeout=120)
    stack.callback(router.stop, 0)
    client = SpecdecClient(router.address)
    stack.callback(client.close)
    return client, draft, router.metrics


PHASES = ("round", "draft_wait", "verify", "rpc", "router")  # router/metrics.py: specdec_round_phase_seconds


def _phase_sums(metrics) -> dict[str, float]:
    """The router's round phases so far: each one's total seconds, and the rounds counted."""
    out = {}
    for family in metrics.phase.collect():
        for sample in family.samples:
            if sample.name.endswith("_sum"):
                out[sample.labels["phase"]] = sample.value
            elif sample.name.endswith("_count") and sample.labels["phase"] == "round":
                out["rounds"] = sample.value
    return out


def _phases(metrics, run) -> tuple[dict, dict[str, float]]:
    """``run()``'s result, and where its rounds' time went by the router's own phases, ms a round:
    draft_wait (the Propose), verify (the Verify's wall time), rpc (of that, all but the worker's
    own compute: serialisation, loopback, the servers' threads) and router (the router's own work)."""
    before = _phase_sums(metrics)
    result = run()
    after = _phase_sums(metrics)
    rounds = after["rounds"] - before.get("rounds", 0.0)
    if not rounds:
        return result, {}
    return result, {p: round(1e3 * (after[p] - before.get(p, 0.0)) / rounds, 3) for p in PHASES if p in after}


def _through_service(client, prompt: list[int], max_tokens: int, k: int) -> dict:
    chunks = list(
        client.generate_stream(
            prompt_token_ids=prompt, max_tokens=max_tokens, ignore_eos=True, mode="draft" if k else "off", k=k
        )
    )
    times = [c.time for c in chunks if c.token_ids]
    stats = chunks[-1].stats or {}
    # A chunk is a round's committed tokens (its accepted drafts and the target's own), and a round
    # drafts what the k policy allows before max_tokens: the rounds' (drafted, accepted), where the
    # counts agree with the service's own.
    rounds, generated = [], 0
    for c in chunks:
        if c.token_ids:
            rounds.append((min(k, max_tokens - generated - 1), len(c.token_ids) - 1))
            generated += len(c.token_ids)
    agree = len(rounds) == stats.get("rounds") and sum(d for d, _ in rounds) == stats.get("drafted")
    return {
        "tokens": [t for c in chunks for t in c.token_ids],
        "round ms": (times[-1] - times[0]) / (len(times) - 1) * 1e3 if len(times) > 1 else float("nan"),
        "stats": stats,
        "chunks": len(times),
        "rounds": rounds if agree else None,
    }


def service_vs_engine(pair, k: int, rate: float, prompt_len: int, max_tokens: int) -> dict:
    missing = _missing()
    if missing is not None:
        return {
            "skipped": f"the router and the workers need {missing!r} (grpcio, protobuf, prometheus_client): not here"
        }
    prompt = make_prompts(pair.vocab_size, 1, prompt_len, seed=1)[0]
    out: dict = {"k": k, "a set": rate, "prompt tokens": prompt_len, "max tokens": max_tokens, "failures": []}
    with ExitStack() as stack:
        warm = run_engine(pair.target, pair.tokenizer, [prompt], 4)
        client, draft, metrics = _start(
            stack, pair, FixedAcceptanceDrafter(pair.draft, [(prompt, warm.tokens[0])], rate), k, 4
        )
        for warm_k in (0, k):  # the channels, the router's loop, the servicers' first calls
            _through_service(client, prompt, 4, warm_k)
        ref = run_engine(pair.target, pair.tokenizer, [prompt], max_tokens)
        served_ref, ref_phases = _phases(metrics, lambda: _through_service(client, prompt, max_tokens, 0))
        plan = [(prompt, ref.tokens[0])]
        drafter = FixedAcceptanceDrafter(pair.draft, plan, rate)
        spec = run_engine(pair.target, pair.tokenizer, [prompt], max_tokens, drafter, k)
        draft.drafter = served_drafter = FixedAcceptanceDrafter(pair.draft, plan, rate)  # the same plan and coins
        served, spec_phases = _phases(metrics, lambda: _through_service(client, prompt, max_tokens, k))
    rows = {
        "k=0": (ref, served_ref, None, ref_phases),
        f"k={k}, a={rate}": (spec, served, served_drafter, spec_phases),
    }
    for name, (engine_run, service_run, served_by, phases) in rows.items():
        stats = service_run["stats"]
        row = out[name] = {
            "engine ms/round": round(engine_run.round_ms(), 3),
            "service ms/round": round(service_run["round ms"], 3),
            "overhead ms/round": round(service_run["round ms"] - engine_run.round_ms(), 3),
            "engine rounds": len(engine_run.verify_s),
            "service rounds": stats.get("rounds"),
            "service chunks": service_run["chunks"],
            "fail-open rounds": stats.get("fail_open_rounds", 0),
            "identical to engine k=0": service_run["tokens"] == ref.tokens[0],
            "router phases ms/round": phases,
        }
        if not row["identical to engine k=0"]:
            out["failures"].append(f"{name}: the service's tokens differ from the engine's at k = 0")
        if served_by is not None:
            row["engine identical to k=0"] = engine_run.tokens == ref.tokens
            if not row["engine identical to k=0"]:
                out["failures"].append(f"{name}: the engine's tokens differ from its own at k = 0")
            row["a measured (engine)"] = round(acceptance(engine_run.rounds)[0], 4)
            if service_run["rounds"] is not None:
                row["a measured (service)"] = round(acceptance(service_run["rounds"])[0], 4)
            row["accepted"], row["accepted as planned"] = stats.get("accepted"), served_by.planned_accepted
            if not row["fail-open rounds"] and stats.get("accepted") != served_by.planned_accepted:
                out["failures"].append(
                    f"{name}: the service accepted {stats.get('accepted')}, the plan says {served_by.planned_accepted}"
                )
    return out
