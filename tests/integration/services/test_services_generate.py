"""Generate through a real prefill + decode pair: manifest, one READ per rank pair, tokens."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from shared.pb.hybridpd.v1 import decode_service_pb2 as dpb
from shared.rpc.status import describe
from tests.decode_stream import stream
from tests.integration.services import stamp_engine as stamp

pytestmark = [pytest.mark.integration, pytest.mark.asyncio, pytest.mark.timeout(60)]


async def test_generate_moves_state_and_streams_tokens(start_prefill: Any, start_decode: Any, channel_to: Any) -> None:
    prefill = await start_prefill()
    decode = await start_decode(prefill.port, "--check-state")
    prompt = [5, 6, 7, 8, 9, 10, 11]
    got = await stream(
        channel_to(decode.port), dpb.GenerateRequest(prompt_token_ids=prompt, max_tokens=20, request_id="r1"), timeout=20
    )
    assert got.tokens == stamp.expected_tokens(prompt, 20, decode.host.spec.vocab_size)
    summary = got.summary
    assert summary is not None
    assert summary.request_id == "r1"
    assert summary.generated_token_count == 20
    assert summary.num_transferred_tokens == len(prompt) - 1
    assert summary.state_verified
    assert summary.transfer.read_count == 1  # TP 1 -> TP 1: one READ carrying FA and Mamba together
    assert summary.transfer.attention_bytes > 0 and summary.transfer.conv_bytes > 0 and summary.transfer.ssm_bytes > 0
    assert summary.transfer.total_bytes == (
        summary.transfer.attention_bytes + summary.transfer.conv_bytes + summary.transfer.ssm_bytes
    )
    # Prefill frees on the READ notification; decode frees when the request ends.
    await _until(lambda: prefill.host.allocator.num_used == 0)
    assert decode.host.allocator.num_used == 0
    assert prefill.pins.ended["read"] == 1


async def test_caches_on_huge_pages_and_on_plain_pages_exchange_state(
    start_prefill: Any, start_decode: Any, channel_to: Any
) -> None:
    """The memory kind is each side's own business: a READ between the two kinds is exact."""
    size = ("--num-blocks", "1024")  # regions of several MiB, so huge pages apply
    prefill = await start_prefill("--huge-pages", "off", *size)
    decode = await start_decode(prefill.port, "--check-state", *size)
    big = [r for r in decode.host.caches[0].regions if r.numel() >= 2 << 20]
    assert big and all(r.data_ptr() % (2 << 20) == 0 for r in big)
    assert any(r.data_ptr() % (2 << 20) for r in prefill.host.caches[0].regions)  # plain pages: 4 KiB aligned
    prompt = list(range(1, 40))
    got = await stream(channel_to(decode.port), dpb.GenerateRequest(prompt_token_ids=prompt, max_tokens=3), timeout=20)
    assert got.tokens == stamp.expected_tokens(prompt, 3, decode.host.spec.vocab_size)
    assert got.summary is not None and got.summary.state_verified


async def test_state_check_fails_on_wrong_bytes(start_prefill: Any, start_decode: Any, channel_to: Any) -> None:
    """Negative control: decode's check must see it when the bytes are not prefill's."""

    class Corrupting(stamp.StampEngine):  # type: ignore[misc, name-defined]
        def check_state(self, prompt: Any, num_computed: int, blocks: Any, *, chunk_tokens: int | None = None) -> list[str]:
            for _, page in self._mamba_pages(blocks):
                page[0] ^= 0xFF
            return super().check_state(prompt, num_computed, blocks)  # type: ignore[no-any-return]

    prefill = await start_prefill()
    decode = await start_decode(prefill.port, "--check-state", engine=Corrupting)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stream(channel_to(decode.port), dpb.GenerateRequest(prompt_token_ids=[1, 2, 3], max_tokens=2), timeout=20)
    failure = describe(err.value)
    assert failure.status == "DATA_LOSS", failure
    assert "differs" in failure.message
    assert decode.host.allocator.num_used == 0


async def test_concurrent_requests(start_prefill: Any, start_decode: Any, channel_to: Any) -> None:
    prefill = await start_prefill()
    decode = await start_decode(prefill.port, "--check-state")
    channel = channel_to(decode.port)
    prompts = [[i, i + 1, i + 2, (3 * i) % 200 + 1] * (1 + i % 3) for i in range(16)]
    results = await asyncio.gather(
        *(stream(channel, dpb.GenerateRequest(prompt_token_ids=p, max_tokens=5), timeout=20) for p in prompts)
    )
    vocab = decode.host.spec.vocab_size
    for prompt, got in zip(prompts, results):
        assert got.tokens == stamp.expected_tokens(prompt, 5, vocab)
        assert got.summary is not None and got.summary.state_verified
    await _until(lambda: prefill.host.allocator.num_used == 0)
    assert decode.host.allocator.num_used == 0
    assert prefill.pins.ended["read"] == 16


async def test_text_prompt_and_text_output(start_prefill: Any, start_decode: Any, channel_to: Any) -> None:
    prefill = await start_prefill()
    decode = await start_decode(prefill.port)
    got = await stream(channel_to(decode.port), dpb.GenerateRequest(prompt="héllo", max_tokens=8), timeout=20)
    assert got.summary is not None and got.summary.prompt_token_count == len("héllo".encode())
    assert got.tokens == stamp.expected_tokens(list("héllo".encode()), 8, decode.host.spec.vocab_size)
    assert got.text == bytes(got.tokens).decode("utf-8", errors="replace")


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"prompt_token_ids": [], "max_tokens": 4}, "prompt"),
        ({"prompt_token_ids": [1, 2], "max_tokens": 0}, "max_tokens"),
        ({"prompt_token_ids": [1, 100000], "max_tokens": 4}, "prompt_token_ids"),
        ({"prompt": "a", "prompt_token_ids": [1], "max_tokens": 4}, "prompt"),
        ({"prompt_token_ids": [1, 2], "max_tokens": 10_000_000}, "max_tokens"),
    ],
)
async def test_bad_input_names_the_field(
    start_prefill: Any, start_decode: Any, channel_to: Any, fields: dict[str, Any], field: str
) -> None:
    prefill = await start_prefill()
    decode = await start_decode(prefill.port)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stream(channel_to(decode.port), dpb.GenerateRequest(**fields), timeout=20)
    failure = describe(err.value)
    assert failure.status == "INVALID_ARGUMENT"
    assert failure.fields == (field,)
    assert failure.message.startswith(field)
    assert prefill.host.allocator.num_used == 0 and decode.host.allocator.num_used == 0
    assert prefill.host.engine.prefills == 0  # nothing touched


async def _until(condition: Any, timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.01)
