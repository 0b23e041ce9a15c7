"""The hf engine's service pair for integration tests: real prefill and decode apps in this
process (grpc.aio on port 0, NIXL over UCX on DRAM), each loading a checkpoint directory."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from decode_svc.app import DecodeApp
from prefill_svc.app import PrefillApp
from shared.config import parse_settings
from shared.pb.hybridpd.v1 import decode_service_pb2 as dpb
from shared.runtime.engine_host import engine_factory_for
from tests.decode_stream import generated
from tests.reuse import REUSE_OFF

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
    decode_flags: tuple[str, ...] = (),
    prefill_flags: tuple[str, ...] = (),
    check_state: bool = True,
    engine: str = "hf",
) -> AsyncIterator[tuple[PrefillApp, DecodeApp]]:
    """`engine`: hf (transformers, the oracle) or paged (the batched engine) on both sides."""
    common = [*COMMON, "--engine", engine]
    ps = parse_settings(
        "prefill", [*common, "--heartbeat-seconds", "1.0", "--model", prefill_dir, "--tp", str(p_tp), *prefill_flags], environ={}
    )
    prefill = await PrefillApp.start(ps, engine_factory_for(engine, ps))
    try:
        ds = parse_settings(
            "decode",
            [
                *common,
                "--model",
                decode_dir,
                "--tp",
                str(d_tp),
                *(["--check-state"] if check_state else []),
                "--prefill",
                f"127.0.0.1:{prefill.port}",
                *REUSE_OFF,  # the tests check decode frees every block; a test's decode_flags may turn it on
                *decode_flags,
            ],
            environ={},
        )
        decode = await DecodeApp.start(ds, engine_factory_for(engine, ds))
        try:
            if ready:
                await decode.wait_ready(30)
            yield prefill, decode
        finally:
            await asyncio.wait_for(decode.stop(), 30)
    finally:
        await asyncio.wait_for(prefill.stop(), 30)


async def generate_with(port: int, **fields: Any) -> tuple[list[int], dpb.GenerateSummary]:
    return await generated(f"127.0.0.1:{port}", dpb.GenerateRequest(**fields), timeout=60)


async def generate_ids(port: int, prompt: list[int], max_tokens: int) -> tuple[list[int], dpb.GenerateSummary]:
    return await generate_with(port, prompt_token_ids=prompt, max_tokens=max_tokens)
