"""The real entry points as subprocesses: `python -m prefill_svc` / `decode_svc` on port 0,
the `generate` client command, and SIGTERM -> drain -> exit 0."""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Iterator
from typing import Any

import pytest

from hybridpd_tools.bench.local_pair import LocalPair, start_pair
from hybridpd_tools.cli import generate_cmd

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

FLAGS = ["--model", "tiny-mamba2", "--engine", "synthetic", "--num-blocks", "64", "--loop", "uvloop"]


@pytest.fixture(scope="module")
def pair() -> Iterator[LocalPair]:
    running = asyncio.run(start_pair([*FLAGS, "--tp", "2"], [*FLAGS, "--tp", "1", "--check-state"]))
    try:
        yield running
    finally:
        running.stop()


def generate(capsys: pytest.CaptureFixture[str], pair: LocalPair, *argv: str) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser()
    generate_cmd.register(parser.add_subparsers())
    args = parser.parse_args(["generate", "--decode", pair.decode.address, *argv])
    code: int = args.func(args)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_generate_json(pair: LocalPair, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = generate(capsys, pair, "--prompt", "hybrid", "--max-tokens", "6", "--json")
    assert code == 0
    result: dict[str, Any] = json.loads(out)
    assert len(result["token_ids"]) == 6 and isinstance(result["text"], str)
    assert result["prompt_token_count"] == 6
    summary = result["summary"]
    assert summary["state_verified"] is True
    assert summary["transfer"]["read_count"] == 2  # decode rank 0 reads from prefill ranks 0 and 1
    # Numbers are numbers (protobuf's JSON mapping writes 64-bit ints and durations as strings).
    assert isinstance(summary["transfer"]["total_bytes"], int) and summary["transfer"]["total_bytes"] > 0
    assert isinstance(summary["time_to_first_token"], float) and summary["time_to_first_token"] > 0


def test_generate_failure_prints_status(pair: LocalPair, capsys: pytest.CaptureFixture[str]) -> None:
    # More than decode's cache holds: refused by the service, naming the field.
    code, _, err = generate(capsys, pair, "--prompt-ids", "1,2", "--max-tokens", "1000000")
    assert code == 1
    assert err.startswith("INVALID_ARGUMENT: max_tokens")


def test_sigterm_drains_and_exits_zero(pair: LocalPair) -> None:
    assert pair.decode.proc.poll() is None and pair.prefill.proc.poll() is None
    assert pair.stop() == (0, 0)
