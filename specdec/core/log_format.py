"""Log lines: plain text, or JSON lines (one object per record) for log pipelines (``specdec serve
--log-format``, ``python -m gateway --log-format``), and the access line that the router and the
HTTP gateway both write on the logger ``specdec.access``.

In JSON, a record that carries structured fields (``record.access``, the access line) is written as
those fields; any other record as its message. An access line reads ``key=value ...`` in text.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
from typing import Any

__all__ = ["ACCESS_LOGGER", "LOG_FORMATS", "TEXT_FORMAT", "JsonFormatter", "set_log_format", "log_access"]

ACCESS_LOGGER = "specdec.access"
LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

_access = logging.getLogger(ACCESS_LOGGER)


def _text(value: Any) -> str:
    if value is None or value == "":
        return "-"
    if isinstance(value, str) and (not value or any(c in value for c in ' "=\\')):
        return json.dumps(value)
    return str(value)


def log_access(fields: dict[str, Any]) -> None:
    """One access line: ``key=value ...`` as the message, the fields themselves as ``record.access``."""
    _access.info(" ".join(f"{k}={_text(v)}" for k, v in fields.items()), extra={"access": fields})


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict = {
            "time": dt.datetime.fromtimestamp(record.created, dt.UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
        }
        fields = getattr(record, "access", None)
        if isinstance(fields, dict):
            out.update(fields)
        else:
            out["message"] = record.getMessage()
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def set_log_format(name: str, handlers: list[logging.Handler] | None = None) -> None:
    """Give ``handlers`` (default: every handler of the root logger) the ``text`` or ``json`` format."""
    if name not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)} (got {name!r})")
    formatter = JsonFormatter() if name == "json" else logging.Formatter(TEXT_FORMAT)
    for handler in logging.getLogger().handlers if handlers is None else handlers:
        handler.setFormatter(formatter)
