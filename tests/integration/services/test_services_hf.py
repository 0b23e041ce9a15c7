"""`--engine hf` through the real services (today's N-1 protocol): real grpc.aio servers on port
0, real NIXL READs over UCX on DRAM, a tiny transformers checkpoint loaded from disk."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import grpc
import pytest

from decode_svc.app import DecodeApp
from prefill_svc.app import PrefillApp
from shared.config import parse_settings
from shared.engine.hf.checkpoint import HfCheckpoint
from shared.engine.hf.colocated import colocated_generate
from shared.engine.hf.tiny_checkpoints import build_checkpoint
from shared.pb.hybridpd.v1 import decode_service_pb2 as dpb
from shared.pb.hybridpd.v1 import decode_service_pb2_grpc as dpb_grpc
from shared.runtime.engine_host import engine_factory_for

pytestmark = [pytest.mark.integration, pytest.mark.asyncio, pytest.mark.timeout(120)]

COMMON = [
    "--engine",
    "hf",
    "--num-blocks",
    "32",
    "--port",
    "0",
    "--host",
    "127.0.0.1",
    "--loop",
    "asyncio",
    "--log-level",
    "WARNING",
]


@asynccontextmanager
async def hf_pair(
    prefill_dir: str,
    decode_dir: str,
    p_tp: int,
    d_tp: int,
    *,
    ready: bool = True,
) -> AsyncIterator[tuple[PrefillApp, DecodeApp]]:
    ps = parse_settings("prefill", [*COMMON, "--heartbeat-seconds", "1.0", "--model", prefill_dir, "--tp", str(p_tp)], environ={})
    prefill = await PrefillApp.start(ps, engine_factory_for("hf", ps))
    try:
        ds = parse_settings(
            "decode",
            [*COMMON, "--model", decode_dir, "--tp", str(d_tp), "--check-state", "--prefill", f"127.0.0.1:{prefill.port}"],
            environ={},
        )
        decode = await DecodeApp.start(ds, engine_factory_for("hf", ds))
        try:
            if ready:
                await decode.wait_ready(30)
            yield prefill, decode
        finally:
            await asyncio.wait_for(decode.stop(), 30)
    finally:
        await asyncio.wait_for(prefill.stop(), 30)


async def _generate(port: int, prompt: list[int], max_tokens: int) -> tuple[list[int], dpb.GenerateSummary]:
    ids: list[int] = []
    summary = dpb.GenerateSummary()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = dpb_grpc.DecodeServiceStub(channel).Generate(
            dpb.GenerateRequest(prompt_token_ids=prompt, max_tokens=max_tokens), timeout=60
        )
        async for reply in call:
            if reply.HasField("chunk"):
                ids.extend(reply.chunk.token_ids)
            else:
                summary = reply.summary
    return ids, summary


async def test_hf_pair_equals_colocated_and_pairs_across_directory_names(
    hf_checkpoint: Callable[[str], str], tmp_path: Path
) -> None:
    original = hf_checkpoint("qwen3_5")
    renamed = str(tmp_path / "a-different-name")
    shutil.copytree(original, renamed)  # same config and weights elsewhere: the same model
    ckpt = HfCheckpoint(original, dtype="fp32")
    async with hf_pair(original, renamed, 2, 4) as (prefill, decode):
        assert prefill.host.message.model.fingerprint == decode.host.message.model.fingerprint
        block = decode.host.layout.block_size
        for prompt in ([42], [7, 8, 9, 10, 11], [(5 * i) % 150 + 4 for i in range(block + 1)]):
            ids, summary = await _generate(decode.port, prompt, block // 2 + 3)
            # Off the event loop: the services in this process keep their heartbeats meanwhile.
            want = (
                await asyncio.to_thread(colocated_generate, ckpt, prompt, block // 2 + 3, boundary="n-1", stop_at_eos=False)
            ).token_ids
            assert ids == want, prompt
            assert summary.state_verified
            assert summary.prompt_token_count == len(prompt)


async def test_different_weights_are_refused_naming_the_fingerprint(hf_checkpoint: Callable[[str], str], tmp_path: Path) -> None:
    other = build_checkpoint("jamba", str(tmp_path / "jamba"), seed=1)  # same config, other weights
    async with (
        hf_pair(hf_checkpoint("jamba"), other, 1, 1, ready=False) as (_, decode),
        grpc.aio.insecure_channel(f"127.0.0.1:{decode.port}") as channel,
    ):
        stub = dpb_grpc.DecodeServiceStub(channel)
        for _ in range(300):
            status = (await stub.GetLayout(dpb.GetLayoutRequest(), timeout=5)).peers[0]
            if status.state == dpb.PEER_STATE_FAILED:
                break
            await asyncio.sleep(0.02)
    assert status.state == dpb.PEER_STATE_FAILED
    assert "FAILED_PRECONDITION" in status.last_error and "model.fingerprint" in status.last_error
    assert "model.name" not in status.last_error  # the same config: only the weights differ
