"""The last chunk's layer parts, from the compute thread to the event loop (pipelined transfer,
--layer-parts).

The conv and SSM state is final only once the last chunk computed its layer, so without layer
parts all of it, with the last chunk's K/V, moves after the prompt. With them, the engine reports
each model layer final during the last chunk (`PrefillRun.compute`'s `on_layer`); when a range
of layers is complete, its digests are taken and the loop sends it as a part while the later
layers still compute. The last range is the job's last part, as without layer parts.

Threads: `on_layer` runs on the compute thread; it hands the range to the loop at once. On a
host cache the loop takes the range's digests on the digest thread, beside the compute (nothing
writes a layer's bytes after it was reported); on a device cache they are taken on the compute
thread, as every part's are there. A job that stops (its pin ended, a failure) makes the next
report raise, so the chunk stops computing, and the loop takes no range any more.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

from shared.cache.digest import SectionDigest
from shared.errors import Aborted

Digests = tuple[list[SectionDigest], float]
"""A part's digests and the seconds they took."""


class LayerPartFeed:
    def __init__(
        self,
        request_id: str,
        ranges: list[range],
        stop: threading.Event,
        take_digests: Callable[[range], Digests],
        aside: Callable[[range], asyncio.Future[Digests]] | None,
    ) -> None:
        """`take_digests(layers)`: a range's digests, on the thread that calls it; `aside`, if
        given: the same, queued on another thread (called on the loop); `stop`: set once the job
        stops."""
        self.request_id = request_id
        self.ranges = ranges
        self.stop = stop
        self._take_digests = take_digests
        self._aside = aside
        self._loop = asyncio.get_running_loop()
        self._ends = {r.stop - 1: k for k, r in enumerate(ranges[:-1])}  # last layer of a range -> its index
        self._ready: asyncio.Queue[tuple[int, asyncio.Future[Digests]]] = asyncio.Queue()
        self.reading: list[asyncio.Future[Digests]] = []  # digests taken aside (the blocks stay until they are done)
        self.on_reading: Callable[[], None] | None = None  # told of each new one (the pin's writer covers it)
        self.digest_seconds = 0.0  # digests taken on the compute thread (on its path, not the engine's time)

    def on_layer(self, layer: int) -> None:
        """On the compute thread: `layer` is final; a range it completes goes to the loop."""
        if self.stop.is_set():
            raise Aborted(f"request {self.request_id} was released during its prefill", reason="RELEASED")
        k = self._ends.get(layer)
        if k is None:
            return
        digests: Digests | None = None
        if self._aside is None:
            began = time.monotonic()
            digests = self._take_digests(self.ranges[k])
            self.digest_seconds += time.monotonic() - began
        self._loop.call_soon_threadsafe(self._arrived, k, digests)

    def _arrived(self, k: int, digests: Digests | None) -> None:
        if self.stop.is_set():  # the job stopped: nobody sends the part, and its blocks may go
            return
        if digests is None:
            assert self._aside is not None
            future = self._aside(self.ranges[k])
            self.reading.append(future)
            if self.on_reading is not None:
                self.on_reading()
        else:
            future = self._loop.create_future()
            future.set_result(digests)
        self._ready.put_nowait((k, future))

    async def next(self, compute: asyncio.Future[Any]) -> tuple[int, Digests]:
        """The next range (its index) and its digests, in order; the chunk's own error if its
        compute fails first. A compute that succeeded reported every range before it settled."""
        getter = asyncio.ensure_future(self._ready.get())
        try:
            await asyncio.wait({getter, compute}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not getter.done():
                getter.cancel()
        if getter.done() and not getter.cancelled():
            k, future = getter.result()
        else:
            await asyncio.shield(compute)  # raises the chunk's error, if any (never cancels it: it writes the blocks)
            k, future = self._ready.get_nowait()
        return k, await asyncio.shield(future)
