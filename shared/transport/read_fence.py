"""A request's READs, and what has to wait until NIXL has released every one of their handles.

A READ that times out or is cancelled fails its request at once, but its handle may still be in
flight: NIXL may not have cancelled it yet (a cancel that fails is retried by the owner thread's
pumps). Until the handle is released the transfer can still write into the request's blocks, so
freeing them (decode) or letting prefill unpin its source blocks must wait. The fence collects
each READ's post and runs such actions once every READ posted through it is released.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from shared.transport.agent import RankAgent, Xfer

log = logging.getLogger(__name__)


class ReadFence:
    """Use from one event loop. `add` every READ's post; `when_released` queues the actions."""

    def __init__(self) -> None:
        self._pending = 0  # posts not finished, and READs posted but not released
        self._actions: list[Callable[[], object]] = []
        self._abandoned = False
        self._posted: list[tuple[RankAgent, Xfer]] = []
        self._loop = asyncio.get_running_loop()

    @property
    def released(self) -> bool:
        """Every READ added so far has finished its post and had its handle released."""
        return self._pending == 0

    def add(self, agent: RankAgent, post: asyncio.Future[Xfer]) -> None:
        """Track the READ `post` will return (a failed post leaves nothing to wait for)."""
        self._pending += 1
        post.add_done_callback(lambda done: self._posted_one(agent, done))

    def abandon(self) -> None:
        """The request will not use its READs any more: release every one not released yet,
        including those whose post has not finished (it is released as soon as it has)."""
        self._abandoned = True
        for agent, xfer in self._posted:
            if not xfer.released:
                agent.drop(xfer)

    def when_released(self, action: Callable[[], object]) -> None:
        """Run `action` on the loop once every READ added so far is released (now, if they are)."""
        if self.released:
            action()
        else:
            self._actions.append(action)

    async def wait(self) -> None:
        """Return once every READ added so far is released."""
        if self.released:
            return
        done: asyncio.Future[None] = self._loop.create_future()

        def wake() -> None:
            if not done.done():
                done.set_result(None)

        self._actions.append(wake)
        await asyncio.shield(done)

    # ---- internals ----

    def _posted_one(self, agent: RankAgent, post: asyncio.Future[Xfer]) -> None:
        if post.cancelled() or post.exception() is not None:
            self._one_released()  # nothing was posted, or NIXL released it when the post failed
            return
        xfer = post.result()
        self._posted.append((agent, xfer))
        if self._abandoned and not xfer.released:
            agent.drop(xfer)

        def released(_: object) -> None:  # on the owner thread
            with contextlib.suppress(RuntimeError):  # the event loop is gone: nobody waits any more
                self._loop.call_soon_threadsafe(self._one_released)

        xfer.release_done.add_done_callback(released)

    def _one_released(self) -> None:
        self._pending -= 1
        if self._pending:
            return
        actions, self._actions = self._actions, []
        for action in actions:
            try:
                action()
            except Exception:
                log.exception("an action waiting for a request's READs to be released failed")
