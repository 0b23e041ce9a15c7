"""The loopback self-READ a service does before it calls itself ready.

An agent that was created and registered memory can still be unable to move data (a missing
UCX transport, ptrace restrictions that block cma, a poller that never pumps). So each rank
READs a few random bytes from the end of its own cache into the start of it, with a
notification, through the same agent, prepared lists and completion poller that serve
requests, and checks the bytes and the notification. The cache is zeroed again afterwards.
"""

from __future__ import annotations

import asyncio
import secrets

import numpy as np
import torch

from shared.cache.regions import RankCache
from shared.errors import Unavailable
from shared.timeouts import within
from shared.transport.agent import PreppedList, RankAgent
from shared.transport.poller import CompletionPoller
from shared.transport.read_fence import ReadFence

LOOPBACK_BYTES = 4096


async def loopback_read(agent: RankAgent, cache: RankCache, poller: CompletionPoller, *, timeout: float = 10.0) -> int:
    """READ from this rank's own memory and check the bytes; returns how many moved.

    Raises Unavailable (reason LOOPBACK_FAILED) naming the agent when anything fails.
    """
    region = cache.regions[0]
    size = region.numel()
    n = min(LOOPBACK_BYTES, size // 2)
    source, target = region[size - n :], region[:n]
    source.copy_(torch.randint(0, 256, (n,), dtype=torch.uint8))
    target.zero_()
    key = f"loopback-{secrets.token_hex(4)}".encode()
    prepped: list[PreppedList] = []
    wait = poller.expect(agent, key, 1)
    reads = ReadFence()
    try:
        prepped.append(await agent.prep_local(np.array([[target.data_ptr(), n]], dtype=np.int64)))
        prepped.append(await agent.prep_remote(agent.name, np.array([[source.data_ptr(), n]], dtype=np.int64), cache.place))
        await poller.read(agent, prepped[0], [0], prepped[1], [0], key, timeout=timeout, fence=reads)
        await _notification(agent, poller, wait, timeout)
        if not torch.equal(target, source):
            raise RuntimeError(f"{int((target != source).sum())} of {n} bytes differ after the READ")
    except Exception as e:
        reads.abandon()
        raise Unavailable(
            f"agent {agent.name}: the loopback self-READ failed, so this service cannot move state: {e}",
            reason="LOOPBACK_FAILED",
        ) from e
    finally:
        wait.cancel()
        # Lists are released and the bytes zeroed only once the READ cannot land any more.
        await within(reads.wait(), timeout)
        for p in prepped:
            await agent.release_prepped(p)
        source.zero_()
        target.zero_()
    return n


async def _notification(agent: RankAgent, poller: CompletionPoller, wait: asyncio.Future[list[str]], timeout: float) -> None:
    """Wait for the READ's notification; if it never comes, say whether the agent was pumped
    meanwhile (a stuck owner thread) or was pumped and still received nothing (lost in UCX)."""
    pumps, received = agent.pumps, poller.stats.notifs_received
    try:
        await within(asyncio.shield(wait), timeout)
    except TimeoutError:
        raise RuntimeError(
            f"the READ completed but its notification did not arrive within {timeout:g} s; meanwhile the "
            f"agent was pumped {agent.pumps - pumps} times and the process received "
            f"{poller.stats.notifs_received - received} other notifications"
        ) from None
