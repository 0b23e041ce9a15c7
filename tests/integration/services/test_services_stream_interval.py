"""--stream-interval N through the real services: a sequence's first token goes out alone, then
its tokens in chunks of N, and whatever is left the moment it ends (length, a stop token, a
failure); the tokens, their text and their logprobs are N = 1's bit for bit, over gRPC and
through the HTTP front door's SSE events (read by the official `openai` client).

One prefill and two decode engines (N = 1 and N = 4) of the tiny seeded reference model, on real
grpc.aio servers with NIXL READs over UCX on DRAM."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import openai
import pytest
import pytest_asyncio

from decode_svc.app import DecodeApp
from prefill_svc.app import PrefillApp
from shared.config import parse_settings
from shared.engine.logprobs import TokenLogprobs
from shared.engine.protocol import DecodeSession, Engine
from shared.engine.text import TextStream
from shared.layout.page import EngineLayout
from shared.pb.hybridpd.v1 import decode_service_pb2 as dpb
from shared.pb.hybridpd.v1 import decode_service_pb2_grpc as dpb_grpc
from shared.rpc.logprobs_message import logprobs_of
from shared.runtime.colocated import Colocated
from shared.runtime.engine_host import EngineFactory, engine_factory_for
from tests.integration.services.hf_services import hf_pair
from tests.reuse import REUSE_OFF

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(180)]

MODEL = "tiny-mamba2"
COMMON = ["--model", MODEL, "--engine", "reference", "--num-blocks", "96", "--port", "0", "--host", "127.0.0.1",
          "--loop", "asyncio", "--log-level", "WARNING"]  # fmt: skip
PROMPT = list(b"Streams in groups of four tokens")
SEEDED = dpb.SamplingParams(temperature=0.9, top_k=40, seed=11)


@dataclass
class Reply:
    """One Generate call read to its end, chunk by chunk."""

    chunks: list[dpb.TokenChunk] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs] | None = None
    summary: dpb.GenerateSummary | None = None

    def tokens(self, index: int = 0) -> list[int]:
        return [t for c in self.chunks if c.index == index for t in c.token_ids]

    def sizes(self, index: int = 0) -> list[int]:
        """Tokens per chunk of sequence `index` (text-only chunks left out)."""
        return [len(c.token_ids) for c in self.chunks if c.index == index and c.token_ids]

    def text(self, index: int = 0) -> str:
        return "".join(c.text for c in self.chunks if c.index == index)

    def logprobs(self, index: int = 0) -> list[TokenLogprobs]:
        return [logprobs_of(lp) for c in self.chunks if c.index == index for lp in c.logprobs]


async def generate(port: int, into: Reply | None = None, **fields: object) -> Reply:
    reply = into if into is not None else Reply()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        request = dpb.GenerateRequest(**fields)  # type: ignore[arg-type]
        async for response in dpb_grpc.DecodeServiceStub(channel).Generate(request, timeout=60):
            kind = response.WhichOneof("payload")
            if kind == "chunk":
                reply.chunks.append(response.chunk)
            elif kind == "prompt_logprobs":
                reply.prompt_logprobs = [logprobs_of(lp) for lp in response.prompt_logprobs.tokens]
            else:
                reply.summary = response.summary
    return reply


def grouped(count: int, interval: int) -> list[int]:
    """Chunk sizes of `count` tokens: the first alone, then `interval` at a time, the rest last."""
    rest = count - 1
    return [1] + [interval] * (rest // interval) + ([rest % interval] if rest % interval else [])


@dataclass
class Services:
    prefill: PrefillApp
    each_token: DecodeApp  # --stream-interval 1 (the default)
    by_four: DecodeApp  # --stream-interval 4, with the HTTP API on


async def start_decode(prefill: PrefillApp, engine_id: str, *flags: str, engine: EngineFactory | None = None) -> DecodeApp:
    argv = [*COMMON, "--engine-id", engine_id, "--prefill", f"127.0.0.1:{prefill.port}", *REUSE_OFF, *flags]
    decode = await DecodeApp.start(parse_settings("decode", argv, environ={}), engine or engine_factory_for("reference"))
    await decode.wait_ready(30)
    return decode


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def services() -> AsyncIterator[Services]:
    settings = parse_settings("prefill", [*COMMON, "--heartbeat-seconds", "1.0", "--engine-id", "si-prefill"], environ={})
    prefill = await PrefillApp.start(settings, engine_factory_for("reference"))
    decodes: list[DecodeApp] = []
    try:
        decodes.append(await start_decode(prefill, "si-decode-1"))
        decodes.append(await start_decode(prefill, "si-decode-4", "--stream-interval", "4", "--http-port", "0"))
        async with asyncio.timeout(10):  # HTTP readiness follows the peers through a callback
            while not decodes[1].shell.health.ready:
                await asyncio.sleep(0.02)
        yield Services(prefill, *decodes)
    finally:
        apps: list[DecodeApp | PrefillApp] = [*decodes, prefill]
        for app in apps:
            await asyncio.wait_for(app.stop(), 30)


async def test_the_default_sends_one_token_per_chunk(services: Services) -> None:
    reply = await generate(services.each_token.port, prompt_token_ids=PROMPT, max_tokens=16, ignore_eos=True)
    assert reply.sizes() == [1] * 16
    assert services.each_token.settings.stream_interval == 1


@pytest.mark.parametrize("max_tokens", [65, 64, 2])
async def test_tokens_go_out_in_groups_of_four_equal_to_one_by_one(services: Services, max_tokens: int) -> None:
    fields: dict[str, Any] = dict(prompt_token_ids=PROMPT, max_tokens=max_tokens, ignore_eos=True)
    one = await generate(services.each_token.port, **fields)
    four = await generate(services.by_four.port, **fields)
    # 65: the first alone, then 16 of four; 64 and 2: the remainder last, at once.
    assert four.sizes() == grouped(max_tokens, 4)
    assert four.tokens() == one.tokens() and len(one.tokens()) == max_tokens
    assert four.text() == one.text()
    assert four.summary is not None and one.summary is not None
    assert four.summary.generated_token_count == max_tokens
    assert four.summary.finish_reason == one.summary.finish_reason == dpb.FINISH_REASON_LENGTH
    # Negative control: the comparison sees another prompt's tokens.
    other = await generate(services.each_token.port, prompt_token_ids=[*PROMPT[:-1], 7], max_tokens=max_tokens, ignore_eos=True)
    assert other.tokens() != four.tokens()


async def test_a_stop_token_mid_group_ends_the_stream_at_once(services: Services) -> None:
    whole = (await generate(services.each_token.port, prompt_token_ids=PROMPT, max_tokens=48, ignore_eos=True)).tokens()
    # A token whose first appearance ends the sequence mid-group (not the first, not a group's last).
    ends = [n for n in range(2, len(whole) + 1) if whole[n - 1] not in whole[: n - 1] and (n - 1) % 4]
    assert ends, f"no token first appears mid-group in {whole}"
    n = ends[-1]
    fields: dict[str, Any] = dict(prompt_token_ids=PROMPT, max_tokens=48, ignore_eos=True, stop_token_ids=[whole[n - 1]])
    four = await generate(services.by_four.port, **fields)
    one = await generate(services.each_token.port, **fields)
    assert four.tokens() == one.tokens() == whole[:n]
    assert four.sizes() == grouped(n, 4) and four.sizes()[-1] < 4  # the part-filled group went out with the stop
    assert four.summary is not None and four.summary.finish_reason == dpb.FINISH_REASON_STOP


async def test_logprobs_several_sequences_and_prompt_logprobs_keep_their_shapes(services: Services) -> None:
    fields: dict[str, Any] = dict(
        prompt_token_ids=PROMPT, max_tokens=11, ignore_eos=True, n=3, logprobs=2, prompt_logprobs=1, sampling=SEEDED
    )
    one = await generate(services.each_token.port, **fields)
    four = await generate(services.by_four.port, **fields)
    assert four.prompt_logprobs is not None and four.prompt_logprobs == one.prompt_logprobs
    assert len(four.prompt_logprobs) == len(PROMPT) - 1
    for chunk in four.chunks:  # one logprobs entry per token, in every chunk
        assert len(chunk.logprobs) == len(chunk.token_ids)
    for i in range(3):
        assert four.sizes(i) == grouped(11, 4)
        assert four.tokens(i) == one.tokens(i)
        assert four.logprobs(i) == one.logprobs(i)  # every float bit for bit
        assert all(len(lp.top) == 2 for lp in four.logprobs(i))
    assert four.tokens(0) != four.tokens(1)  # negative control: the sequences are told apart
    assert four.summary is not None and list(four.summary.generated_token_counts) == [11, 11, 11]


async def test_at_full_n_prefills_first_tokens_go_alone_then_groups(hf_checkpoint: Callable[[str], str]) -> None:
    """The paged engine's pair: prefill draws every sequence's first token, which decode sends
    at once (before its READ), then the decode steps' tokens in groups."""
    model = hf_checkpoint("qwen3_5")
    prompt = [5, 17, 33, 2, 91, 40, 7, 12, 60, 3, 21]
    async with hf_pair(model, model, 1, 1, engine="paged", decode_flags=("--stream-interval", "4")) as (_, decode):
        greedy = await generate(decode.port, prompt_token_ids=prompt, max_tokens=10, ignore_eos=True)
        forked = await generate(
            decode.port, prompt_token_ids=prompt, max_tokens=10, ignore_eos=True, n=2, logprobs=1, sampling=SEEDED
        )
    colocated = await asyncio.to_thread(Colocated.build, "paged", model, 1, 256)
    try:
        want = await colocated.generate("c", prompt, 10)
        other = await colocated.generate("d", [*prompt[:-1], 8], 10)
    finally:
        colocated.close()
    assert greedy.sizes() == grouped(10, 4)
    assert greedy.tokens() == want
    assert greedy.tokens() != other  # negative control: another last prompt token is seen
    for i in range(2):
        assert forked.sizes(i) == grouped(10, 4)
        assert len(forked.logprobs(i)) == 10
    assert all(len(c.logprobs) == len(c.token_ids) for c in forked.chunks)


