"""The long-prompt and multi-turn workloads of `bench e2e`: their reports from recorded results
(pure), and each run end to end at tiny sizes on real services (no time is asserted)."""

from __future__ import annotations

import asyncio
import itertools
import json

import pytest

from hybridpd_tools.bench.client import Timed
from hybridpd_tools.bench.long_prompt import (
    LongPromptConfig,
    Sample,
    build_long_prompt_result,
    format_long_prompt,
    run_long_prompt,
)
from hybridpd_tools.bench.multi_turn import MultiTurnConfig, Turn, build_multi_turn_result, format_multi_turn, run_multi_turn
from hybridpd_tools.bench.repeat import RepeatConfig, format_repeat, run_repeat
from hybridpd_tools.bench.setups import SetupConfig
from prefill_svc.part_plan import part_spans
from shared.layout.page import build_engine_layout
from shared.layout.presets import TINY_PRESETS
from shared.pb.hybridpd.v1 import decode_service_pb2 as pb
from shared.rpc.proto_time import duration


def summary(prompt: int, attention: int, *, prefill: float, read: float = 0.0, engine: float = 0.0) -> pb.GenerateSummary:
    return pb.GenerateSummary(
        prefill_engine_duration=duration(engine),
        prompt_token_count=prompt,
        num_transferred_tokens=prompt - 1,
        transfer=pb.TransferStats(attention_bytes=attention, conv_bytes=10, ssm_bytes=100, total_bytes=attention + 110),
        prefill_duration=duration(prefill),
        read_duration=duration(read),
    )


def timed(ttft: float, tokens: list[int], s: pb.GenerateSummary) -> Timed:
    return Timed(sent=0.0, token_ids=tokens, first_token=ttft, last_token=ttft + 0.1, done=ttft + 0.1, summary=s)


@pytest.mark.timeout(30)
def test_long_prompt_report_pairs_the_setups_per_prompt() -> None:
    cfg = LongPromptConfig(SetupConfig("m", "hf"), prompt_lengths=(64,), requests_per_length=2)
    samples = [
        Sample(64, {"disaggregated": timed(1.25, [1, 2], summary(64, 4096, prefill=1.0, read=0.05)),
                    "colocated": timed(1.0, [1, 2], summary(64, 0, prefill=0.9))}),
        Sample(64, {"disaggregated": timed(2.0, [3, 4], summary(64, 4096, prefill=1.8, read=0.05)),
                    "colocated": timed(2.5, [3, 5], summary(64, 0, prefill=2.4))}),
    ]  # fmt: skip
    r = build_long_prompt_result(cfg, samples, "test")
    row = r["lengths"][0]
    assert row["exposed_transfer_ms"]["count"] == 2
    assert row["exposed_transfer_ms"]["median"] == pytest.approx(-125.0)  # (+250, -500) ms, paired
    assert row["exposed_minus_prefill_ms"]["median"] == pytest.approx(125.0)  # (+150, +100) ms: the prefill spread out
    assert row["read_ms"]["median"] == pytest.approx(50.0)
    assert row["bytes"] == {"attention": 4096, "conv": 10, "ssm": 100, "total": 4206}
    assert row["transferred_tokens"] == 63
    assert row["tokens_match"] == "1/2"  # the second prompt's tokens differ: counted, not hidden
    json.dumps(r)
    assert "1/2" in format_long_prompt(r)


@pytest.mark.timeout(30)
def test_long_prompt_report_sets_pipelined_against_unpipelined() -> None:
    cfg = LongPromptConfig(SetupConfig("m", "hf", prefill_chunk_tokens=16), prompt_lengths=(64,), requests_per_length=1)
    samples = [
        Sample(64, {"disaggregated": timed(1.02, [1, 2], summary(64, 4096, prefill=1.0, read=0.01)),
                    "unpipelined": timed(1.1, [1, 2], summary(64, 4096, prefill=1.0, read=0.05)),
                    "colocated": timed(1.0, [1, 2], summary(64, 0, prefill=1.0))}),
    ]  # fmt: skip
    row = build_long_prompt_result(cfg, samples, "test")["lengths"][0]
    assert row["exposed_transfer_ms"]["median"] == pytest.approx(20.0)
    assert row["unpipelined_exposed_transfer_ms"]["median"] == pytest.approx(100.0)
    assert row["hidden_share"] == pytest.approx(0.8)
    assert row["state_exposed_ms"]["median"] == pytest.approx(10.0)  # READ + digest check (none here)
    assert row["hidden_share_state"] == pytest.approx(0.8)
    assert row["unpipelined_tokens_match"] == "1/1"
    assert "80.0 %" in format_long_prompt(build_long_prompt_result(cfg, samples, "test"))
    assert row["exposed_minus_engine_ms"]["count"] == 0  # no engine times reported: no figure, not a zero


