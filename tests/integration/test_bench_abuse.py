"""`specdec bench serve --workload abuse` through the command line against the real service (router +
Ray workers, tiny models) with token auth (A and B hold their own tokens), at tiny sizes: every
scenario is in the report and its counts add up. Structure only, never timings: the figures on
SmolLM2 are in docs/results.md ("Heavy and hostile load")."""

from __future__ import annotations

import json
import logging

import pytest

from specdec.core.log_format import TEXT_FORMAT
from specdec.rpc.api_security import SecurityConfig
from specdec.rpc.client_credentials import ClientCredentials
from tests.integration.service_fixture import running_service

TOKEN_A, TOKEN_B = "abuse-wall-" + "a" * 16, "abuse-victim-" + "b" * 16
BURST, PER_CLIENT, UNREAD, LONG_PROMPTS, LONG_TOKENS, RESTART_TOKENS = 40, 4, 2, 2, 200, 300


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokens")
    (root / "accepted").write_text(f"{TOKEN_A}\n{TOKEN_B}\n")
    (root / "a").write_text(TOKEN_A + "\n")
    (root / "b").write_text(TOKEN_B + "\n")
    return root


@pytest.fixture(scope="module")
def service(ray_cluster, actor_reaper, tiny_paths, tokens):
    with running_service(
        actor_reaper,
        tiny_paths,
        security=SecurityConfig(tokens_file=str(tokens / "accepted")),
        credentials=ClientCredentials(token=TOKEN_B),
        max_inflight_per_client=PER_CLIENT,  # the burst meets the per-client limit
        stream_write_timeout_s=1.0,  # the never-reading streams end within a second
    ) as svc:
        yield svc


@pytest.fixture
def server_log(tmp_path):
    """The in-process router's log in a file, as `specdec serve`'s stderr would hold it."""
    path = tmp_path / "server.log"
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter(TEXT_FORMAT))
    handler.setLevel(logging.INFO)
    access = logging.getLogger("specdec.access")
    level = access.level
    access.setLevel(logging.INFO)
    logging.getLogger().addHandler(handler)
    try:
        yield path
    finally:
        logging.getLogger().removeHandler(handler)
        access.setLevel(level)
        handler.close()


def test_the_abuse_workload_reports_every_scenario(
    service, tokens, tiny_paths, server_log, tmp_path, monkeypatch, wait_for_restart
):
    import ray

    from specdec.cli.main import main

    monkeypatch.delenv("SPECDEC_API_TOKEN", raising=False)
    prompts = tmp_path / "prompts.jsonl"
    texts = ["def fib(n):", "import numpy as np\n", "class Stack:\n    def push(self, x):"]
    prompts.write_text(
        "".join(json.dumps({"id": f"p{i}", "prompt": t, "chat": False}) + "\n" for i, t in enumerate(texts))
    )
    report = tmp_path / "abuse.json"
    flags = ["bench", "serve", "--workload", "abuse", "--server", service.router.address, "--prompts", str(prompts)]
    flags += ["--long-prompts", str(LONG_PROMPTS), "--long-tokens", str(LONG_TOKENS), "--victim-after", "0.2"]
    flags += ["--burst", str(BURST), "--unread-streams", str(UNREAD), "--unread-wait", "20", "--timeout", "120"]
    flags += ["--token-file", str(tokens / "b"), "--abuse-token-file", str(tokens / "a")]
    flags += ["--metrics-url", f"http://127.0.0.1:{service.router.router.metrics_port}/metrics"]
    flags += ["--server-log", str(server_log), "--json", str(report)]
    flags += ["--engine", "--engine-target", str(tiny_paths["llama"]), "--engine-dtype", "float32"]
    # the restart scenario: the target worker's process killed while two long streams run (Ray starts another)
    pid = ray.get(service.target.pid.remote(), timeout=30)
    flags += ["--kill-target", str(pid), "--restart-streams", "2", "--restart-tokens", str(RESTART_TOKENS)]
    flags += ["--restart-max-tokens", "600"]  # streams that last: the kill comes a second after their first tokens
    recached = service.metric("specdec_recached_requests_total")
    assert main(flags) == 0
    result = json.loads(report.read_text())
    assert {"wall", "burst", "unread", "reference", "restart"} <= set(result) and result["same_client"] is False

    wall = result["wall"]
    assert wall["a_errors"] == 0 and wall["a_total_s"] > 0 and wall["preemptions"] >= 0
    for victim in (wall["victim_idle"], wall["victim"]):  # B measured on the idle service and behind the wall
        assert victim["error"] is None and victim["tokens"] == 16 and 0 < victim["ttft_s"] <= victim["total_s"]
    assert wall["victim_ttft_vs_idle"] == round(wall["victim"]["ttft_s"] / wall["victim_idle"]["ttft_s"], 3)
    ref = result["reference"]
    assert ref["prompt_tokens"] == [LONG_TOKENS] * LONG_PROMPTS and len(ref["seconds"]) == LONG_PROMPTS
    assert wall["a_total_vs_reference"] == round(wall["a_total_s"] / ref["total_s"], 3)

    burst = result["burst"]
    assert burst["sent"] == BURST and sum(burst["by_status"].values()) == BURST
    assert set(burst["by_status"]) == {"OK", "RESOURCE_EXHAUSTED"} and burst["only_ok_or_resource_exhausted"]
    assert burst["by_status"]["OK"] >= PER_CLIENT and burst["retry_info_on_every_resource_exhausted"]
    assert burst["resource_exhausted_with_retry_info"] == burst["by_status"]["RESOURCE_EXHAUSTED"]

    unread = result["unread"]
    assert unread["streams"] == unread["first_chunk_read"] == UNREAD
    assert sum(unread["client_status"].values()) == UNREAD and "OK" not in unread["client_status"], unread
    # the server's side of the same calls, from its access log: each ends with a real status
    assert sum(unread["server_status"].values()) == UNREAD
    assert set(unread["server_status"]) <= {"CANCELLED", "DEADLINE_EXCEEDED"}, unread
    assert unread["server_error_lines"] == 0 and result["server_error_lines"] == 0

    restart = result["restart"]
    assert restart["killed"] and restart["errors"] == [] and restart["identical"] == [True, True], restart
    assert restart["tokens"] == [600, 600] and 0 < restart["prefill_s"] and 0 < restart["stall_s"]
    assert restart["stall_vs_prefill"] == round(restart["stall_s"] / restart["prefill_s"], 3)
    # both streams were running on the process that died: both cached their tokens again in chunks
    assert service.metric("specdec_recached_requests_total") - recached == 2
    assert wait_for_restart(service.target, pid) != pid
    service.wait_slots_free()
