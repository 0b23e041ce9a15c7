"""The READs of one request's manifest parts (pipelined transfer), started as the parts arrive.

Prefill sends a part after each chunk that made attention blocks final; decode READs it (and
checks its digests) at once, while prefill computes the next chunk. The last part answers the
job as a whole manifest does; by then most of the state has moved. Every READ goes through the
request's `ReadFence`, so on failure the request cancels these READs (`cancel`) and releases
its blocks, here and on prefill, only once the fence says no READ of any part can still land.
A part whose READ or digest check fails ends the request at once (`on_failure`: the session
fails the job's wait with it), while prefill may still be computing later chunks: the
caller's release stops that job.

With decode's prefix cache the parts cover only the tokens after the cached prefix (every
part repeats `skipped_tokens`, and the first starts there); each part's READ moves just its
own token range, so no READ of a part ever writes the cache's shared blocks. Layer parts split
the last chunk's token range by model layers: each READs (and checks) just its layers' state.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Coroutine
from typing import Any

from decode_svc.reader import ReadStats
from decode_svc.session_client import SessionClient
from shared.cache.manifest import Manifest
from shared.errors import Internal


class PartReads:
    def __init__(self) -> None:
        self.parts: list[Manifest] = []
        self.source: SessionClient | None = None  # the session the parts came on (it releases them)
        self._tasks: list[asyncio.Future[ReadStats]] = []
        self._failure: BaseException | None = None  # the first part READ (or check) that failed
        # Told the first failure at once (the session fails the job's wait with it).
        self.on_failure: Callable[[BaseException], None] | None = None

    @property
    def any(self) -> bool:
        """Whether a part arrived: from then on the job is not retried elsewhere."""
        return bool(self.parts)

    def arrived(self, part: Manifest, read: Coroutine[Any, Any, ReadStats]) -> None:
        """Start `read`, the READ (and digest check) of `part`."""
        self.parts.append(part)
        task = asyncio.ensure_future(read)
        task.add_done_callback(self._note_failure)
        self._tasks.append(task)

    def _note_failure(self, task: asyncio.Future[ReadStats]) -> None:
        if task.cancelled() or self._failure is not None:
            return
        self._failure = task.exception()
        if self._failure is not None and self.on_failure is not None:
            self.on_failure(self._failure)

    def check_chain(self, last: Manifest, peer: str, num_layers: int) -> None:
        """The parts and `last` must cover the computed tokens after the skipped prefix (decode's
        prefix cache holds the K/V before it) once, in order, all skipping the same prefix, and
        layer parts the `num_layers` layers of their token range once, in order: a part that
        went missing would leave state unread (INTERNAL, BAD_MANIFEST: a peer bug), checked
        before the last READ."""
        chain = [*self.parts, last]
        if last.part is None:
            if self.parts:
                raise Internal(f"prefill {peer} ended parts with a whole manifest", field="manifest.part", reason="BAD_MANIFEST")
            return
        skipped = {m.skipped_tokens for m in chain}
        if len(skipped) > 1:
            raise Internal(
                f"prefill {peer} sent parts skipping {sorted(skipped)} prompt tokens: not one count",
                field="manifest.skipped_prompt_tokens",
                reason="BAD_MANIFEST",
            )
        indices = [m.part.index if m.part is not None else -1 for m in chain]
        edges = _token_ranges(chain, num_layers)
        start = last.skipped_tokens
        contiguous = edges is not None and edges[0][0] == start and all(a[1] == b[0] for a, b in itertools.pairwise(edges))
        if indices != list(range(last.part.count)) or not contiguous:
            covered = [m.part.describe() for m in chain if m.part is not None]
            raise Internal(
                f"prefill {peer} sent parts {indices} of {last.part.count}: {covered}: not every token and layer once, in order",
                field="manifest.part",
                reason="BAD_MANIFEST",
            )

    async def gather(self) -> ReadStats:
        """The parts' READs, summed once all are done; the first failure is raised."""
        total = ReadStats()
        for stats in await asyncio.gather(*self._tasks):
            total.add(stats)
        return total

    async def cancel(self) -> None:
        """Stop every part's READ and wait until each has handed its READs to the fence."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def _token_ranges(chain: list[Manifest], num_layers: int) -> list[tuple[int, int]] | None:
    """The token ranges a chain of parts covers, one per range: a part of every layer, or layer
    parts of one token range covering layers [0, num_layers) in order. None: layer parts that
    do not (a gap, an overlap, a range left open, or another token range inside them)."""
    ranges: list[tuple[int, int]] = []
    next_layer = 0  # inside a token range's layer parts: the layer the next part starts at
    for m in chain:
        tokens, layers = (m.tokens_from, m.tokens_to), m.layers
        if next_layer:
            if layers is None or layers.start != next_layer or tokens != ranges[-1]:
                return None
        else:
            if layers is not None and layers.start != 0:
                return None
            ranges.append(tokens)
        next_layer = 0 if layers is None or layers.stop == num_layers else layers.stop
    return None if next_layer else ranges
