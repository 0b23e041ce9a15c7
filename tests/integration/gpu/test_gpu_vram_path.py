"""The VRAM path end to end: both services' caches in CUDA memory, NIXL READs VRAM to VRAM,
every byte checked (transfer digests, and --check-state recomputing what prefill wrote).
Skipped without CUDA; scripts/gpu-check.sh runs these on a GPU machine."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc
import pytest
import torch

from decode_svc.app import DecodeApp
from prefill_svc.app import PrefillApp
from shared.config import parse_settings
from shared.pb.hybridpd.v1 import decode_service_pb2 as dpb
from shared.pb.hybridpd.v1 import decode_service_pb2_grpc as dpb_grpc
from shared.runtime.engine_host import engine_factory_for

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.integration,
    pytest.mark.asyncio,
    pytest.mark.timeout(240),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the VRAM path)"),
]

COMMON = ["--device", "cuda", "--port", "0", "--host", "127.0.0.1", "--loop", "asyncio", "--log-level", "WARNING"]


async def _round_trip(engine: str, model: str, num_blocks: int, p_tp: int, d_tp: int, prompts: list[list[int]]) -> None:
    flags = [*COMMON, "--engine", engine, "--model", model, "--num-blocks", str(num_blocks)]
    ps = parse_settings("prefill", [*flags, "--tp", str(p_tp)], environ={})
    prefill = await PrefillApp.start(ps, engine_factory_for(engine, ps))
    try:
        ds = parse_settings(
            "decode", [*flags, "--tp", str(d_tp), "--check-state", "--prefill", f"127.0.0.1:{prefill.port}"], environ={}
        )
        decode = await DecodeApp.start(ds, engine_factory_for(engine, ds))
        try:
            await decode.wait_ready(60)
            assert decode.host.caches[0].device.type == "cuda"
            async with grpc.aio.insecure_channel(f"127.0.0.1:{decode.port}") as channel:
                stub = dpb_grpc.DecodeServiceStub(channel)
                for prompt in prompts:
                    summary = None
                    request = dpb.GenerateRequest(prompt_token_ids=prompt, max_tokens=8, ignore_eos=True)
                    async for reply in stub.Generate(request, timeout=120):
                        if reply.HasField("summary"):
                            summary = reply.summary
                    assert summary is not None and summary.generated_token_count == 8
                    assert summary.digests_verified and summary.state_verified  # every byte, two ways
                    assert summary.transfer.total_bytes > 0
        finally:
            await asyncio.wait_for(decode.stop(), 60)
    finally:
        await asyncio.wait_for(prefill.stop(), 60)


async def test_synthetic_engine_moves_real_model_state_vram_to_vram() -> None:
    await _round_trip("synthetic", "nemotron-3-nano-30b-a3b", 8, 2, 4, [list(range(1, 300)), list(range(5, 1030))])


async def test_hf_engine_vram_to_vram_equals_its_colocated_run(hf_checkpoint: Callable[[str], str]) -> None:
    await _round_trip("hf", hf_checkpoint("qwen3_5"), 32, 1, 2, [[7, 8, 9, 10, 11], [(5 * i) % 300 + 4 for i in range(70)]])
