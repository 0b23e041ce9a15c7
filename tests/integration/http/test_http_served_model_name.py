"""`--served-model-name` on a real pair, through the official `openai` client: /v1/models lists
the first name, every name is accepted (plain requests and vLLM's P/D legs, prefill leg included),
and any other model, `--model` itself included, is vLLM's 404 `NotFoundError` naming `model`."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest
import pytest_asyncio

from decode_svc.app import DecodeApp
from prefill_svc.app import PrefillApp
from shared.config import parse_settings
from shared.runtime.engine_host import engine_factory_for
from tests.integration.http.conftest import COMMON, MODEL, HttpPair, request, stop_pair
from tests.reuse import REUSE_OFF

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(120)]

NAMES = ("hybrid-chat", "org/hybrid-chat-v1")
PREFILL_LEG = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
               "remote_block_ids": None, "remote_host": None, "remote_port": None}  # fmt: skip


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def named() -> AsyncIterator[HttpPair]:
    """Prefill by flag (comma-separated), decode by environment, as an operator would set them."""
    factory = engine_factory_for("reference")
    prefill = await PrefillApp.start(
        parse_settings("prefill", [*COMMON, "--engine-id", "named-prefill", "--served-model-name", ",".join(NAMES)], environ={}),
        factory,
    )
    decode_flags = [*COMMON, "--engine-id", "named-decode", "--prefill", f"127.0.0.1:{prefill.port}", *REUSE_OFF]
    decode = await DecodeApp.start(
        parse_settings("decode", decode_flags, environ={"HYBRID_PD_SERVED_MODEL_NAME": ",".join(NAMES)}), factory
    )
    pair = HttpPair(prefill, decode)
    try:
        await decode.wait_ready(30)
        async with asyncio.timeout(10):
            while not decode.shell.health.ready:
                await asyncio.sleep(0.02)
        yield pair
    finally:
        await stop_pair(pair)


def client(pair: HttpPair) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=pair.base_url + "/v1", api_key="unused", max_retries=0, timeout=30)


async def test_models_lists_the_first_name_and_every_name_is_served(named: HttpPair) -> None:
    prompt = "served by name"
    async with client(named) as c:
        models = await c.models.list()
        assert [m.id for m in models.data] == [NAMES[0]]
        for name in NAMES:
            out = await c.completions.create(model=name, prompt=prompt, max_tokens=6)
            assert out.choices[0].text == named.expected_text(prompt, 6)
            assert out.model == NAMES[0]  # as vLLM answers: the first served name
        chat = await c.chat.completions.create(model=NAMES[1], messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert chat.choices[0].message.content == named.expected_text("<|user|>\nhi\n<|assistant|>\n", 4)
    await named.blocks_freed()


async def test_an_unknown_model_is_vllms_404_naming_model(named: HttpPair) -> None:
    async with client(named) as c:
        for other in ("no-such-model", MODEL):  # --model is not a name once names are given (as vLLM)
            with pytest.raises(openai.NotFoundError) as missing:
                await c.completions.create(model=other, prompt="x", max_tokens=2)
            assert missing.value.status_code == 404
            assert missing.value.body == {  # the openai client unwraps "error"
                "message": f"The model `{other}` does not exist.",
                "type": "NotFoundError",
                "param": "model",
                "code": 404,
            }
    prefill_models = await asyncio.to_thread(request, f"http://127.0.0.1:{named.prefill.shell.http_port}/v1/models")
    assert [m["id"] for m in prefill_models.json()["data"]] == [NAMES[0]]


async def test_the_pd_legs_accept_every_name(named: HttpPair) -> None:
    """vLLM's P/D router sends the client's `model` to both legs: prefill's HTTP leg and decode's."""

    async def post(port: int | None, body: dict[str, Any], rid: str) -> Any:
        url = f"http://127.0.0.1:{port}/v1/completions"
        return await asyncio.to_thread(request, url, body, None, {"X-Request-Id": rid})

    prompt = "two legs by name"
    body = {"model": NAMES[1], "prompt": prompt, "max_tokens": 5}
    leg = body | {"max_tokens": 1, "min_tokens": 1, "kv_transfer_params": PREFILL_LEG}
    first = await post(named.prefill.shell.http_port, leg, "named-leg")
    assert first.status == 200, first.body
    kv = json.loads(json.dumps(first.json()["kv_transfer_params"]))
    second = await post(named.decode.shell.http_port, body | {"kv_transfer_params": kv}, "named-leg")
    assert second.status == 200, second.body
    assert second.json()["choices"][0]["text"] == named.expected_text(prompt, 5)
    refused = await post(named.prefill.shell.http_port, leg | {"model": "other"}, "named-leg-2")
    assert refused.status == 404 and refused.json()["error"]["param"] == "model"
    await named.blocks_freed()