class FailingAt:
    """The reference engine, with each decode session failing its step number `fail_at` (0-based):
    an engine fault in the middle of a group."""

    def __init__(self, engine: Engine, fail_at: int) -> None:
        self._engine = engine
        self._fail_at = fail_at

    def start_decode(self, *args: object, **kwargs: object) -> DecodeSession:
        return FailingSession(self._engine.start_decode(*args, **kwargs), self._fail_at)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> object:
        return getattr(self._engine, name)


class FailingSession:
    def __init__(self, inner: DecodeSession, fail_at: int) -> None:
        self._inner = inner
        self._fail_at = fail_at
        self._steps = 0

    def step(self) -> int:
        if self._steps == self._fail_at:
            raise RuntimeError("the engine failed this request's step")
        self._steps += 1
        return self._inner.step()

    def __getattr__(self, name: str) -> object:
        return getattr(self._inner, name)


async def test_a_failure_mid_group_sends_the_tokens_held_first(services: Services) -> None:
    reference = engine_factory_for("reference")

    def failing(layout: EngineLayout, caches: Sequence[object]) -> Engine:
        return FailingAt(reference(layout, caches), fail_at=6)  # type: ignore[arg-type, return-value]

    decode = await start_decode(services.prefill, "si-decode-failing", "--stream-interval", "4", engine=failing)
    try:
        fields: dict[str, Any] = dict(prompt_token_ids=PROMPT, max_tokens=20, ignore_eos=True)
        got = Reply()
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await generate(decode.port, into=got, **fields)
        whole = await generate(services.each_token.port, **fields)
    finally:
        await asyncio.wait_for(decode.stop(), 30)
    assert failed.value.code() == grpc.StatusCode.INTERNAL
    # Six steps computed: the first alone, a group of four, and the sixth held when the seventh failed.
    assert got.sizes() == [1, 4, 1]
    assert got.tokens() == whole.tokens()[:6]