@pytest.mark.timeout(30)
def test_long_prompt_says_where_ttft_beyond_the_engine_goes() -> None:
    cfg = LongPromptConfig(SetupConfig("m", "hf", prefill_chunk_tokens=16), prompt_lengths=(64,), requests_per_length=1)
    pipelined = summary(64, 4096, prefill=1.05, read=0.002, engine=1.0)
    pipelined.prefill_digest_duration.CopyFrom(duration(0.02))
    pipelined.digest_check_duration.CopyFrom(duration(0.001))
    pipelined.first_step_engine_duration.CopyFrom(duration(0.002))
    unpipelined = summary(64, 4096, prefill=1.04, read=0.01, engine=1.0)
    unpipelined.prefill_digest_duration.CopyFrom(duration(0.03))
    unpipelined.digest_check_duration.CopyFrom(duration(0.02))
    unpipelined.first_step_engine_duration.CopyFrom(duration(0.001))
    colocated = summary(64, 0, prefill=1.0, engine=0.99)
    colocated.first_step_engine_duration.CopyFrom(duration(0.005))
    samples = [
        Sample(64, {"disaggregated": timed(1.06, [1, 2], pipelined), "unpipelined": timed(1.08, [1, 2], unpipelined),
                    "colocated": timed(1.0, [1, 2], colocated)}),
    ]  # fmt: skip
    r = build_long_prompt_result(cfg, samples, "test")
    p, u = r["lengths"][0]["where_ms"]["pipelined"], r["lengths"][0]["where_ms"]["unpipelined"]
    assert p["prefill_digest_ms"]["median"] == pytest.approx(20.0) and u["prefill_digest_ms"]["median"] == pytest.approx(30.0)
    assert p["prefill_other_ms"]["median"] == pytest.approx(30.0) and u["prefill_other_ms"]["median"] == pytest.approx(10.0)
    assert p["state_ms"]["median"] == pytest.approx(3.0) and u["state_ms"]["median"] == pytest.approx(30.0)
    assert p["decode_first_step_ms"]["median"] == pytest.approx(2.0) and u["decode_first_step_ms"]["median"] == pytest.approx(1.0)
    assert p["after_prefill_other_ms"]["median"] == pytest.approx(5.0)  # 1.06 - 1.05 - 0.003 - 0.002
    assert u["after_prefill_other_ms"]["median"] == pytest.approx(9.0)
    row = r["lengths"][0]  # minus both engines, against colocated's 1.0 - 0.99 - 0.005 = 5 ms
    assert row["exposed_minus_engines_ms"]["median"] == pytest.approx(53.0)  # 1.06 - 1.0 - 0.002 = 58 ms
    assert row["unpipelined_exposed_minus_engines_ms"]["median"] == pytest.approx(74.0)  # 1.08 - 1.0 - 0.001 = 79 ms
    assert row["hidden_share_minus_engines"] == pytest.approx(1 - 53 / 74, abs=1e-4)  # 4 significant digits
    assert "20.0 / 30.0" in format_long_prompt(r) and "3.0 / 30.0" in format_long_prompt(r)


@pytest.mark.timeout(30)
def test_long_prompt_minus_engine_takes_the_compute_spread_out_of_the_hidden_share() -> None:
    # The engines' times differ by prompt (another tenant's load): on TTFT alone the pipelined request
    # looks no better than the unpipelined one; minus each side's engine time, 4 ms against 20 ms.
    cfg = LongPromptConfig(SetupConfig("m", "hf", prefill_chunk_tokens=16), prompt_lengths=(64,), requests_per_length=1)
    samples = [
        Sample(64, {"disaggregated": timed(1.204, [1, 2], summary(64, 4096, prefill=1.2, engine=1.2)),
                    "unpipelined": timed(1.02, [1, 2], summary(64, 4096, prefill=1.0, engine=1.0)),
                    "colocated": timed(1.0, [1, 2], summary(64, 0, prefill=1.0, engine=1.0))}),
    ]  # fmt: skip
    row = build_long_prompt_result(cfg, samples, "test")["lengths"][0]
    assert row["exposed_transfer_ms"]["median"] == pytest.approx(204.0)
    assert row["hidden_share"] < 0  # the spread alone: pipelining "lost"
    assert row["exposed_minus_engine_ms"]["median"] == pytest.approx(4.0)
    assert row["unpipelined_exposed_minus_engine_ms"]["median"] == pytest.approx(20.0)
    assert row["hidden_share_minus_engine"] == pytest.approx(0.8)


