"""The figures of `specdec bench serve --workload abuse` (specdec/bench/serve_abuse.py): a burst's
counts by status, the router's preemptions, the server log's access lines and ERROR lines, the
ratios against the idle service and the one-forward reference, and the table the CLI prints."""

from __future__ import annotations

import json
import re
import urllib.request
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["burst_summary", "preemptions", "access_statuses", "error_lines", "add_ratios", "format_abuse"]

PREEMPTIONS = "specdec_preemptions_total"
_ACCESS_LOGGER = "specdec.access"  # router/access_log.py's logger (the bench does not import the router)
# `specdec serve --log-format text` (specdec/core/log_format.py): "DATE TIME LEVEL LOGGER: MESSAGE";
# a Ray worker's line forwarded to the driver carries a "(Actor pid=N)" prefix before it
_TEXT_ERROR = re.compile(r"(^|\s)(ERROR|CRITICAL)\s")
_FIELD = re.compile(r"(?:^|\s)(request_id|status)=(\S+)")


def burst_summary(outcomes: Sequence[tuple[str, bool]]) -> dict[str, Any]:
    """``outcomes``: per call, (its status code name, whether it carried a RetryInfo)."""
    by_status: dict[str, int] = {}
    for code, _ in outcomes:
        by_status[code] = by_status.get(code, 0) + 1
    exhausted = [retry for code, retry in outcomes if code == "RESOURCE_EXHAUSTED"]
    return {
        "sent": len(outcomes),
        "by_status": dict(sorted(by_status.items())),
        "only_ok_or_resource_exhausted": set(by_status) <= {"OK", "RESOURCE_EXHAUSTED"},
        "resource_exhausted_with_retry_info": sum(exhausted),
        "retry_info_on_every_resource_exhausted": all(exhausted),
    }


def preemptions(url: str | None) -> float | None:
    """The router's ``specdec_preemptions_total`` (all labels) at ``url``; None without one."""
    if not url:
        return None
    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            text = resp.read().decode()
    except OSError:
        return None
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples if s.name == PREEMPTIONS)


def _json(line: str) -> dict[str, Any] | None:
    if not line.startswith("{"):
        return None
    try:
        obj = json.loads(line)
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


def access_statuses(lines: Iterable[str], request_ids: Sequence[str]) -> dict[str, int]:
    """Access lines of ``request_ids`` by status, in either log format (text ``key=value`` or JSON)."""
    wanted = set(request_ids)
    out: dict[str, int] = {}
    for line in lines:
        obj = _json(line)
        if obj is not None:
            fields = obj if obj.get("logger") == _ACCESS_LOGGER else {}
        elif f" {_ACCESS_LOGGER}: " in line:
            fields = dict(_FIELD.findall(line))
        else:
            continue
        if fields.get("request_id") in wanted and fields.get("status"):
            out[fields["status"]] = out.get(fields["status"], 0) + 1
    return dict(sorted(out.items()))


def error_lines(lines: Iterable[str]) -> int:
    """Log records at ERROR or above (a traceback's lines after its record are not counted again)."""
    n = 0
    for line in lines:
        obj = _json(line)
        if obj is not None:
            n += obj.get("level") in ("ERROR", "CRITICAL")
        elif _TEXT_ERROR.search(line):
            n += 1
    return n


def _ratio(num: float | None, den: float | None) -> float | None:
    return round(num / den, 3) if num is not None and den else None


def add_ratios(result: dict[str, Any]) -> None:
    """B behind the wall over B on the idle service; A's total over the one-forward reference."""
    wall = result["wall"]
    idle, behind = wall["victim_idle"], wall["victim"]
    wall["victim_ttft_vs_idle"] = _ratio(behind["ttft_s"], idle["ttft_s"])
    wall["victim_total_vs_idle"] = _ratio(behind["total_s"], idle["total_s"])
    ref = result.get("reference")
    wall["a_total_vs_reference"] = _ratio(wall["a_total_s"], ref["total_s"]) if ref else None


def _x(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


def _v(value: Any) -> str:
    return "-" if value is None else str(value)


def _counts(counts: dict[str, int] | None) -> str:
    return "-" if counts is None else ", ".join(f"{k} {v}" for k, v in counts.items()) or "none"


def format_abuse(result: dict[str, Any]) -> str:
    o, wall, burst, unread = result["options"], result["wall"], result["burst"], result["unread"]
    ref = result.get("reference")
    who = "one client to the router (same token or none)" if result["same_client"] else "two clients (own tokens)"
    b_idle, b = wall["victim_idle"], wall["victim"]
    ref_cell = f"{ref['total_s']} (one forward each, in process)" if ref else "- (--engine times it)"
    retry = f"{burst['resource_exhausted_with_retry_info']}/{burst['by_status'].get('RESOURCE_EXHAUSTED', 0)}"
    lines = [
        f"abuse workload at {result['address']}: A sends {o['long_prompts']} prompts of {o['long_tokens']} "
        f"tokens at once, B a {o['victim_tokens']}-token request {o['victim_after_s']:g} s later; A and B: {who}",
        "",
        "| scenario | measure | idle service / reference | under abuse | ratio |",
        "|---|---|---:|---:|---:|",
        f"| wall | B's time to first token, s | {_v(b_idle['ttft_s'])} | {_v(b['ttft_s'])} | "
        f"{_x(wall['victim_ttft_vs_idle'])} |",
        f"| wall | B's total, s | {_v(b_idle['total_s'])} | {_v(b['total_s'])} | {_x(wall['victim_total_vs_idle'])} |",
        f"| wall | A's {o['long_prompts']} x {o['long_tokens']} tokens, total s | {ref_cell} | "
        f"{_v(wall['a_total_s'])} | {_x(wall['a_total_vs_reference'])} |",
        f"| wall | preemptions (router /metrics) | | {_v(wall['preemptions'])} | |",
        f"| burst | {burst['sent']} calls on one channel, by status | | {_counts(burst['by_status'])} | |",
        f"| burst | RESOURCE_EXHAUSTED with RetryInfo | | {retry} | |",
        f"| unread | {unread['streams']} never-reading streams, status at the client | | "
        f"{_counts(unread['client_status'])} | |",
        f"| unread | their access lines by status (server log) | | {_counts(unread.get('server_status'))} | |",
        f"| unread | ERROR lines in the server log (scenario / whole run) | | "
        f"{_v(unread.get('server_error_lines'))} / {_v(result.get('server_error_lines'))} | |",
    ]
    rs = result.get("restart")
    if rs:
        same = f"{sum(rs['identical'])}/{len(rs['identical'])}"
        lines += [
            f"| restart | {rs['streams']} streams of {rs['prompt_tokens']} tokens: their prefill / the stall "
            f"after SIGKILL to the target, s | {_v(rs['prefill_s'])} | {_v(rs['stall_s'])} | "
            f"{_x(rs['stall_vs_prefill'])} |",
            f"| restart | streams equal to the undisturbed run; errors | | {same}; {len(rs['errors'])} | |",
        ]
        lines += [f"error (restart): {e}" for e in rs["errors"][:3]]
    firsts = (("A", wall["a_first_error"]), ("B idle", b_idle["error"]), ("B", b["error"]))
    lines += [f"error ({name}): {e}" for name, e in firsts if e]
    return "\n".join(lines)
