"""Server-sent events as OpenAI streams them: one `data: <compact JSON>\\n\\n` event per chunk,
ending with `data: [DONE]\\n\\n`."""

from __future__ import annotations

import json
from typing import Any

SSE_MEDIA_TYPE = "text/event-stream"
DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def event(payload: dict[str, Any]) -> bytes:
    return b"data: " + dumps(payload) + b"\n\n"


def dumps(payload: dict[str, Any]) -> bytes:
    return json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
