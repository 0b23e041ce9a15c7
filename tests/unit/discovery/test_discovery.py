"""decode_svc/discovery.py against the machine's real resolver (/etc/hosts names) and a recording
peer set: what appears is added once, what vanishes is retired once, literals stay as given."""

from __future__ import annotations

import pytest

from decode_svc import discovery
from decode_svc.discovery import Discovery, TransientLookupError, join_target, resolve, split_target


class Recorder:
    """Test-only stand-in for PrefillPeers: records the calls discovery makes."""

    def __init__(self) -> None:
        self.current: set[str] = set()
        self.calls: list[tuple[str, str, str | None]] = []

    def targets(self) -> set[str]:
        return set(self.current)

    def add(self, target: str, server_name: str | None) -> None:
        self.current.add(target)
        self.calls.append(("add", target, server_name))

    def retire(self, target: str) -> None:
        self.current.discard(target)
        self.calls.append(("retire", target, None))


def test_targets_split_and_join_ipv6() -> None:
    assert split_target("[::1]:50051") == ("::1", 50051)
    assert join_target("::1", 50051) == "[::1]:50051"
    assert split_target("prefill.ns.svc:7") == ("prefill.ns.svc", 7)


@pytest.mark.asyncio
async def test_literals_resolve_to_themselves_and_names_to_ipv4_first() -> None:
    assert await resolve("10.1.2.3:5") == {"10.1.2.3:5"}
    assert await resolve("[::1]:5") == {"[::1]:5"}
    # localhost has 127.0.0.1 (and often ::1): one family only, so one peer per engine.
    assert await resolve("localhost:5") == {"127.0.0.1:5"}


@pytest.mark.asyncio
async def test_refresh_adds_and_retires_to_match(monkeypatch: pytest.MonkeyPatch) -> None:
    answers = {"pool.test": {"10.0.0.1:9", "10.0.0.2:9"}}

    async def fake_resolve(target: str) -> set[str]:  # the name's answer, as a DNS server would change it
        if target == "10.9.9.9:9":
            return {target}
        answer = answers["pool.test"]
        if answer is None:
            raise TransientLookupError("pool.test: resolver down")
        return set(answer)

    monkeypatch.setattr(discovery, "resolve", fake_resolve)
    peers = Recorder()
    d = Discovery(("pool.test:9", "10.9.9.9:9"), peers, interval=1.0)
    assert d.dynamic
    await d.refresh()
    assert sorted(peers.calls) == [
        ("add", "10.0.0.1:9", "pool.test"),
        ("add", "10.0.0.2:9", "pool.test"),
        ("add", "10.9.9.9:9", None),
    ]
    peers.calls.clear()
    await d.refresh()
    assert peers.calls == []  # nothing changed, nothing done
    answers["pool.test"] = {"10.0.0.2:9", "10.0.0.3:9"}
    await d.refresh()
    assert peers.calls == [("add", "10.0.0.3:9", "pool.test"), ("retire", "10.0.0.1:9", None)]
    peers.calls.clear()
    answers["pool.test"] = None  # type: ignore[assignment]
    await d.refresh()
    assert peers.calls == []  # a transient failure keeps the last answer
    answers["pool.test"] = set()
    await d.refresh()
    assert sorted(peers.calls) == [("retire", "10.0.0.2:9", None), ("retire", "10.0.0.3:9", None)]
    assert peers.current == {"10.9.9.9:9"}


def test_literals_only_need_no_refresh_loop() -> None:
    assert not Discovery(("127.0.0.1:1", "[::1]:2"), Recorder(), interval=1.0).dynamic
