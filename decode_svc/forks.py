"""A request of several sequences (`n`): one prompt, prefilled and READ once, then forked.

Sequence 0 decodes in the request's own blocks. Each other sequence gets blocks of its own
(allocated under `<request id>#<i>`) that lead with the request's full prompt attention blocks,
shared read-only (decode writes K/V from the computed tokens on, never before), and a copy of
the rest of the state: the attention block the computed tokens end in and every Mamba group's
conv / SSM blocks. The shared blocks stay held by the request until every sequence ended, when
all its blocks go back together.

Sequence i samples as a request with seed (seed + i) mod 2**64 would: at the full-N boundary its
first token was drawn by prefill with that seed from the same logits (`PrefillJob.fork_seeds`),
at n-1 each sequence computes the last prompt token itself.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import replace
from typing import TypeVar

import numpy as np

from decode_svc.block_copies import copy_blocks, state_block_ids
from decode_svc.growing_blocks import admission_tokens
from shared.engine.protocol import RequestBlocks
from shared.engine.sampling import SamplingParams
from shared.rpc.deadlines import wait_deadline
from shared.runtime.engine_host import EngineHost

T = TypeVar("T")
SEEDS = 2**64


def fork_sampling(sampling: SamplingParams, index: int) -> SamplingParams:
    """Sequence `index`'s sampling: the request's, with seed (seed + index) mod 2**64."""
    return sampling if index == 0 else replace(sampling, seed=(sampling.seed + index) % SEEDS)


def fork_seeds(sampling: SamplingParams, n: int) -> list[int]:
    """The seeds of sequences 1..n-1 (what prefill draws their first tokens with)."""
    return [fork_sampling(sampling, i).seed for i in range(1, n)]


def fork_key(request_id: str, index: int) -> str:
    return f"{request_id}#{index}"


async def fork_blocks(
    host: EngineHost,
    request_id: str,
    local: RequestBlocks,
    prompt_len: int,
    num_computed: int,
    n: int,
    deadline: float,
    run: Callable[[Callable[[], None]], Awaitable[None]],
) -> list[RequestBlocks]:
    """Blocks of sequences 1..n-1, each holding the state in `local` (shared prompt blocks,
    copied rest); `run` queues the copy on the compute thread. On failure the forks' blocks
    allocated so far are freed."""
    layout = host.layout
    lead = num_computed // layout.block_size
    leading = [
        np.asarray(ids[:lead] if g.kind == "attention" else ids[:0], dtype=np.int64)
        for ids, g in zip(local.block_ids, layout.groups)
    ]
    forks: list[RequestBlocks] = []
    loop = asyncio.get_running_loop()
    try:
        for i in range(1, n):
            key = fork_key(request_id, i)
            forks.append(
                await host.allocate_queued(
                    key,
                    admission_tokens(prompt_len),
                    wait_deadline(deadline, loop.time()),
                    leading=leading,
                    running=True,  # the request holds blocks already: no line behind newcomers' waits
                )
            )
    except BaseException:
        for i in range(1, len(forks) + 1):
            host.free(fork_key(request_id, i))
        raise
    src = state_block_ids(layout, local, lead, num_computed)
    dst = np.concatenate([state_block_ids(layout, f, lead, num_computed) for f in forks])

    def copy() -> None:
        copy_blocks(host.views, np.tile(src, len(forks)), dst)

    await run(copy)
    return forks


async def merged(streams: Sequence[AsyncIterator[T]]) -> AsyncIterator[T]:
    """The items of every stream as they come; the first failure ends all of them."""
    queue: asyncio.Queue[tuple[int, T | None, BaseException | None]] = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                await queue.put((i, item, None))
        except BaseException as e:  # the stream's failure (or its cancellation) ends the merge
            await queue.put((i, None, e))
            return
        finally:
            with contextlib.suppress(BaseException):
                await stream.aclose()  # type: ignore[attr-defined]
        await queue.put((i, None, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    open_streams = len(tasks)
    try:
        while open_streams:
            _, item, error = await queue.get()
            if error is not None:
                raise error
            if item is None:
                open_streams -= 1
                continue
            yield item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
