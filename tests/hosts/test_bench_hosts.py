"""`hybrid-pd bench transfer --hosts` end to end: prefill and the raw NIXL target on one namespace
host, decode and the raw reader on another, a shaped link; the JSON result describes the link,
raw NIXL and ours moved the same bytes with the same descriptor set, and the raw baselines were
measured under every pumping strategy, the fastest counted (no time is asserted).
Slow (three services' worth of start-up): --run-slow."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hybridpd_tools.bench.raw_pumping import ACROSS_HOSTS
from tests.hosts.cluster import CHECKOUT

pytestmark = [pytest.mark.hosts, pytest.mark.slow, pytest.mark.timeout(300)]


def test_bench_transfer_across_hosts() -> None:
    from tests.hosts.conftest import namespaces_or_skip

    namespaces_or_skip()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "hybridpd_tools.cli.main",
            "bench",
            "transfer",
            "--hosts",
            "--link-rate",
            "10gbit",
            "--link-delay",
            "100us",
            "--model",
            "tiny-mamba2",
            "--prompt-tokens",
            "64",
            "--requests",
            "2",
            "--json",
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        timeout=280,
        cwd=CHECKOUT,
        env={"PYTHONPATH": str(CHECKOUT), "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    hosts = result["config"]["hosts"]
    assert hosts["rate"] == "10gbit" and hosts["rate_gbps"] == 1.25 and hosts["qdisc"] in ("netem", "tbf")
    assert result["descriptor_set_matches"]
    assert result["descriptors"]["ours"] == result["descriptors"]["raw_nixl"]
    total = result["bytes"]["total"]
    assert total > 0 and result["moved_bytes"] == {"ours": total, "raw_nixl": total, "raw_nixl_coalesced": total}
    assert result["gbps"] > 0 and result["raw_nixl_gbps"] > 0
    for method in ("raw_nixl", "raw_nixl_coalesced"):
        pumping = result["raw_nixl_pumping"][method]
        assert list(pumping["gbps"]) == list(ACROSS_HOSTS) and all(v > 0 for v in pumping["gbps"].values())
        assert pumping["gbps"][pumping["chosen"]] == max(pumping["gbps"].values()) == result[f"{method}_gbps"]
        assert len(result["samples_seconds"][method]) == 2
    assert set(result["vs_link_rate"]) == {"ours", "raw_nixl", "raw_nixl_coalesced"}
    assert "--hosts --link-rate 10gbit" in result["command"]
