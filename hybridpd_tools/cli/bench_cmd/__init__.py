"""`hybrid-pd bench`: measurements, each against a baseline measured in the same run.

  transfer   our READ path (real services, synthetic engine at real-model sizes) against a raw
             NIXL READ of the identical descriptors, a raw NIXL READ of the same bytes with one
             descriptor per region, and a single-threaded memcpy of the same bytes
  control    control-plane cost of one request with a tiny state (median and p99)
  e2e        TTFT, inter-token latency and tokens/s, disaggregated vs colocated, per concurrency
             (--workload long-prompt: per prompt length; --workload multi-turn: per conversation turn)
  descids    micro-benchmark of per-request descriptor ids (read_indices) for 100k blocks

Tables go to stdout, progress to stderr; --json prints one JSON object instead (a `schema` key
names its shape). Every flag can also come from the environment: HYBRID_PD_<FLAG>. Exit code 0
when the benchmark ran (targets met or not: they are reported, not enforced), 1 when it could
not run, 2 for invalid arguments.
"""

from __future__ import annotations

import argparse
from typing import Any

from hybridpd_tools.cli.bench_cmd import control, descids, e2e_flags, transfer

DESCRIPTION = __doc__


def register(subparsers: Any) -> None:
    bench = subparsers.add_parser(
        "bench", help="benchmarks: transfer, control, e2e, descids", description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    sub = bench.add_subparsers(dest="bench_command", metavar="BENCHMARK", required=True)
    transfer.add_parser(sub)
    control.add_parser(sub)
    e2e_flags.add_parser(sub)
    descids.add_parser(sub)
