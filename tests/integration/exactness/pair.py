"""In-process service pairs for exactness tests: real grpc.aio servers on port 0, real NIXL."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import grpc
import pytest

from decode_svc.app import DecodeApp
from decode_svc.part_reads import PartReads
from decode_svc.reader import ReadStats
from prefill_svc.app import PrefillApp
from shared.cache.manifest import Manifest
from shared.config import parse_settings
from shared.pb.hybridpd.v1 import decode_service_pb2 as pb
from shared.pb.hybridpd.v1 import decode_service_pb2_grpc as pb_grpc
from shared.runtime.engine_host import EngineFactory, engine_factory_for
from tests.decode_stream import stream
from tests.reuse import REUSE_OFF
from tests.waiting import until


@dataclass
class Generated:
    token_ids: list[int]
    summary: pb.GenerateSummary


@dataclass
class RunningPair:
    prefill: PrefillApp
    decode: DecodeApp
    stub: pb_grpc.DecodeServiceStub

    async def generate(self, prompt_ids: Sequence[int], max_tokens: int, request_id: str = "") -> Generated:
        request = pb.GenerateRequest(prompt_token_ids=list(prompt_ids), max_tokens=max_tokens, request_id=request_id)
        got = await stream(self.stub, request, timeout=120)
        return Generated(got.tokens, got.summary_or_empty())


@asynccontextmanager
async def service_pair(
    model: str,
    prefill_tp: int,
    decode_tp: int,
    *,
    engine: str = "reference",
    num_blocks: int = 96,
    extra_prefill: Sequence[str] = (),
    extra_decode: Sequence[str] = (),
    decode_factory: EngineFactory | None = None,
    default_reuse: bool = False,
) -> AsyncIterator[RunningPair]:
    """`default_reuse`: decode's prefix reuse as its defaults have it; else off unless extra_decode
    turns it on (all_freed checks that decode frees every block)."""
    common = [
        "--model",
        model,
        "--engine",
        engine,
        "--num-blocks",
        str(num_blocks),
        "--port",
        "0",
        "--loop",
        "asyncio",
        "--log-level",
        "WARNING",
    ]
    prefill_settings = parse_settings("prefill", [*common, "--tp", str(prefill_tp), *extra_prefill], environ={})
    prefill = await PrefillApp.start(prefill_settings, engine_factory_for(engine, prefill_settings))
    try:
        decode_settings = parse_settings(
            "decode",
            [
                *common,
                *("--tp", str(decode_tp), "--prefill", f"127.0.0.1:{prefill.port}"),
                *(() if default_reuse else REUSE_OFF),
                *extra_decode,
            ],
            environ={},
        )
        decode = await DecodeApp.start(decode_settings, decode_factory or engine_factory_for(engine, decode_settings))
        try:
            await decode.wait_ready(30)
            async with grpc.aio.insecure_channel(f"127.0.0.1:{decode.port}") as channel:
                yield RunningPair(prefill, decode, pb_grpc.DecodeServiceStub(channel))
        finally:
            await asyncio.wait_for(decode.stop(), 30)
    finally:
        await asyncio.wait_for(prefill.stop(), 30)


async def all_freed(pair: RunningPair) -> bool:
    """Whether both sides' blocks and prefill's pins are all free, waiting a while for the last
    notifications and decode's cleanup after its last response (polled, never timed)."""
    for _ in range(1000):
        if not (pair.prefill.host.allocator.num_used or pair.decode.host.allocator.num_used or len(pair.prefill.pins)):
            return True
        await asyncio.sleep(0.01)
    return False


def decode_has_parts(pair: RunningPair, request_id: str) -> bool:
    """Whether a manifest part of the request reached decode's session and went to the request
    (from then on decode releases it after its READs; before, it cancels the job)."""
    return any(p.session is not None and p.session.has_parts(request_id) for p in pair.decode.peers.peers)


async def cancel_until_released(pair: RunningPair, call: asyncio.Future[Any], request_id: str) -> bool:
    """The client goes away once decode has taken a manifest part of `request_id` (a part leaves
    prefill before decode has it: waited for, never slept on): cancel its call, then wait
    (polled, a while) until decode's release reached prefill; whether it did, exactly once."""
    await until(lambda: decode_has_parts(pair, request_id), f"decode to take a part of {request_id}", timeout=60)
    call.cancel()
    await asyncio.gather(call, return_exceptions=True)
    for _ in range(1000):
        if pair.prefill.pins.ended.get("released"):
            break
        await asyncio.sleep(0.01)
    return pair.prefill.pins.ended.get("released") == 1


def parts_arrive_late(monkeypatch: pytest.MonkeyPatch, request_id: str, seconds: float = 0.5) -> None:
    """TEST-ONLY: every manifest part of `request_id` reaches decode's session `seconds` after it
    left prefill, in order (the last part, which answers the job, is not one of them: a test
    using this holds the job before it). A real run delays a part only by chance, under load."""
    from decode_svc.session_client import SessionClient

    part_arrived = SessionClient._part_arrived

    def late(self: SessionClient, rid: str, part: Manifest) -> None:
        if rid != request_id:
            part_arrived(self, rid, part)
            return
        asyncio.get_running_loop().call_later(seconds, part_arrived, self, rid, part)

    monkeypatch.setattr(SessionClient, "_part_arrived", late)


def drop_part_reads(monkeypatch: pytest.MonkeyPatch, which: Callable[[Manifest], bool]) -> None:
    """TEST-ONLY (negative controls): decode takes every manifest part `which` picks as arrived
    but never READs it, so its state is left unread in decode's blocks."""
    arrived = PartReads.arrived

    def dropping(self: PartReads, part: Manifest, read: Coroutine[Any, Any, ReadStats]) -> None:
        if which(part):
            self.parts.append(part)
            read.close()
            return
        arrived(self, part, read)

    monkeypatch.setattr(PartReads, "arrived", dropping)
