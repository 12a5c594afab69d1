"""Log output for operators' tools: one JSON object per line (``log_format=json``), or the usual text.

A log shipper then needs no parser for our wording: each line carries the time (ISO 8601, UTC), the
level, the logger, the message with its arguments filled in, the process's role and DC when known, and
the exception's traceback when there is one.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import sys

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    """One JSON object per record; ``role`` and ``dc`` (when given) are added to every line."""

    def __init__(self, role: str = "", dc: int | None = None) -> None:
        super().__init__()
        self.role = role
        self.dc = dc

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, object] = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname, "logger": record.name, "message": record.getMessage(),
            "pid": os.getpid()}
        if self.role:
            out["role"] = self.role
        if self.dc is not None:
            out["dc"] = self.dc
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def configure(level: int, log_format: str = "text", *, role: str = "", dc: int | None = None) -> None:
    """Send the root logger's records to stderr as ``log_format`` says (replacing earlier handlers)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(role, dc) if log_format == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
