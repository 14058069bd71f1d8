"""The figures of `specdec bench serve --workload abuse` without a service: the burst's counts, the
server log's access and ERROR lines, the router's preemptions, the ratios and the table, the wall's
prompts, and the flags it refuses (the scenarios themselves: tests/integration/test_bench_abuse.py)."""

from __future__ import annotations

import json

import pytest

from specdec.bench.serve_abuse import AbuseOptions, wall_prompts
from specdec.bench.serve_abuse_report import (
    access_statuses,
    add_ratios,
    burst_summary,
    error_lines,
    format_abuse,
    preemptions,
)
from specdec.core.prompts import Prompt
from tests.static_metrics import static_metrics

OUTCOMES = [("OK", False)] * 3 + [("RESOURCE_EXHAUSTED", True)] * 2


def counts_add_up(summary: dict, sent: int) -> None:
    """What the integration test holds a burst's report to."""
    assert summary["sent"] == sent and sum(summary["by_status"].values()) == sent, summary


def test_a_burst_is_counted_by_status_with_its_retry_info():
    s = burst_summary(OUTCOMES)
    counts_add_up(s, 5)
    assert s["by_status"] == {"OK": 3, "RESOURCE_EXHAUSTED": 2} and s["only_ok_or_resource_exhausted"]
    assert s["resource_exhausted_with_retry_info"] == 2 and s["retry_info_on_every_resource_exhausted"]
    # a refused HTTP/2 stream, and a RESOURCE_EXHAUSTED without RetryInfo: each shows
    bad = burst_summary([*OUTCOMES, ("UNAVAILABLE", False), ("RESOURCE_EXHAUSTED", False)])
    counts_add_up(bad, 7)
    assert not bad["only_ok_or_resource_exhausted"] and bad["by_status"]["UNAVAILABLE"] == 1
    assert bad["resource_exhausted_with_retry_info"] == 2 and not bad["retry_info_on_every_resource_exhausted"]


def test_a_counter_that_drops_a_status_fails_the_check():
    def dropping(outcomes):  # a broken counter: the statuses it does not expect vanish
        s = burst_summary(outcomes)
        s["by_status"].pop("UNAVAILABLE", None)
        return s

    outcomes = [*OUTCOMES, ("UNAVAILABLE", False)]
    counts_add_up(burst_summary(outcomes), 6)
    with pytest.raises(AssertionError):
        counts_add_up(dropping(outcomes), 6)


ACCESS = (
    "2026-11-29 16:50:01,123 INFO specdec.access: rpc=GenerateStream request_id={rid} model=m status={status} peer=x"
)
LOG = [
    ACCESS.format(rid="u-0", status="CANCELLED"),
    ACCESS.format(rid="u-1", status="DEADLINE_EXCEEDED"),
    ACCESS.format(rid="other", status="OK"),  # not one of the bench's calls
    "2026-11-29 16:50:01,200 INFO router.service: status=OK request_id=u-0",  # not the access logger
    json.dumps({"time": "t", "level": "INFO", "logger": "specdec.access", "request_id": "u-2", "status": "CANCELLED"}),
    "2026-11-29 16:50:02,000 ERROR router.scheduler: a round failed",
    "Traceback (most recent call last):",
    "target_worker.servicer.ExecuteBatchError: the batch failed",  # the traceback's own lines
    json.dumps({"time": "t", "level": "ERROR", "logger": "router", "message": "x"}),
    "(TargetWorker pid=7) 2026-11-29 16:50:03,000 CRITICAL target_worker: out of memory",
    "2026-11-29 16:50:04,000 WARNING router: slow",
]


def test_access_lines_by_status_in_both_log_formats():
    assert access_statuses(LOG, ["u-0", "u-1", "u-2"]) == {"CANCELLED": 2, "DEADLINE_EXCEEDED": 1}
    assert access_statuses(LOG, ["nothing"]) == {}


def test_error_records_are_counted_once_each():
    assert error_lines(LOG) == 3  # the text ERROR, the JSON one and a worker's CRITICAL; not the traceback
    assert error_lines(LOG[:5]) == 0


def _result(ref_total: float | None = 2.0) -> dict:
    victim = {"ttft_s": 0.5, "total_s": 2.0, "tokens": 16, "error": None}
    return {
        "address": "127.0.0.1:50051",
        "options": vars(AbuseOptions()),
        "same_client": False,
        "wall": {
            "a_total_s": 5.0,
            "a_first_error": None,
            "preemptions": 3,
            "victim_idle": victim,
            "victim": victim | {"ttft_s": 4.0, "total_s": 6.0},
        },
        "burst": burst_summary(OUTCOMES),
        "unread": {"streams": 4, "client_status": {"CANCELLED": 4}, "server_status": {"CANCELLED": 4}},
        "server_error_lines": 0,
        **({"reference": {"total_s": ref_total}} if ref_total is not None else {}),
    }


