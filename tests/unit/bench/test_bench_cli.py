"""`hybrid-pd bench`: subcommands, flags, JSON output of the pure micro-benchmark."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from hybridpd_tools.bench.descids import SCHEMA as DESCIDS_SCHEMA
from hybridpd_tools.bench.e2e import parse_levels
from hybridpd_tools.bench.raw_memory import rank_device, region_buffer
from hybridpd_tools.cli import bench_cmd
from hybridpd_tools.cli.bench_cmd import e2e as bench_e2e
from hybridpd_tools.cli.bench_cmd.running import command_line

pytestmark = pytest.mark.timeout(60)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hybrid-pd")
    bench_cmd.register(p.add_subparsers(dest="command", required=True))
    return p


def test_every_benchmark_has_a_handler_and_defaults() -> None:
    p = parser()
    for name in ("transfer", "control", "e2e", "descids"):
        args = p.parse_args(["bench", name])
        assert callable(args.func)
    t = p.parse_args(
        ["bench", "transfer", "--model", "qwen3.5-0.8b", "--prefill-tp", "2", "--decode-tp", "4", "--prompt-tokens", "512"]
    )
    assert (t.model, t.prefill_tp, t.decode_tp, t.prompt_tokens, t.requests) == ("qwen3.5-0.8b", 2, 4, 512, 10)
    e = p.parse_args(["bench", "e2e", "--concurrency", "1,4,16"])
    assert e.concurrency == (1, 4, 16)
    assert p.parse_args(["bench", "e2e"]).concurrency == (1, 2, 4, 8)


def test_env_gives_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HYBRID_PD_PROMPT_TOKENS", "333")
    monkeypatch.setenv("HYBRID_PD_CONCURRENCY", "2,8")
    p = parser()
    assert p.parse_args(["bench", "transfer"]).prompt_tokens == 333
    assert p.parse_args(["bench", "transfer", "--prompt-tokens", "7"]).prompt_tokens == 7  # the flag wins
    assert p.parse_args(["bench", "e2e"]).concurrency == (2, 8)


def test_huge_pages_take_the_services_spellings(monkeypatch: pytest.MonkeyPatch) -> None:
    p = parser()
    assert p.parse_args(["bench", "transfer"]).huge_pages == "on"
    assert p.parse_args(["bench", "transfer", "--huge-pages", "false"]).huge_pages == "off"
    monkeypatch.setenv("HYBRID_PD_HUGE_PAGES", "0")  # the services' variable, as they read it
    assert parser().parse_args(["bench", "transfer"]).huge_pages == "off"
    monkeypatch.setenv("HYBRID_PD_HUGE_PAGES", "true")
    assert parser().parse_args(["bench", "transfer"]).huge_pages == "on"


@pytest.mark.parametrize(
    "bad",
    [
        ["e2e", "--concurrency", "0,2"],
        ["e2e", "--concurrency", "2,2"],
        ["e2e", "--prompt-lengths", "8192,0"],
        ["e2e", "--prompt-lengths", "8k"],
        ["e2e", "--workload", "chat"],
        ["e2e", "--turns", "0"],
        ["e2e", "--hf-size", "huge"],
        ["transfer", "--requests", "0"],
        ["transfer", "--huge-pages", "maybe"],
        ["control", "--breakdown", "--separate-processes"],  # the breakdown needs both in one process
    ],
)
def test_invalid_values_exit_2(bad: list[str]) -> None:
    with pytest.raises(SystemExit) as e:
        parser().parse_args(["bench", *bad])
    assert e.value.code == 2


def test_parse_levels() -> None:
    assert parse_levels("1, 2 4") == (1, 2, 4)
    with pytest.raises(ValueError):
        parse_levels("")


def test_e2e_workloads_pick_their_engine_and_model() -> None:
    p = parser()
    default = p.parse_args(["bench", "e2e"])
    assert default.workload == "concurrency" and default.engine is None and default.model is None
    bench_e2e._engine_and_model(default)
    assert (default.engine, default.model) == ("reference", "tiny-mamba2")
    long = p.parse_args(["bench", "e2e", "--workload", "long-prompt", "--model", "CKPT"])
    assert long.prompt_lengths == (8192, 16384, 32768) and long.requests_per_length == 2
    bench_e2e._engine_and_model(long)
    assert (long.engine, long.model) == ("hf", "CKPT")  # a given model is kept
    chat = p.parse_args(["bench", "e2e", "--workload", "multi-turn", "--engine", "reference", "--prompt-lengths", "64,128"])
    assert (chat.turns, chat.conversations, chat.first_turn_tokens, chat.turn_tokens) == (4, 2, 2048, 256)
    assert chat.prompt_lengths == (64, 128)
    bench_e2e._engine_and_model(chat)
    assert (chat.engine, chat.model) == ("reference", "tiny-mamba2")
    assert command_line("e2e", chat, bench_e2e.MULTI_TURN_FLAGS).startswith(
        "hybrid-pd bench e2e --workload multi-turn --model tiny-mamba2 --engine reference --turns 4"
    )


def test_descids_json(capsys: pytest.CaptureFixture[str]) -> None:
    args = parser().parse_args(["bench", "descids", "--model", "tiny-gdn", "--blocks", "300", "--repeat", "2", "--json"])
    assert args.func(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["schema"] == DESCIDS_SCHEMA
    assert out["ids_per_side"] > 300
    for key in ("wall_ms", "cpu_ms", "ns_per_id", "target_ms", "met", "command"):
        assert key in out
    assert out["command"].startswith("hybrid-pd bench descids --model tiny-gdn --blocks 300")


def test_a_failing_benchmark_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    args = parser().parse_args(["bench", "descids", "--model", "no-such-model", "--repeat", "1"])
    assert args.func(args) == 1
    assert "no-such-model" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_transfer_on_cuda_without_a_gpu_exits_2_saying_why(capsys: pytest.CaptureFixture[str]) -> None:
    args = parser().parse_args(["bench", "transfer", "--device", "cuda", "--no-progress"])
    assert args.func(args) == 2
    assert "--device cuda: no usable CUDA device here" in capsys.readouterr().err


def test_raw_memory_places_rank_r_on_its_gpu() -> None:
    assert rank_device("cuda", 3) == torch.device("cuda:3") and rank_device("cpu", 3) == torch.device("cpu")
    with pytest.raises(ValueError, match="device must be one of cpu, cuda"):
        rank_device("tpu", 0)
    assert region_buffer(4096, "cpu", 0, huge_pages=False).count_nonzero() == 0
