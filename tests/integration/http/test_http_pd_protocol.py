"""vLLM's P/D protocol against a pair whose decode engine has its own --prefill: render on both
workers, and the prefill and decode legs validated (bad params: 400 naming the field; params of
a prefill incarnation that is gone: 410), with nothing left allocated on either side. The legs
served end to end: test_http_pd_legs.py."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from shared.http.kv_transfer import prefill_answer
from tests.integration.http.conftest import MODEL, HttpPair, request

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(120)]

# What vllm-router 0.1.17 sends (vllm-pd-protocol reference): render body, then the prefill leg.
RENDER_BODY = {"model": MODEL, "prompt": "hello world", "max_tokens": 5, "stream": False, "echo": False,
               "no_stop_trim": False, "ignore_eos": False, "skip_special_tokens": True, "return_hidden_states": False}  # fmt: skip
PREFILL_LEG = {"kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
               "remote_block_ids": None, "remote_host": None, "remote_port": None}}  # fmt: skip


def url(pair: HttpPair, role: str, path: str) -> str:
    app = pair.decode if role == "decode" else pair.prefill
    return f"http://127.0.0.1:{app.shell.http_port}{path}"


async def post(target: str, body: Any, **headers: str) -> Any:
    return await asyncio.to_thread(request, target, body, None, headers)


async def test_render_on_both_workers(http_pair: HttpPair) -> None:
    for role in ("decode", "prefill"):
        reply = await post(url(http_pair, role, "/v1/completions/render"), RENDER_BODY, **{"X-Request-Id": "abc"})
        assert reply.status == 200, reply.body
        [rendered] = reply.json()
        assert rendered["token_ids"] == list(b"hello world") and rendered["model"] == MODEL
        assert rendered["request_id"] == "cmpl-abc" and rendered["sampling_params"]["max_tokens"] == 5
        chat = await post(
            url(http_pair, role, "/v1/chat/completions/render"),
            {"messages": [{"role": "user", "content": "hi"}], "temperature": 0.25},
        )
        assert chat.status == 200
        assert chat.json()["token_ids"] == list(b"<|user|>\nhi\n<|assistant|>\n")
        assert chat.json()["sampling_params"]["temperature"] == 0.25
        missing = await post(url(http_pair, role, "/v1/completions/render"), {"model": "other", "prompt": "x"})
        assert missing.status == 404 and missing.json()["error"]["param"] == "model"


async def test_prefill_leg_is_validated(http_pair: HttpPair) -> None:
    bad = RENDER_BODY | {"max_tokens": 1, "min_tokens": 1} | PREFILL_LEG | {"prompt": [1, 2, 1 << 20]}
    reply = await post(url(http_pair, "prefill", "/v1/completions"), bad, **{"X-Request-Id": "___prefill_addr_x___decode_1"})
    assert reply.status == 400 and reply.json()["error"]["param"] == "prompt", reply.body
    plain = await post(url(http_pair, "prefill", "/v1/completions"), RENDER_BODY)
    assert plain.status == 400 and plain.json()["error"]["param"] == "kv_transfer_params"
    both = await post(
        url(http_pair, "prefill", "/v1/completions"),
        RENDER_BODY | {"kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": True}},
    )
    assert both.status == 400 and both.json()["error"]["param"] == "kv_transfer_params.do_remote_prefill"
    assert http_pair.prefill.host.allocator.num_used == 0


async def test_decode_leg_is_validated_and_refused_clearly(http_pair: HttpPair) -> None:
    params = prefill_answer(
        engine_id=http_pair.prefill.settings.engine_id, request_id="r", host="127.0.0.1", port=http_pair.prefill.port,
        block_ids=[[1, 2]], tp_size=1, num_tokens=11, num_computed_tokens=10, expiry_time=2e9, incarnation=1, transfer_id="t1",
    )  # fmt: skip
    bad = await post(url(http_pair, "decode", "/v1/completions"), RENDER_BODY | {"kv_transfer_params": params | {"pp_size": 1.0}})
    assert bad.status == 400 and bad.json()["error"]["param"] == "kv_transfer_params.pp_size"
    flat = await post(
        url(http_pair, "decode", "/v1/completions"), RENDER_BODY | {"kv_transfer_params": params | {"remote_block_ids": [1, 2]}}
    )
    assert flat.status == 400 and flat.json()["error"]["param"] == "kv_transfer_params.remote_block_ids[0]"
    stale = await post(url(http_pair, "decode", "/v1/completions"), RENDER_BODY | {"kv_transfer_params": params})
    assert stale.status == 410 and stale.json()["error"]["param"] == "kv_transfer_params.hybrid_pd.incarnation", stale.body
    # Without the remote-prefill flag, a leftover params object does not change anything.
    plain = await post(
        url(http_pair, "decode", "/v1/completions"), RENDER_BODY | {"kv_transfer_params": {"do_remote_prefill": False}}
    )
    assert plain.status == 200 and plain.json()["choices"][0]["text"] == http_pair.expected_text("hello world", 5)
    await http_pair.blocks_freed()