def test_the_ratios_come_from_the_numbers_beside_them():
    r = _result()
    add_ratios(r)
    w = r["wall"]
    assert (w["victim_ttft_vs_idle"], w["victim_total_vs_idle"], w["a_total_vs_reference"]) == (8.0, 3.0, 2.5)
    table = format_abuse(r)
    assert "| 0.5 | 4.0 | 8.00x |" in table and "| 5.0 | 2.50x |" in table and "two clients" in table
    assert "OK 3, RESOURCE_EXHAUSTED 2" in table and "| 2/2 |" in table and "CANCELLED 4" in table
    no_ref = _result(ref_total=None)
    no_ref["wall"]["victim_idle"]["ttft_s"] = None  # B failed on the idle service: no ratio, not a made-up one
    add_ratios(no_ref)
    assert no_ref["wall"]["a_total_vs_reference"] is None and no_ref["wall"]["victim_ttft_vs_idle"] is None
    assert "--engine times it" in format_abuse(no_ref)
    r["restart"] = {
        "streams": 2,
        "prompt_tokens": 3500,
        "prefill_s": 10.0,
        "stall_s": 14.0,
        "stall_vs_prefill": 1.4,
        "identical": [True, False],
        "errors": ["DEADLINE_EXCEEDED: late"],
    }
    table = format_abuse(r)
    assert "| 10.0 | 14.0 | 1.40x |" in table and "| 1/2; 1 |" in table and "DEADLINE_EXCEEDED: late" in table


def test_the_wall_is_the_sets_text_cut_to_exact_lengths():
    prompts = [Prompt(f"p{i}", text, False) for i, text in enumerate(["a b c", "d e", "f"])]
    seen: list[str] = []

    def tokenize(text: str) -> list[int]:
        seen.append(text)
        return [ord(c) for c in text.split()]

    wall = wall_prompts(tokenize, prompts, 4, 7)
    assert [len(ids) for ids in wall] == [7] * 4
    assert [ids[0] for ids in wall] == [ord("a"), ord("d"), ord("f"), ord("a")]  # prompt i from the set's i-th
    assert sorted(seen) == ["a b c", "d e", "f"]  # each text tokenized once
    with pytest.raises(ValueError, match="no tokens"):
        wall_prompts(lambda text: [], prompts, 1, 3)


@pytest.mark.parametrize(
    ("field", "value", "flag"),
    [("burst", 0, "--burst"), ("long_tokens", -1, "--long-tokens"), ("unread_wait_s", 0.0, "--unread-wait")],
)
def test_options_that_cannot_work_name_their_flag(field, value, flag):
    AbuseOptions().check()
    with pytest.raises(ValueError, match=flag):
        AbuseOptions(**{field: value}).check()


def test_the_command_refuses_a_bad_flag_before_calling_the_server(tmp_path, capsys):
    from specdec.cli.main import main

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "p0", "prompt": "def fib(n):", "chat": False}) + "\n")
    base = ["bench", "serve", "--workload", "abuse", "--prompts", str(prompts), "--server", "127.0.0.1:9"]
    assert main([*base, "--unread-streams", "0"]) == 2
    assert "--unread-streams must be at least 1" in capsys.readouterr().err
    assert main([*base, "--server-log", str(tmp_path / "missing.log")]) == 2
    assert "--server-log" in capsys.readouterr().err
    assert main([*base, "--kill-target", "1", "--restart-max-tokens", "1"]) == 2
    assert "at least 2 tokens" in capsys.readouterr().err


METRICS = """# TYPE specdec_preemptions counter
specdec_preemptions_total{model="a"} 2.0
specdec_preemptions_total{model="b"} 1.0
specdec_preemptions_created{model="a"} 1.7e9
"""


def test_preemptions_are_summed_over_labels():
    with static_metrics(METRICS) as url:
        assert preemptions(url) == 3.0
    assert preemptions(None) is None


def test_the_reference_prefills_each_prompt_in_one_forward(tiny_paths, monkeypatch):
    from specdec.bench.runner import unchunked_prefills
    from specdec.core.runner import ModelRunner

    feeds: list[int] = []
    forward = ModelRunner.forward

    def counted(self, slots, tokens, *args, **kwargs):
        feeds.append(len(tokens[0]))
        return forward(self, slots, tokens, *args, **kwargs)

    monkeypatch.setattr(ModelRunner, "forward", counted)
    r = unchunked_prefills(str(tiny_paths["llama"]), [[5] * 30, [6] * 12], dtype="float32")
    assert feeds[1:] == [30, 12]  # after the warm-up: one forward of the whole prompt each
    assert r["prompt_tokens"] == [30, 12] and len(r["seconds"]) == 2 and all(s > 0 for s in r["seconds"])
    assert abs(r["total_s"] - sum(r["seconds"])) < 1e-3
