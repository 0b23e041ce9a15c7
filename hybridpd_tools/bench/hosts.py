"""`bench transfer --hosts`: the same benchmark with prefill on another host, over UCX TCP.

Two namespace hosts on a private bridge (hybridpd_tools/bench/netns.py; needs root). The benchmark itself
runs on the decode host: its decode service and raw NIXL reader there, and the prefill service
and raw NIXL target started on the prefill host. Ours and raw NIXL therefore READ over the same
link, through the same TCP stack, with the same UCX settings (`UCX_ENV`, `UCX_TCP_SEGMENTS`),
the same memory and the same descriptors. `--link-rate` / `--link-delay` shape that link (netem
where the kernel has it, otherwise tbf for the rate alone); the result records the link under
"hosts" and, when shaped, every method's share of its rate (`vs_link_rate`).

What each side does while a READ is in flight, and why the comparison is fair. Over TCP, UCX
emulates the READ with messages, and UCX moves only inside NIXL calls on either side, so both
sides' pumping bounds it:

- ours: decode's owner thread posts the READ and pumps its agent every 1 ms until it is DONE;
  prefill's owner thread pumps its agent every 1 ms from the manifest until the READ's
  notification (prefill_svc/pins.py waits for it), and every 20 ms otherwise;
- raw NIXL: the target pumps all its agents from just before the READ is posted until its
  notification, and the reader polls between, both as one strategy says: a tight loop, a tight
  loop that yields the CPU, or a 1 ms sleep (raw_pumping.py). Every round runs each strategy,
  and each raw method counts with its fastest: raw is the best a plain NIXL program among these
  did on this machine in this run, a bar ours has to reach rather than a pumping we chose.
  (A tight reader loop starves the TCP stack on a few shared cores: 0.4 GB/s where the 1 ms
  sleep moved 1.1-1.3; the report lists every strategy's figure.)
"""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hybridpd_tools.bench.netns import Host, Network, why_unavailable

UCX_ENV = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "eth0", "UCX_WARN_UNUSED_ENV_VARS": "n"}
# UCX emulates a READ over TCP with messages of at most these segments: the defaults (8 KiB out,
# 64 KiB in) held raw NIXL and ours alike to ~0.7 GB/s here, 512 KiB took both past 1.5 GB/s
# (docs/performance.md). The TX size may not exceed the RX size (UCX refuses the worker).
UCX_TCP_SEGMENTS = {"UCX_TCP_TX_SEG_SIZE": "512k", "UCX_TCP_RX_SEG_SIZE": "512k"}
INSIDE_FLAG = "--inside-hosts"


def inside_launch(spec: str) -> tuple[list[str], str]:
    """From `--inside-hosts NETNS,ADDRESS`: the prefill host's launch prefix and address."""
    netns, _, address = spec.partition(",")
    host = Host("prefill", netns, address, switch="", port="")
    return host.command([]), address


def run_on_hosts(inner_args: Sequence[str], rate: str | None, delay: str | None) -> int:
    """Make the hosts, shape the link, run `hybrid-pd bench transfer INNER_ARGS` on the decode
    host (its output is this command's output), tear everything down; the inner exit code."""
    reason = why_unavailable()
    if reason is not None:
        raise RuntimeError(f"--hosts: {reason}")
    import os

    root = str(Path(__file__).resolve().parents[2])
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
    env |= UCX_ENV | UCX_TCP_SEGMENTS | {"PYTHONPATH": os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)}
    with Network.create(2) as net:
        prefill, decode = net.hosts
        link: dict[str, Any] = {"transport": "UCX tcp over a veth pair and a bridge", "rate": rate, "delay": delay}
        if rate is not None:
            link["rate_gbps"] = rate_gbps(rate)
            link["qdisc"] = prefill.shape(rate, delay or "0us")
            if link["qdisc"] != "netem":
                link["delay"] = None  # tbf shapes the rate only
        argv = [
            sys.executable,
            "-m",
            "hybridpd_tools.cli.main",
            "bench",
            "transfer",
            *inner_args,
            INSIDE_FLAG,
            f"{prefill.netns},{prefill.address}",
            "--link-note",
            _note(link),
        ]
        proc = net.spawn(decode, argv, env)
        return proc.wait()


_RATE = re.compile(r"^(\d+(?:\.\d+)?)([kmgt]?)(i?)(bit|bps)$")
_PREFIX = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}


def rate_gbps(rate: str) -> float | None:
    """A tc rate (e.g. `10gbit`, `1.5gbps`, `100mibit`) in GB/s (1e9 bytes); None if not understood.
    As in tc: `bit` is bits and `bps` bytes per second, k/m/g/t powers of 1000 (1024 with `i`)."""
    m = _RATE.match(rate.strip().lower())
    if m is None:
        return None
    number, prefix, binary, unit = m.groups()
    per_second = float(number) * float((1024 if binary else 1000) ** _PREFIX[prefix])
    return (per_second / 8 if unit == "bit" else per_second) / 1e9


def _note(link: dict[str, Any]) -> str:
    import json

    return json.dumps(link, sort_keys=True)
