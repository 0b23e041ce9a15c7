"""Log line formats: `text` for people, `json` (one object per line) for log collectors.

A JSON line always has timestamp (RFC 3339, UTC), level, logger, message, service and engine_id;
request_id and peer when the line was logged while serving a request (shared/logs/context.py);
and whatever a caller passed in `extra={"fields": {...}}` (the per-request summary's numbers, a
failure's status)."""

from __future__ import annotations

import datetime
import json
import logging
from typing import Any

from shared.logs import context

FORMATS = ("text", "json")


def fields_of(record: logging.LogRecord) -> dict[str, Any]:
    fields = getattr(record, "fields", None)
    return dict(fields) if isinstance(fields, dict) else {}


class JsonFormatter(logging.Formatter):
    def __init__(self, service: str, engine_id: str) -> None:
        super().__init__()
        self.service = service
        self.engine_id = engine_id

    def format(self, record: logging.LogRecord) -> str:
        stamp = datetime.datetime.fromtimestamp(record.created, tz=datetime.UTC)
        line: dict[str, Any] = {
            "timestamp": stamp.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "service": self.service,
            "engine_id": self.engine_id,
        }
        rid, remote = context.request_id.get(), context.peer.get()
        if rid:
            line["request_id"] = rid
        if remote:
            line["peer"] = remote
        line.update(fields_of(record))
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


class TextFormatter(logging.Formatter):
    """`time LEVEL logger: [request id] message key=value ...`"""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        rid = context.request_id.get()
        head, sep, tail = text.partition(": ")
        if rid and sep:
            text = f"{head}: [{rid}] {tail}"
        extra = " ".join(f"{k}={v}" for k, v in fields_of(record).items())
        return f"{text} {extra}" if extra else text


def formatter_for(kind: str, service: str, engine_id: str) -> logging.Formatter:
    return JsonFormatter(service, engine_id) if kind == "json" else TextFormatter()
