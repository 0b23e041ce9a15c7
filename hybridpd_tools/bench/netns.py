"""Hosts apart on one machine: Linux network, PID, mount and UTS namespaces on a private bridge.

Layout (nothing is added to the machine's own network namespace):

    <prefix>sw        a network namespace holding only the bridge `br0` (the "switch")
    <prefix>h<i>      one network namespace per host: `lo` and `eth0` (a veth whose peer `p<i>`
                      is a port of br0), address 10.203.<subnet>.<10+i>/24

Every process started on a host runs in that host's network namespace and in a new PID, mount and
UTS namespace of its own, with a private tmpfs on /dev/shm and its own /proc: UCX's shared-memory
transports and cma (process_vm_readv) cannot reach a process on another host, so bytes between
hosts travel over TCP through the veths and the bridge. The prefix (`hpd-<pid>-<n>-`) keeps
parallel runs apart; `close()` kills every process and deletes every namespace, and is safe to
call twice.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import shlex
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field

SUBNET_BASE = "10.203"
_counter = itertools.count()


class NamespaceUnavailable(RuntimeError):
    """This machine cannot make namespaces (not root, no `ip`/`unshare`, no CAP_SYS_ADMIN)."""


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=10)


def why_unavailable() -> str | None:
    """None when namespaces, veths and bridges can be made here; otherwise the reason."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, veths and a bridge)"
    for tool in ("ip", "unshare", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (iproute2 / util-linux)"
    probe = f"hpd-{os.getpid()}-probe"
    try:
        _ip("netns", "add", probe)
        try:
            _ip("-n", probe, "link", "add", "br0", "type", "bridge")
            subprocess.run(
                ["ip", "netns", "exec", probe, "unshare", "--pid", "--fork", "--mount", "--uts", "--mount-proc", "true"],
                check=True,
                capture_output=True,
                timeout=10,
            )
        finally:
            subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=10)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as e:
        detail = getattr(e, "stderr", "") or e
        return f"cannot make namespaces here: {str(detail).strip()}"
    return None


@dataclass
class Host:
    """One host: its network namespace, interface and address."""

    name: str  # short name, also its hostname inside its UTS namespace
    netns: str
    address: str
    switch: str  # the switch namespace
    port: str  # its port on the bridge, in the switch namespace
    interface: str = "eth0"

    def command(self, argv: Sequence[str], *, shm_mib: int = 256, resolv_conf: str | None = None) -> list[str]:
        """`argv` run on this host: own PID, mount and UTS namespaces and a private /dev/shm
        (and, given `resolv_conf`, that file bind-mounted on /etc/resolv.conf: its own resolver).

        `--kill-child` makes the namespace's first process die with `unshare`, and with it every
        process in the PID namespace: killing the returned command's process tears the host's
        processes down."""
        resolver = f"mount --bind {shlex.quote(resolv_conf)} /etc/resolv.conf && " if resolv_conf else ""
        setup = f'mount -t tmpfs -o size={shm_mib}m hpd-shm /dev/shm && {resolver}hostname {self.name} && exec "$@"'
        return [
            "ip",
            "netns",
            "exec",
            self.netns,
            "unshare",
            "--pid",
            "--fork",
            "--mount",
            "--uts",
            "--mount-proc",
            "--kill-child=SIGKILL",
            "--",
            "sh",
            "-c",
            setup,
            "sh",
            *argv,
        ]

    def run(self, *argv: str) -> str:
        """Run a short command in this host's network namespace; returns its stdout."""
        done = subprocess.run(["ip", "netns", "exec", self.netns, *argv], check=True, capture_output=True, text=True, timeout=30)
        return done.stdout

    def link(self, up: bool) -> None:
        """Cut or restore this host's cable: its bridge port goes down, so its eth0 loses carrier.
        Nothing is reset: TCP connections through it just stop moving, as on a pulled cable."""
        _ip("-n", self.switch, "link", "set", self.port, "up" if up else "down")

    def shape(self, rate: str, delay: str) -> str:
        """Shape both directions of this host's link (eth0 and its bridge port) to `rate` (e.g.
        10gbit) with a one-way `delay` (e.g. 100us): netem where the kernel has it; otherwise a
        token bucket (tbf) for the rate alone. Returns the qdisc used ("netem" or "tbf")."""
        sides = ((self.netns, self.interface), (self.switch, self.port))
        for kind in ("netem", "tbf"):  # CONFIG_NET_SCH_NETEM is off in some kernels: the rate still applies
            qdisc = (
                ["netem", "delay", delay, "rate", rate, "limit", "100000"]
                if kind == "netem"
                else ["tbf", "rate", rate, "burst", "4mb", "latency", "20ms"]
            )
            done = [
                subprocess.run(
                    ["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", *qdisc], capture_output=True, text=True, timeout=10
                )
                for ns, dev in sides
            ]
            if all(d.returncode == 0 for d in done):
                return kind
            self.unshape()
        raise RuntimeError(f"tc: neither netem nor tbf: {done[-1].stderr.strip()}")

    def unshape(self) -> None:
        for ns, dev in ((self.netns, self.interface), (self.switch, self.port)):
            subprocess.run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], capture_output=True, timeout=10)


