"""Routes NIXL notifications to whoever waits for them.

A READ's notification tells the rank that was read that its blocks may be reused.
The waiting side (prefill) registers how many notifications a key needs on one of
its agents *before* the reader can send them (before the manifest goes out); the
future resolves when that many arrived. The whole message is the key. Messages
nobody waits for (late ones after a lease expired, strangers) are counted and dropped.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from shared import observe
from shared.observe import Step

log = logging.getLogger(__name__)

UnknownHandler = Callable[[str, str, bytes], None]
"""Called with (local agent name, sender agent name, message) for a message nobody awaits."""


@dataclass(eq=False)
class _Wait:
    needed: int
    future: asyncio.Future[list[str]]
    senders: list[str] = field(default_factory=list)


class NotificationRouter:
    """Counts notifications per (local agent, key) and resolves the matching waits.

    Runs on the event loop thread only.
    """

    def __init__(self, on_unknown: UnknownHandler | None = None) -> None:
        self._waits: dict[tuple[str, bytes], _Wait] = {}
        self._pending_per_agent: dict[str, int] = {}
        self._on_unknown = on_unknown
        self.received = 0
        self.unknown = 0

    def expect(self, agent_name: str, key: bytes, count: int) -> asyncio.Future[list[str]]:
        """A future of the senders of the next `count` messages equal to `key` on that agent.

        Cancel it (e.g. when the lease expires) to stop waiting; later messages then
        count as unknown.
        """
        if count < 1:
            raise ValueError(f"count must be >= 1, got {count}")
        slot = (agent_name, key)
        if slot in self._waits:
            raise ValueError(f"already waiting for {key!r} on agent {agent_name}")
        future: asyncio.Future[list[str]] = asyncio.get_running_loop().create_future()
        wait = _Wait(count, future)
        self._waits[slot] = wait
        self._pending_per_agent[agent_name] = self._pending_per_agent.get(agent_name, 0) + 1
        # Covers cancellation by the waiter; resolution forgets the wait right away.
        future.add_done_callback(lambda _: self._forget(slot, wait))
        return future

    def pending(self, agent_name: str) -> int:
        """How many keys are still awaited on this agent (the poller pumps it while > 0)."""
        return self._pending_per_agent.get(agent_name, 0)

    def dispatch(self, agent_name: str, notifs: dict[str, list[bytes]]) -> None:
        """Feed what one `get_new_notifs()` of that agent returned."""
        observe.mark(Step.NOTIFICATION_DISPATCHED)
        for sender, messages in notifs.items():
            for msg in messages:
                self.received += 1
                slot = (agent_name, msg)
                wait = self._waits.get(slot)
                if wait is None or wait.future.done():
                    self._unknown(agent_name, sender, msg)
                    continue
                wait.senders.append(sender)
                if len(wait.senders) >= wait.needed:
                    self._forget(slot, wait)
                    wait.future.set_result(wait.senders)

    def _unknown(self, agent_name: str, sender: str, msg: bytes) -> None:
        self.unknown += 1
        log.debug("agent %s: notification %r from %s awaited by nobody", agent_name, msg, sender)
        if self._on_unknown is not None:
            self._on_unknown(agent_name, sender, msg)

    def _forget(self, slot: tuple[str, bytes], wait: _Wait) -> None:
        if self._waits.get(slot) is not wait:
            return
        del self._waits[slot]
        left = self._pending_per_agent[slot[0]] - 1
        if left:
            self._pending_per_agent[slot[0]] = left
        else:
            del self._pending_per_agent[slot[0]]
