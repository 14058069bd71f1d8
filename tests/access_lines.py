"""What an access line of a request the HTTP gateway refused itself must hold (gateway/access.py): the
router's fields, named as the router names them, plus the HTTP status and OpenAI's error code."""

from __future__ import annotations

from router.access_log import ACCESS_LOGGER, AccessRecord

__all__ = ["ROUTER_FIELDS", "check_refusal_line"]

ROUTER_FIELDS = frozenset(AccessRecord("Generate", "").fields())  # the router's shape, whatever it becomes
JSON_HEAD = frozenset({"time", "level", "logger"})  # what JsonFormatter puts before the fields
GRPC_NAME = {400: "INVALID_ARGUMENT", 404: "NOT_FOUND", 405: "UNIMPLEMENTED"}


def check_refusal_line(line: dict, request_id: str, http_status: int, error_code: str) -> None:
    """``line``: one JSON log line of the gateway process."""
    assert set(line) == JSON_HEAD | ROUTER_FIELDS | {"http_status", "error_code"}, sorted(line)
    assert line["logger"] == ACCESS_LOGGER and line["level"] == "INFO"
    assert line["request_id"] == request_id
    assert line["http_status"] == http_status and line["error_code"] == error_code
    assert line["status"] == GRPC_NAME[http_status]
    assert line["rpc"].split(" ")[0] in ("GET", "POST") and line["rpc"].split(" ")[1].startswith("/")
    assert isinstance(line["total_ms"], float) and line["total_ms"] >= 0
    assert line["peer"].startswith("ipv4:127.0.0.1:")
    assert line["prompt_tokens"] == line["completion_tokens"] == 0 and line["ttft_ms"] is None