STALE = re.compile(r"^hpd-(\d+)-\d+-")


def remove_stale() -> None:
    """Delete namespaces left by runs whose process is gone (a SIGKILLed pytest cannot clean up)."""
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout
    for line in listing.splitlines():
        name = line.split()[0] if line.split() else ""
        match = STALE.match(name)
        if match and int(match.group(1)) != os.getpid() and not os.path.exists(f"/proc/{match.group(1)}"):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=10)


@dataclass
class Network:
    """N hosts on one private bridge; a context manager that always tears down."""

    prefix: str
    subnet: str
    hosts: list[Host] = field(default_factory=list)
    processes: list[subprocess.Popen[str]] = field(default_factory=list)

    @classmethod
    def create(cls, count: int, mtu: int = 1500) -> Network:
        remove_stale()
        n = next(_counter)
        prefix = f"hpd-{os.getpid()}-{n}-"
        # A third octet from the pid keeps parallel runs on different subnets too (each is
        # private to its own bridge anyway).
        net = cls(prefix, f"{SUBNET_BASE}.{(os.getpid() + n) % 250 + 1}")
        switch = f"{prefix}sw"
        try:
            _ip("netns", "add", switch)
            _ip("-n", switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", switch, "link", "set", "br0", "up")
            for i in range(count):
                name = f"h{i}"
                host = Host(name, f"{prefix}{name}", f"{net.subnet}.{10 + i}", switch, f"p{i}")
                _ip("netns", "add", host.netns)
                net.hosts.append(host)
                _ip(
                    "link",
                    "add",
                    "eth0",
                    "netns",
                    host.netns,
                    "mtu",
                    str(mtu),
                    "type",
                    "veth",
                    "peer",
                    "name",
                    host.port,
                    "netns",
                    switch,
                    "mtu",
                    str(mtu),
                )
                _ip("-n", switch, "link", "set", host.port, "master", "br0", "up")
                _ip("-n", host.netns, "addr", "add", f"{host.address}/24", "dev", "eth0")
                _ip("-n", host.netns, "link", "set", "eth0", "up")
                _ip("-n", host.netns, "link", "set", "lo", "up")
        except BaseException:
            net.close()
            raise
        return net

    def spawn(
        self, host: Host, argv: Sequence[str], env: dict[str, str], *, resolv_conf: str | None = None, **popen: object
    ) -> subprocess.Popen[str]:
        """Start `argv` on `host` (see Host.command); `close()` kills it."""
        command = host.command(argv, resolv_conf=resolv_conf)
        proc: subprocess.Popen[str] = subprocess.Popen(command, env=env, text=True, **popen)  # type: ignore[call-overload]
        self.processes.append(proc)
        return proc

    def spawn_helper(self, host: Host, argv: Sequence[str], **popen: object) -> subprocess.Popen[str]:
        """A helper (e.g. a DNS server) in the host's network namespace only, so the test can
        signal it directly; `close()` kills it."""
        proc: subprocess.Popen[str] = subprocess.Popen(["ip", "netns", "exec", host.netns, *argv], text=True, **popen)  # type: ignore[call-overload]
        self.processes.append(proc)
        return proc

    def close(self) -> None:
        for proc in self.processes:
            if proc.poll() is None:
                proc.kill()
        for proc in self.processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
        self.processes.clear()
        for host in self.hosts:
            subprocess.run(["ip", "netns", "del", host.netns], capture_output=True, timeout=10)
        subprocess.run(["ip", "netns", "del", f"{self.prefix}sw"], capture_output=True, timeout=10)
        self.hosts.clear()

    def __enter__(self) -> Network:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
