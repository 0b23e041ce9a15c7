"""A real DNS server on a namespace host: dnsmasq answering names from a hosts file.

`DnsServer.set(name, addresses)` rewrites the file and sends SIGHUP, on which dnsmasq re-reads it;
answers carry TTL 0 and glibc does not cache, so the next lookup sees the change. Services get
`resolv_conf` (a file naming this server) bind-mounted on their /etc/resolv.conf.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
from pathlib import Path

from hybridpd_tools.bench.netns import Host, Network


def why_no_dnsmasq() -> str | None:
    if shutil.which("dnsmasq") is None:
        return "dnsmasq is not installed (apt-get install dnsmasq-base)"
    return None


class DnsServer:
    """Authoritative for DOMAIN: a name there that the file lacks (or an AAAA for an IPv4-only
    name) gets a clean negative answer, never REFUSED (which glibc reports as a transient error)."""

    DOMAIN = "hpd.test"

    def __init__(self, network: Network, host: Host, directory: Path) -> None:
        self.host = host
        self.hosts_file = directory / "hosts"
        self.hosts_file.write_text("")
        self.resolv_conf = str(directory / "resolv.conf")
        Path(self.resolv_conf).write_text(f"nameserver {host.address}\noptions timeout:1 attempts:2\n")
        self.records: dict[str, list[str]] = {}
        self.proc = network.spawn_helper(
            host,
            [
                "dnsmasq",
                "--keep-in-foreground",
                "--no-resolv",
                "--no-hosts",
                "--no-negcache",
                "--user=root",
                f"--listen-address={host.address}",
                "--bind-interfaces",
                "--port=53",
                "--local-ttl=0",
                f"--addn-hosts={self.hosts_file}",
                f"--local=/{self.DOMAIN}/",
                "--bogus-priv",
                "--log-facility=-",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        # Answering once it has bound its socket: wait for the port to be listened on.
        deadline = time.monotonic() + 10
        while f"{host.address}:53" not in host.run("ss", "-lun"):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"dnsmasq did not start: {self.proc.stderr.read() if self.proc.stderr else ''}")
            time.sleep(0.05)

    def set(self, name: str, addresses: list[str]) -> None:
        self.records[name] = addresses
        self.hosts_file.write_text("".join(f"{a} {n}\n" for n, addrs in self.records.items() for a in addrs))
        self.proc.send_signal(signal.SIGHUP)
