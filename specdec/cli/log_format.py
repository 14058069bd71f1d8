"""``--log-format``: plain text lines, or JSON lines (one object per record) for log pipelines.

In JSON, a record that carries structured fields (``record.access``, the access log of
:mod:`router.access_log`) is written as those fields; any other record as its message.
"""

from __future__ import annotations

import datetime as dt
import json
import logging

__all__ = ["LOG_FORMATS", "TEXT_FORMAT", "JsonFormatter", "set_log_format"]

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


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
