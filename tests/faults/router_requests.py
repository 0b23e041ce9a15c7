"""The requests the router fault tests send: 32 concurrent openai-client completions (every
other one streamed) through the real vllm-router, each either the colocated run's text or a
failure the server sent (an HTTP error or an SSE error event)."""

from __future__ import annotations

import re
from typing import Any

import openai

from shared.engine.reference.colocated import colocated_generate
from shared.layout.presets import get_preset
from tests.faults.harness import Service

MODEL = "tiny-mamba2"
REFERENCE = ("--engine", "reference", "--num-blocks", "128")
MAX_TOKENS = 48
HTTP_PORT = re.compile(r"HTTP port=(\d+)")


def http_base(service: Service) -> str:
    port = next(int(m.group(1)) for m in map(HTTP_PORT.search, service.output) if m)
    return f"http://127.0.0.1:{port}"


def prompt(i: int) -> str:
    return f"request {i} " * 3


def expected(i: int) -> str:
    """The colocated run's text for request `i`."""
    return bytes(colocated_generate(get_preset(MODEL), list(prompt(i).encode()), MAX_TOKENS)).decode("utf-8", errors="replace")


async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, Any]:
    """("ok", text), or ("failed", the error) for an error the server sent (status or SSE event).
    A dropped connection or a timeout (a hang) is no clean failure: it is raised."""
    try:
        if i % 2:
            stream = await client.completions.create(model=MODEL, prompt=prompt(i), max_tokens=MAX_TOKENS, stream=True)
            text = "".join([c.choices[0].text async for c in stream if c.choices])
        else:
            out = await client.completions.create(model=MODEL, prompt=prompt(i), max_tokens=MAX_TOKENS)
            text = out.choices[0].text
    except (openai.APIConnectionError, openai.APITimeoutError):
        raise
    except openai.APIError as e:
        return "failed", e
    return "ok", text