@pytest.mark.timeout(30)
def test_multi_turn_report_sets_attention_bytes_against_the_new_tokens() -> None:
    cfg = MultiTurnConfig(SetupConfig("m", "hf"), turns=2, conversations=1, first_turn_tokens=64, turn_tokens=28, max_tokens=4)
    turns = [
        Turn(0, 1, 64, 64, {"disaggregated": timed(1.0, [1] * 4, summary(64, 63 * 8, prefill=0.9)),
                            "colocated": timed(1.0, [1] * 4, summary(64, 0, prefill=0.9))}),
        Turn(0, 2, 96, 32, {"disaggregated": timed(1.0, [2] * 4, summary(96, 95 * 8, prefill=0.9)),
                            "colocated": timed(1.0, [2] * 4, summary(96, 0, prefill=0.9))}),
    ]  # fmt: skip
    r = build_multi_turn_result(cfg, turns, "test")
    first, second = r["turns"]
    assert (first["new_tokens"], second["new_tokens"]) == (64, 32)
    assert first["attention_bytes_if_only_new"] == 63 * 8  # turn 1: everything is new
    assert second["attention_bytes_if_only_new"] == 32 * 8
    assert second["attention_bytes_per_new_token"] == pytest.approx(95 * 8 / 32)
    assert r["later_turns"]["reuse_would_save_share"] == pytest.approx(1 - 32 / 95, rel=1e-3)  # 4 significant digits
    assert first["tokens_match"] == second["tokens_match"] == "1/1"
    json.dumps(r)
    assert "would be saved" in format_multi_turn(r)


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_long_prompt_runs_both_setups_at_each_length() -> None:
    cfg = LongPromptConfig(
        SetupConfig("tiny-mamba2", "reference"), prompt_lengths=(48, 112), requests_per_length=1, max_tokens=3, warmup=0
    )
    r = asyncio.run(run_long_prompt(cfg, command="test", show_progress=False))
    short, long = r["lengths"]
    assert [short["prompt_tokens"], long["prompt_tokens"]] == [48, 112]
    for row, n in ((short, 48), (long, 112)):
        assert row["errors"] == [] and row["tokens_match"] == "1/1"
        assert row["transferred_tokens"] == n - 1  # SSM layers: decode computes the last token
        b = row["bytes"]
        assert b["total"] == b["attention"] + b["conv"] + b["ssm"] and b["ssm"] > 0
        assert row["ttft_ms"]["disaggregated"]["count"] == row["ttft_ms"]["colocated"]["count"] == 1
        assert row["read_ms"]["count"] == 1
    assert long["bytes"]["attention"] > short["bytes"]["attention"]  # K/V grows with the prompt
    assert long["bytes"]["ssm"] == short["bytes"]["ssm"]  # the recurrent state does not


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_long_prompt_prefill_sends_parts_of_at_least_manifest_part_tokens() -> None:
    setup = SetupConfig("tiny-mamba2", "reference", prefill_chunk_tokens=20, manifest_part_tokens=64)
    cfg = LongPromptConfig(setup, prompt_lengths=(240,), requests_per_length=1, max_tokens=3, warmup=0)
    r = asyncio.run(run_long_prompt(cfg, command="test", show_progress=False))
    row = r["lengths"][0]
    assert row["errors"] == [] and row["tokens_match"] == row["unpipelined_tokens_match"] == "1/1"
    block_size = build_engine_layout(TINY_PRESETS["tiny-mamba2"], 1).block_size
    parts = len(part_spans(239, 20, block_size, part_tokens=64))
    assert row["reads_pipelined"] == parts < len(part_spans(239, 20, block_size))  # the flag reached prefill
    assert r["config"]["manifest_part_tokens"] == 64 and "parts of at least 64" in format_long_prompt(r)


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_long_prompt_prefill_sends_the_last_chunk_in_layer_parts() -> None:
    setup = SetupConfig("tiny-mamba2", "reference", prefill_chunk_tokens=20, layer_parts=2)
    cfg = LongPromptConfig(setup, prompt_lengths=(240,), requests_per_length=1, max_tokens=3, warmup=0)
    r = asyncio.run(run_long_prompt(cfg, command="test", show_progress=False))
    row = r["lengths"][0]
    assert row["errors"] == [] and row["tokens_match"] == row["unpipelined_tokens_match"] == "1/1"
    block_size = build_engine_layout(TINY_PRESETS["tiny-mamba2"], 1).block_size
    parts = len(part_spans(239, 20, block_size)) - 1 + 2  # the last part in two: the flag reached prefill
    assert row["reads_pipelined"] == parts
    assert r["config"]["layer_parts"] == 2 and "the last chunk in 2 layer parts" in format_long_prompt(r)


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_multi_turn_extends_each_prompt_and_reads_it_all_again() -> None:
    cfg = MultiTurnConfig(
        SetupConfig("tiny-mamba2", "reference"), turns=3, conversations=1, first_turn_tokens=32, turn_tokens=16,
        max_tokens=4, warmup=0,
    )  # fmt: skip
    r = asyncio.run(run_multi_turn(cfg, command="test", show_progress=False))
    rows = r["turns"]
    assert [t["prompt_tokens"] for t in rows] == [32, 52, 72]  # + 4 answer + 16 message per turn
    assert [t["new_tokens"] for t in rows] == [32, 20, 20]
    assert [t["transferred_tokens"] for t in rows] == [31, 51, 71]  # the whole prompt, every turn
    assert all(t["errors"] == [] and t["tokens_match"] == "1/1" for t in rows)
    attention = [t["bytes"]["attention"] for t in rows]
    assert attention[0] < attention[1] < attention[2]  # no prefix reuse: grows with the prompt
    assert len({t["bytes"]["ssm"] for t in rows}) == 1 and rows[0]["bytes"]["conv"] > 0
    assert r["later_turns"]["reuse_would_save_share"] > 0


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_multi_turn_with_the_prefix_cache_and_parts_reads_parts_after_the_prefix() -> None:
    cfg = MultiTurnConfig(
        SetupConfig("tiny-mamba2", "reference", prefill_chunk_tokens=20), turns=3, conversations=1,
        first_turn_tokens=96, turn_tokens=60, max_tokens=4, warmup=0, prefix_cache_blocks=32,
    )  # fmt: skip
    r = asyncio.run(run_multi_turn(cfg, command="test", show_progress=False))
    rows = r["turns"]
    assert all(t["errors"] == [] and t["tokens_match"] == "1/1" for t in rows)
    assert rows[0]["prefix_cached_tokens"] == 0
    for prev, cur in itertools.pairwise(rows):  # decode blocks of 32 tokens: the previous prompt's full ones
        assert cur["prefix_cached_tokens"] == prev["transferred_tokens"] // 32 * 32 > 0
    assert all(t["reads"] > 1 for t in rows)  # in parts (one rank pair), after the prefix from turn 2 on
    assert "Pipelined transfer (--prefill-chunk-tokens 20)" in format_multi_turn(r)


@pytest.mark.integration
@pytest.mark.timeout(180)
def test_repeat_reads_nothing_again_with_state_checkpoints_only() -> None:
    cfg = RepeatConfig(SetupConfig("tiny-mamba2", "reference"), prompts=1, repeats=2, prompt_tokens=40, max_tokens=4, warmup=0)
    r = asyncio.run(run_repeat(cfg, command="test", show_progress=False))
    first, again = r["repeats"]
    assert all(row["errors"] == [] and row["tokens_match"] == "1/1" for row in (first, again))
    assert first["bytes"]["states"]["total"] == first["bytes"]["disaggregated"]["total"] > 0  # both READ it all
    assert first["states_state_reused"] == "0/1" and again["states_state_reused"] == "1/1"
    assert again["bytes"]["states"]["total"] == 0  # restored: nothing READ
    assert again["bytes"]["disaggregated"]["ssm"] > 0  # without checkpoints: the state READ again
    assert again["disaggregated_state_reused"] == "0/1"
    assert "restored" in format_repeat(r)
