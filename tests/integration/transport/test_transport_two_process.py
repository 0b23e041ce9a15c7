"""Real NIXL READs between this process (initiator) and a target rank in a subprocess."""

from __future__ import annotations

import asyncio
import itertools
import signal
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import pytest
import torch

from shared.transport.errors import PeerAlreadyKnown, PeerDisconnected, TransferFailed, TransferTimedOut
from tests.integration.transport import harness

pytestmark = [pytest.mark.integration, pytest.mark.timeout(30)]

Spawn = Callable[..., Awaitable[Any]]
NUM_BLOCKS, PAGE = 256, 4096


def expected_blocks(seed: int, num_blocks: int = NUM_BLOCKS, page_bytes: int = PAGE) -> torch.Tensor:
    blocks: torch.Tensor = harness.expected_cache(seed, num_blocks, page_bytes).blocks(0)
    return blocks


async def wait_released(initiator: Any, timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while initiator.agent.live_xfers and time.monotonic() < end:
        await asyncio.sleep(0.01)
    assert initiator.agent.live_xfers == 0, "the READ handle was not released"


@pytest.mark.asyncio
async def test_contiguous_and_scattered_reads_move_exact_bytes_and_notify_the_target(
    spawn_target: Spawn, make_initiator: Spawn
) -> None:
    target = await spawn_target(seed=7)
    initiator = await make_initiator()
    name, local, remote = await initiator.connect(target)
    source = expected_blocks(7)
    dest = initiator.cache.blocks(0)

    await target.expect("req-contiguous")
    await target.expect("req-scattered")
    result = await initiator.poller.read(
        initiator.agent, local, np.arange(0, 32), remote, np.arange(100, 132), b"req-contiguous", timeout=5
    )
    assert result.peer == name and result.nbytes == 32 * PAGE
    assert torch.equal(dest[0:32], source[100:132])

    rng = np.random.default_rng(0)
    remote_ids = rng.permutation(NUM_BLOCKS)[:64]
    local_ids = rng.permutation(np.arange(64, NUM_BLOCKS))[:64]
    await initiator.poller.read(initiator.agent, local, local_ids, remote, remote_ids, b"req-scattered", timeout=5)
    assert torch.equal(dest[local_ids], source[remote_ids])
    # Negative controls: the pattern tells blocks apart, and untouched blocks stayed zero.
    assert not torch.equal(dest[local_ids], source[np.roll(remote_ids, 1)])
    untouched = np.setdiff1d(np.arange(32, NUM_BLOCKS), local_ids)
    assert int(dest[untouched].count_nonzero()) == 0

    resolved = [await target.next_line(), await target.next_line()]
    assert sorted(line["resolved"] for line in resolved) == ["req-contiguous", "req-scattered"]
    assert all(line["senders"] == [initiator.agent.name] for line in resolved)
    stats = initiator.poller.stats
    assert stats.reads_done == 2 and stats.bytes_read == 96 * PAGE and stats.reads_failed == 0


@pytest.mark.faults
@pytest.mark.asyncio
async def test_read_from_a_killed_peer_fails_with_a_clear_error(spawn_target: Spawn, make_initiator: Spawn) -> None:
    target = await spawn_target()
    initiator = await make_initiator()
    name, local, remote = await initiator.connect(target)
    await initiator.poller.read(initiator.agent, local, np.arange(8), remote, np.arange(8), b"warm", timeout=5)

    target.kill()
    started = time.monotonic()
    with pytest.raises(TransferFailed) as failure:
        await initiator.poller.read(initiator.agent, local, np.arange(8), remote, np.arange(8), b"dead", timeout=5)
    assert time.monotonic() - started < 5, "the dead peer was only noticed by the deadline"
    assert failure.value.peer == name
    assert name in str(failure.value) and "nixlRemoteDisconnectError" in str(failure.value)
    assert isinstance(failure.value, PeerDisconnected)  # typed, not matched by name
    await wait_released(initiator)
    assert initiator.poller.in_flight == 0


@pytest.mark.faults
@pytest.mark.asyncio
async def test_read_from_a_frozen_peer_ends_at_its_deadline_and_releases_the_handle(
    spawn_target: Spawn, make_initiator: Spawn
) -> None:
    target = await spawn_target()
    initiator = await make_initiator()
    # Frozen before the connection is wired up: the READ can never complete.
    target.signal(signal.SIGSTOP)
    name, local, remote = await initiator.connect(target)
    started = time.monotonic()
    with pytest.raises(TransferTimedOut) as timeout:
        await initiator.poller.read(initiator.agent, local, np.arange(8), remote, np.arange(8), b"frozen", timeout=1.5)
    elapsed = time.monotonic() - started
    assert 1.4 < elapsed < 8  # never before the deadline; the upper bound only catches a hang
    assert timeout.value.peer == name and name in str(timeout.value)
    await wait_released(initiator)
    assert initiator.poller.in_flight == 0 and initiator.poller.stats.reads_timed_out == 1


@pytest.mark.faults
@pytest.mark.asyncio
async def test_restarted_peer_is_removed_readded_and_read_again(spawn_target: Spawn, make_initiator: Spawn) -> None:
    # Same engine id, rank and incarnation: the restarted rank reuses the agent name.
    first, restarted = await asyncio.gather(
        spawn_target(engine_id="prefill", incarnation="fixed", seed=1),
        spawn_target(engine_id="prefill", incarnation="fixed", seed=2),
    )
    assert first.name == restarted.name
    initiator = await make_initiator()
    name, local, old_remote = await initiator.connect(first)
    await initiator.poller.read(initiator.agent, local, np.arange(16), old_remote, np.arange(16), b"a", timeout=5)
    assert torch.equal(initiator.cache.blocks(0)[:16], expected_blocks(1)[:16])
    first.kill()

    with pytest.raises(PeerAlreadyKnown):
        await initiator.agent.add_remote(restarted.metadata)
    await initiator.agent.remove_remote(name)
    assert await initiator.agent.add_remote(restarted.metadata) == name
    # Lists prepared against the old incarnation are refused, not read from.
    with pytest.raises(TransferFailed):
        await initiator.poller.read(initiator.agent, local, np.arange(16), old_remote, np.arange(16), b"b", timeout=5)
    remote = await initiator.agent.prep_remote(name, restarted.descs(NUM_BLOCKS, PAGE), restarted.place)
    await initiator.poller.read(initiator.agent, local, np.arange(16), remote, np.arange(16), b"c", timeout=5)
    got = initiator.cache.blocks(0)[:16]
    assert torch.equal(got, expected_blocks(2)[:16])
    assert not torch.equal(got, expected_blocks(1)[:16])


@pytest.mark.asyncio
async def test_event_loop_keeps_ticking_during_a_256_mib_read(
    spawn_target: Spawn, make_initiator: Spawn, record_property: Callable[[str, object], None]
) -> None:
    blocks, page = 64, 4 << 20  # 256 MiB
    target = await spawn_target(num_blocks=blocks, page_bytes=page, seed=3)
    initiator = await make_initiator(num_blocks=blocks, page_bytes=page)
    _, local, remote = await initiator.connect(target)
    await initiator.poller.read(initiator.agent, local, [0], remote, [0], b"wire-up", timeout=5)

    ticks: list[float] = []
    reading = True

    async def ticker() -> None:
        while reading:
            ticks.append(time.perf_counter())
            await asyncio.sleep(0.001)

    ticking = asyncio.ensure_future(ticker())
    await asyncio.sleep(0.01)
    started = time.perf_counter()
    result = await initiator.poller.read(initiator.agent, local, np.arange(blocks), remote, np.arange(blocks), b"big", timeout=10)
    finished = time.perf_counter()
    reading = False
    await ticking

    during = [t for t in ticks if started <= t <= finished]
    window = [started, *during, finished]
    max_gap = max(b - a for a, b in itertools.pairwise(window))
    gbps = result.nbytes / (finished - started) / 1e9
    record_property("max_loop_gap_ms", round(max_gap * 1e3, 2))
    record_property("read_gb_per_s", round(gbps, 2))
    print(f"256 MiB READ: {finished - started:.3f} s, {gbps:.2f} GB/s, {len(during)} ticks, max gap {max_gap * 1e3:.1f} ms")
    assert result.nbytes == 256 << 20
    assert len(during) >= 3, f"the event loop ticked {len(during)} times during the READ"
    got = initiator.cache.regions[0].view(torch.int64)
    want = expected_blocks(3, blocks, page).reshape(-1).view(torch.int64)
    assert torch.equal(got, want)