def mid_group_stop(tokens: Sequence[int], decoder: TextStream) -> tuple[str, int]:
    """A stop sequence of the text of `tokens` (two printable ASCII characters) that the
    tokens complete mid-group, and how many tokens that takes (decoded one at a time, as the
    front door matches stops)."""
    texts, text = [], ""
    for token in tokens:
        text += decoder.feed([token])
        texts.append(text)
    for i in range(len(text) - 1):
        stop = text[i : i + 2]
        if not all(" " <= ch <= "~" for ch in stop) or text.find(stop) != i:
            continue
        used = next(n for n, t in enumerate(texts, start=1) if stop in t)
        if (used - 1) % 4 and used < len(tokens):
            return stop, used
    raise AssertionError(f"no stop sequence ends mid-group in {text!r}")


async def test_http_streaming_sends_the_same_text_in_groups(services: Services) -> None:
    base_url = f"http://127.0.0.1:{services.by_four.shell.http_port}/v1"
    prompt = bytes(PROMPT).decode()
    whole = await generate(services.each_token.port, prompt_token_ids=PROMPT, max_tokens=30)
    async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=30) as client:
        stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=30, logprobs=1, stream=True)
        chunks = [c async for c in stream]
        text_events = [c.choices[0] for c in chunks if c.choices and c.choices[0].logprobs is not None]
        assert [len(c.logprobs.tokens or []) for c in text_events] == grouped(30, 4)  # type: ignore[union-attr]
        assert "".join(c.text for c in text_events) == whole.text()
        assert whole.text() != (await generate(services.each_token.port, prompt_token_ids=PROMPT, max_tokens=29)).text()
        assert chunks[-1].choices[0].finish_reason == "length"

        # A stop sequence completed mid-group: the text ends before it, in the group that completed it.
        stop, used = mid_group_stop(whole.tokens(), services.by_four.http_api.tokenizer.stream())
        stream = await client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=30,
            logprobs=1,
            stop=[stop],
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [c async for c in stream]
    text_events = [c.choices[0] for c in chunks if c.choices and c.choices[0].logprobs is not None]
    assert "".join(c.text for c in text_events) == whole.text()[: whole.text().find(stop)]
    assert [len(c.logprobs.tokens or []) for c in text_events] == grouped(used, 4)  # type: ignore[union-attr]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == used
