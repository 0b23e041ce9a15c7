"""Log formats and the rate limit on repeated warnings (pure logging; no service)."""

from __future__ import annotations

import asyncio
import json
import logging

from shared.logs import context
from shared.logs.formats import JsonFormatter, TextFormatter
from shared.logs.rate_limit import RateLimitFilter


def record(
    message: str, *args: object, level: int = logging.WARNING, fields: dict[str, object] | None = None
) -> logging.LogRecord:
    rec = logging.LogRecord("decode_svc.x", level, __file__, 1, message, args, None)
    if fields is not None:
        rec.fields = fields
    return rec


def test_a_json_line_carries_the_request_of_its_task() -> None:
    formatter = JsonFormatter("decode-svc", "decode-a")

    async def request(rid: str) -> dict[str, object]:
        context.bind_request(rid, "ipv4:127.0.0.1:5555")
        await asyncio.sleep(0)  # the other request runs meanwhile
        return dict(json.loads(formatter.format(record("request %s done", rid, fields={"status": "OK"}))))

    async def both() -> list[dict[str, object]]:
        return list(await asyncio.gather(request("r-1"), request("r-2")))

    first, second = asyncio.run(both())
    assert first["request_id"] == "r-1" and second["request_id"] == "r-2"
    assert first["message"] == "request r-1 done" and first["status"] == "OK"
    assert first["service"] == "decode-svc" and first["engine_id"] == "decode-a" and first["level"] == "WARNING"
    assert first["peer"] == "ipv4:127.0.0.1:5555" and str(first["timestamp"]).endswith("Z")
    # Outside any request: no request id.
    assert "request_id" not in json.loads(formatter.format(record("idle")))


def test_text_lines_name_the_request_and_the_fields() -> None:
    async def one() -> str:
        context.bind_request("r-9")
        return TextFormatter().format(record("done", fields={"ttft_ms": 1.5}))

    line = asyncio.run(one())
    assert "decode_svc.x: [r-9] done ttft_ms=1.5" in line


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_repeated_identical_warnings_pass_once_per_window_with_the_count() -> None:
    clock = Clock()
    limit = RateLimitFilter(window=30.0, clock=clock)
    assert limit.filter(record("prefill %s: %s", "p:1", "UNAVAILABLE"))
    passed = [limit.filter(record("prefill %s: %s", "p:1", "UNAVAILABLE")) for _ in range(94)]
    assert not any(passed)
    # Another message, and INFO lines, are never held back by it.
    assert limit.filter(record("prefill %s: %s", "p:2", "UNAVAILABLE"))
    assert all(limit.filter(record("same info", level=logging.INFO)) for _ in range(3))
    clock.now = 30.0
    again = record("prefill %s: %s", "p:1", "UNAVAILABLE")
    assert limit.filter(again)
    assert again.getMessage() == "prefill p:1: UNAVAILABLE (94 identical lines suppressed in the last 30s)"
    clock.now = 61.0
    quiet = record("prefill %s: %s", "p:1", "UNAVAILABLE")
    assert limit.filter(quiet) and quiet.getMessage() == "prefill p:1: UNAVAILABLE"  # none since the last one
