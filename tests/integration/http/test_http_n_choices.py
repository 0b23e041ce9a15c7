"""`n` choices through the official `openai` client on a real pair: one prompt prefilled and
READ once, choice i the colocated request with seed + i, streamed or not, each cut at its own
stop sequence."""

from __future__ import annotations

import asyncio
from collections import defaultdict

import openai
import pytest

from decode_svc.request_options import sampling_from
from shared.engine.stopping import StopRule
from shared.pb.hybridpd.v1 import decode_service_pb2 as dpb
from shared.runtime.colocated import Colocated
from tests.integration.http.conftest import MODEL, HttpPair

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(120)]

PROMPT = "Forks of one prompt"
SEED = 11


async def colocated_texts(prompt: str, max_tokens: int, n: int) -> list[str]:
    return [text for text, _ in await colocated_scored(prompt, max_tokens, n)]


async def colocated_scored(prompt: str, max_tokens: int, n: int) -> list[tuple[str, float]]:
    """Each seed's text (colocated, alone) and cumulative logprob."""
    run = await asyncio.to_thread(Colocated.build, "reference", MODEL, 1, 512)
    texts = []
    try:
        for i in range(n):
            params = sampling_from(dpb.SamplingParams(temperature=1.0, seed=SEED + i))
            stream = run.stream("c", list(prompt.encode()), max_tokens, sampling=params, stop=StopRule(max_tokens), logprobs=0)
            got = [t async for t in stream]
            text = bytes(t.token_id for t in got).decode("utf-8", errors="replace")
            texts.append((text, sum(t.logprobs.logprob for t in got if t.logprobs is not None)))
    finally:
        run.close()
    return texts


def client(pair: HttpPair) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=pair.base_url + "/v1", api_key="unused", max_retries=0, timeout=30)


async def test_n_choices_are_the_colocated_requests_with_their_seeds(http_pair: HttpPair) -> None:
    want = await colocated_texts(PROMPT, 16, 3)
    assert len(set(want)) == 3  # negative control: the seeds give different texts
    async with client(http_pair) as c:
        out = await c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, n=3, temperature=1.0, seed=SEED)
        stream = await c.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=16, n=3, temperature=1.0, seed=SEED, stream=True
        )
        streamed: dict[int, str] = defaultdict(str)
        async for chunk in stream:
            for choice in chunk.choices:
                streamed[choice.index] += choice.text
        chat = await c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8, n=2, temperature=1.0, seed=SEED
        )
    assert [ch.index for ch in out.choices] == [0, 1, 2]
    assert [ch.text for ch in out.choices] == want
    assert [streamed[i] for i in range(3)] == want
    assert out.usage is not None and out.usage.completion_tokens == 3 * 16 and out.usage.prompt_tokens == len(PROMPT)
    assert [ch.index for ch in chat.choices] == [0, 1] and all(ch.finish_reason == "length" for ch in chat.choices)
    await http_pair.blocks_freed()


async def test_each_choice_stops_at_its_own_stop_sequence(http_pair: HttpPair) -> None:
    want = await colocated_texts(PROMPT, 24, 2)
    stop = want[1][5:7]  # in choice 1's text; wherever it falls in choice 0's, that one is cut there
    async with client(http_pair) as c:
        out = await c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, n=2, temperature=1.0, seed=SEED, stop=[stop])
    for choice, text in zip(out.choices, want, strict=True):
        cut = text.find(stop)
        assert choice.text == (text if cut < 0 else text[:cut])
        assert choice.finish_reason == ("length" if cut < 0 else "stop")
    assert out.choices[1].finish_reason == "stop"
    await http_pair.blocks_freed()


async def test_best_of_returns_the_choices_of_highest_cumulative_logprob(http_pair: HttpPair) -> None:
    scored = await colocated_scored(PROMPT, 12, 4)
    ranked = [text for text, _ in sorted(scored, key=lambda ts: -ts[1])]
    assert ranked[:2] != [text for text, _ in scored[:2]]  # negative control: the best are not the first two
    async with client(http_pair) as c:
        out = await c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, n=2, best_of=4, temperature=1.0, seed=SEED)
        with pytest.raises(openai.BadRequestError) as e:
            await c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, best_of=3, stream=True)
    assert [ch.text for ch in out.choices] == ranked[:2]
    assert [ch.index for ch in out.choices] == [0, 1] and all(ch.logprobs is None for ch in out.choices)
    assert "best_of" in str(e.value)
    await http_pair.blocks_freed()
