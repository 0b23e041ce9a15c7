"""A failure after the first streamed token (the status line is already sent) arrives as a
last `data: {"error": ...}` event, then `data: [DONE]`, and the generation is closed.

The failing chunk source is a stand-in: a real run cannot be made to fail at this exact point
on demand (the real path is covered by the integration tests up to the first token)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from decode_svc.http_api import _sse
from shared.errors import Unavailable


class ClosedGeneration:
    closed = False

    async def aclose(self) -> None:
        self.closed = True


@pytest.mark.asyncio
async def test_error_after_the_first_chunk_is_an_event_then_done() -> None:
    async def chunks() -> AsyncIterator[dict[str, Any]]:
        yield {"choices": [{"text": "a"}]}
        raise Unavailable("prefill p1 was lost", reason="PEER_LOST")

    generation = ClosedGeneration()
    response = _sse(chunks(), generation)  # type: ignore[arg-type]
    body = b"".join([part if isinstance(part, bytes) else part.encode() async for part in response.body_iterator])
    events = body.split(b"\n\n")[:-1]
    assert json.loads(events[0][len(b"data: ") :]) == {"choices": [{"text": "a"}]}
    error = json.loads(events[1][len(b"data: ") :])["error"]
    assert error["code"] == "peer_lost" and error["type"] == "service_unavailable_error"
    assert events[2] == b"data: [DONE]" and len(events) == 3
    assert generation.closed
