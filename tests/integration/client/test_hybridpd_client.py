"""hybridpd_client (sync and async) against a real pair: generate() and stream() give the
colocated tokens with typed results; failures raise GenerateError with the status, reason and
field; a cancelled stream frees its blocks."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from hybridpd_client import AsyncClient, Client, GenerateError, GenerateResult, TokenChunk
from shared.engine.reference.colocated import colocated_generate
from tests.integration.http.conftest import HttpPair, start_pair, stop_pair

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(120)]


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def pair() -> AsyncIterator[HttpPair]:
    running = await start_pair()
    try:
        yield running
    finally:
        await stop_pair(running)


def target(pair: HttpPair) -> str:
    return f"127.0.0.1:{pair.decode.port}"


def expected(pair: HttpPair, prompt: list[int], n: int) -> tuple[int, ...]:
    return tuple(colocated_generate(pair.decode.host.spec, prompt, n))


async def test_async_generate_and_stream(pair: HttpPair) -> None:
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    async with AsyncClient(target(pair), timeout=30) as client:
        result = await client.generate(prompt, 20, request_id="client-1")
        stream = client.stream("hello", 12)
        chunks = [c async for c in stream]
    assert isinstance(result, GenerateResult)
    assert result.token_ids == expected(pair, prompt, 20)
    assert result.token_ids != expected(pair, prompt[::-1], 20)  # negative control
    assert result.request_id == "client-1" and result.generated_token_count == 20 and result.finish_reason == "length"
    assert result.num_transferred_tokens == len(prompt) - 1 and result.transfer.read_count == 1
    assert result.transfer.total_bytes == result.transfer.attention_bytes + result.transfer.conv_bytes + result.transfer.ssm_bytes
    assert all(isinstance(c, TokenChunk) for c in chunks) and len(chunks) > 1
    assert stream.result is not None
    assert tuple(i for c in chunks for i in c.token_ids) == stream.result.token_ids == expected(pair, list(b"hello"), 12)
    assert stream.result.text == "".join(c.text for c in chunks)


async def test_sync_generate_and_stream(pair: HttpPair) -> None:
    def run() -> tuple[GenerateResult, list[TokenChunk]]:
        with Client(target(pair), timeout=30) as client:
            result = client.generate([10, 20, 30], 7)
            chunks = list(client.stream([10, 20, 30], 7))
        return result, chunks

    result, chunks = await asyncio.to_thread(run)
    assert result.token_ids == expected(pair, [10, 20, 30], 7)
    assert tuple(i for c in chunks for i in c.token_ids) == result.token_ids


async def test_errors_carry_status_reason_and_field(pair: HttpPair) -> None:
    async with AsyncClient(target(pair), timeout=30) as client:
        with pytest.raises(GenerateError) as bad:
            await client.generate([1, 2], 10**6)
        with pytest.raises(GenerateError) as empty:
            await client.generate([], 3)

    def sync_bad() -> GenerateError:
        with Client(target(pair), timeout=30) as client, pytest.raises(GenerateError) as info:
            client.generate([1], 0)
        return info.value

    zero = await asyncio.to_thread(sync_bad)
    assert bad.value.status == "INVALID_ARGUMENT" and bad.value.fields == ("max_tokens",) and not bad.value.retryable
    assert empty.value.status == "INVALID_ARGUMENT" and empty.value.fields == ("prompt",)
    assert zero.status == "INVALID_ARGUMENT" and zero.fields == ("max_tokens",)


@pytest.mark.parametrize(
    ("prompt", "max_tokens", "request_id", "named"),
    [
        ([1, 2], 2**32, None, "max_tokens"),
        ([1, 2], -1, None, "max_tokens"),
        ([1, 2**32], 3, None, "prompt"),
        ([1, -2], 3, None, "prompt"),
        ([1, 2], 3, 7, "request_id"),
    ],
)
async def test_arguments_the_wire_cannot_carry_are_value_errors_naming_them(
    prompt: list[int], max_tokens: int, request_id: object, named: str
) -> None:
    """Raised before anything is sent (protobuf alone would say "Value out of range"); the
    address is never dialled."""
    with Client("127.0.0.1:1") as client, pytest.raises(ValueError, match=f"^{named} ") as sync_error:
        client.generate(prompt, max_tokens, request_id=request_id)  # type: ignore[arg-type]
    async with AsyncClient("127.0.0.1:1") as aclient:
        with pytest.raises(ValueError, match=f"^{named} "):
            await aclient.generate(prompt, max_tokens, request_id=request_id)  # type: ignore[arg-type]
    assert "out of range" not in str(sync_error.value)


async def test_unreachable_service_is_a_retryable_error() -> None:
    async with AsyncClient("127.0.0.1:1", timeout=2) as client:
        with pytest.raises(GenerateError) as info:
            await client.generate([1], 1)
    assert info.value.status == "UNAVAILABLE" and info.value.retryable


async def test_cancelled_stream_frees_the_blocks(pair: HttpPair) -> None:
    async with AsyncClient(target(pair), timeout=30) as client:
        stream = client.stream([1, 2, 3, 4], 1500)
        first = await stream.__anext__()
        assert first.token_ids == expected(pair, [1, 2, 3, 4], 1)
        stream.cancel()
        with pytest.raises(GenerateError) as info:
            async for _ in stream:
                pass
    assert info.value.status == "CANCELLED"
    await pair.blocks_freed()
