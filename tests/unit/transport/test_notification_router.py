from __future__ import annotations

import asyncio

import pytest

from shared.transport.notifications import NotificationRouter

pytestmark = pytest.mark.timeout(10)


@pytest.mark.asyncio
async def test_a_wait_resolves_after_its_count_with_the_senders() -> None:
    router = NotificationRouter()
    waiting = router.expect("p-r0", b"req-1", 2)
    assert router.pending("p-r0") == 1
    router.dispatch("p-r0", {"d-r0": [b"req-1"]})
    assert not waiting.done()
    router.dispatch("p-r0", {"d-r1": [b"req-1"]})
    assert await waiting == ["d-r0", "d-r1"]
    assert router.pending("p-r0") == 0
    assert router.received == 2 and router.unknown == 0


@pytest.mark.asyncio
async def test_keys_are_per_local_agent_and_strangers_are_counted() -> None:
    seen: list[tuple[str, str, bytes]] = []
    router = NotificationRouter(on_unknown=lambda *args: seen.append(args))
    on_r0 = router.expect("p-r0", b"req-1", 1)
    router.dispatch("p-r1", {"d-r0": [b"req-1"]})  # same key, other agent
    router.dispatch("p-r0", {"d-r0": [b"req-9"]})
    assert not on_r0.done()
    assert router.unknown == 2
    assert seen == [("p-r1", "d-r0", b"req-1"), ("p-r0", "d-r0", b"req-9")]


@pytest.mark.asyncio
async def test_extra_and_late_messages_count_as_unknown() -> None:
    router = NotificationRouter()
    waiting = router.expect("p-r0", b"req-1", 1)
    router.dispatch("p-r0", {"d-r0": [b"req-1", b"req-1"]})
    assert await waiting == ["d-r0"] and router.unknown == 1
    router.dispatch("p-r0", {"d-r0": [b"req-1"]})
    assert router.unknown == 2


@pytest.mark.asyncio
async def test_cancelled_waits_are_forgotten() -> None:
    router = NotificationRouter()
    waiting = router.expect("p-r0", b"req-1", 1)
    waiting.cancel()
    await asyncio.sleep(0)
    assert router.pending("p-r0") == 0
    router.dispatch("p-r0", {"d-r0": [b"req-1"]})
    assert router.unknown == 1
    again = router.expect("p-r0", b"req-1", 1)  # the key can be awaited again
    router.dispatch("p-r0", {"d-r0": [b"req-1"]})
    assert await again == ["d-r0"]


@pytest.mark.asyncio
async def test_a_key_is_awaited_once_at_a_time_with_a_positive_count() -> None:
    router = NotificationRouter()
    router.expect("p-r0", b"req-1", 1)
    with pytest.raises(ValueError, match="already waiting"):
        router.expect("p-r0", b"req-1", 1)
    with pytest.raises(ValueError, match="count"):
        router.expect("p-r0", b"req-2", 0)
