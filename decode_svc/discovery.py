"""Prefill peers from `--prefill` names: every address a name resolves to is one prefill engine.

A Kubernetes headless Service resolves to one address per ready pod, so re-resolving it every
`--discovery-seconds` follows the pool as it scales: an address that appears becomes a new peer
(handshake, link, session), one that disappears is drained (no new requests; those in flight
finish) and dropped. An IP literal stays as given. A name that resolves to IPv4 and IPv6 addresses
uses the IPv4 ones only, so a dual-stack pod is one peer, not two. A lookup that fails for a
transient reason (resolver down, timeout) keeps the last answer; a name that does not exist (no
pod ready) has no addresses.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from typing import Protocol

log = logging.getLogger(__name__)

# Failures of the name itself (NXDOMAIN, no address): the name really has no address now.
_NO_ADDRESS = {socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)}


class PeerSet(Protocol):
    """What discovery drives (decode_svc/prefill_peer.py's PrefillPeers)."""

    def targets(self) -> set[str]: ...

    def add(self, target: str, server_name: str | None) -> None: ...

    def retire(self, target: str) -> None: ...


def split_target(target: str) -> tuple[str, int]:
    host, _, port = target.rpartition(":")
    return host.strip("[]"), int(port)


def join_target(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def is_literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


class TransientLookupError(Exception):
    pass


async def resolve(target: str) -> set[str]:
    """Every `ip:port` the target's host names (the target itself for an IP literal)."""
    host, port = split_target(target)
    if is_literal(host):
        return {join_target(host, port)}
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        if e.errno in _NO_ADDRESS:
            return set()
        raise TransientLookupError(f"{host}: {e}") from e
    v4 = {str(info[4][0]) for info in infos if info[0] == socket.AF_INET}
    v6 = {str(info[4][0]) for info in infos if info[0] == socket.AF_INET6}
    return {join_target(h, port) for h in (v4 or v6)}


class Discovery:
    """Keeps a PeerSet equal to what the configured targets resolve to."""

    def __init__(self, configured: tuple[str, ...], peers: PeerSet, interval: float) -> None:
        self.configured = configured
        self.peers = peers
        self.interval = interval
        self.last: dict[str, set[str]] = {t: set() for t in configured}
        self._task: asyncio.Task[None] | None = None

    @property
    def dynamic(self) -> bool:
        """True when some target is a name (IP literals never change)."""
        return any(not is_literal(split_target(t)[0]) for t in self.configured)

    async def refresh(self) -> None:
        """Resolve every target once and add / retire peers to match."""
        names: dict[str, str | None] = {}  # address -> the name it came from (TLS checks that name)
        for target in self.configured:
            try:
                self.last[target] = await resolve(target)
            except TransientLookupError as e:
                log.warning("prefill discovery: %s; keeping the last answer %s", e, sorted(self.last[target]) or "(none)")
            host = split_target(target)[0]
            for address in self.last[target]:
                names.setdefault(address, None if is_literal(host) else host)
        current = self.peers.targets()
        for address in sorted(set(names) - current):
            log.info("prefill discovery: %s appeared (%s)", address, names[address] or "as configured")
            self.peers.add(address, names[address])
        for address in sorted(current - set(names)):
            log.info("prefill discovery: %s vanished; draining it", address)
            self.peers.retire(address)

    async def start(self) -> None:
        """The first answer now; then a refresh every interval when some target is a name."""
        await self.refresh()
        if self.interval > 0 and self.dynamic:
            self._task = asyncio.ensure_future(self._loop())

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.refresh()
            except Exception:  # a bug must not end discovery: log and try again next round
                log.exception("prefill discovery: refresh failed")

    async def aclose(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
