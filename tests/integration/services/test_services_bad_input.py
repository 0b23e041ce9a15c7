"""Bad input of every kind gets the right status and a message naming the field, and touches
nothing: both allocators as before, no READ posted, no prefill run."""

from __future__ import annotations

import asyncio
import dataclasses
import sys
from collections.abc import Callable
from typing import Any

import pytest

from decode_svc.peer_link import PeerLink
from prefill_svc.job import Job
from shared.cache.manifest import Manifest
from shared.errors import InvalidArgument
from shared.pb.hybridpd.v1 import decode_service_pb2 as dpb
from shared.pb.hybridpd.v1 import decode_service_pb2_grpc as dpb_grpc
from shared.pb.hybridpd.v1 import layout_pb2 as lpb
from shared.transport.agent import RankAgent
from shared.transport.poller import CompletionPoller
from tests.decode_stream import failure_of
from tests.waiting import until

pytestmark = [pytest.mark.integration, pytest.mark.asyncio, pytest.mark.timeout(60)]


@pytest.mark.parametrize(
    ("fields", "field", "needle"),
    [
        # Longer than decode's whole cache (--num-blocks 8: 6 attention blocks of 32 tokens).
        ({"prompt_token_ids": [1] * 200, "max_tokens": 1}, "prompt_token_ids", "holds at most"),
        ({"prompt": "x" * 200, "max_tokens": 1}, "prompt", "holds at most"),
        # Fits decode, not prefill (--num-blocks 4 there: 2 attention blocks, 64 prefilled tokens).
        ({"prompt_token_ids": [1] * 100, "max_tokens": 1}, "prompt_token_ids", "blocks on prefill"),
    ],
)
async def test_prompt_longer_than_a_cache_allows(
    start_prefill: Any, start_decode: Any, channel_to: Any, fields: dict[str, Any], field: str, needle: str
) -> None:
    prefill = await start_prefill("--num-blocks", "4")
    decode = await start_decode(prefill.port, "--num-blocks", "8")
    failure = await failure_of(channel_to(decode.port), dpb.GenerateRequest(**fields), timeout=20)
    assert failure.status == "INVALID_ARGUMENT" and failure.fields == (field,), failure
    assert failure.message.startswith(field) and needle in failure.message
    assert prefill.host.allocator.num_used == 0 and decode.host.allocator.num_used == 0
    assert prefill.host.engine.prefills == 0


def corrupt_manifests(prefill: Any, mutate: Callable[[Manifest], Manifest]) -> None:
    """FAKE: a prefill engine whose manifests are wrong (a real one cannot be made to send them)."""
    real = prefill.servicer.runner.run

    async def run(job: Job, **kwargs: Any) -> Manifest:
        return mutate(await real(job, **kwargs))

    prefill.servicer.runner.run = run


def drop_a_group(m: Manifest) -> Manifest:
    return dataclasses.replace(m, block_ids=m.block_ids[:-1])


def block_out_of_range(m: Manifest) -> Manifest:
    ids = [b.copy() for b in m.block_ids]  # prefill's own arrays stay as they are
    ids[-1][0] = 100_000
    return dataclasses.replace(m, block_ids=tuple(ids))


def duplicate_block(m: Manifest) -> Manifest:
    ids = [b.copy() for b in m.block_ids]
    ids[-1][0] = ids[0][0]
    return dataclasses.replace(m, block_ids=tuple(ids))


def lease_expired(m: Manifest) -> Manifest:
    return dataclasses.replace(m, lease_ns=0)


def no_digests(m: Manifest) -> Manifest:
    return dataclasses.replace(m, digests=(), digest_algorithm="")


@pytest.mark.parametrize(
    ("mutate", "status", "field", "reason"),
    [
        (drop_a_group, "INTERNAL", "manifest.groups", "BAD_MANIFEST"),
        (block_out_of_range, "INTERNAL", "manifest.groups.block_ids", "BAD_MANIFEST"),
        (duplicate_block, "INTERNAL", "manifest.groups.block_ids", "BAD_MANIFEST"),
        (lease_expired, "ABORTED", "manifest.lease_duration", "LEASE_EXPIRED"),
        (no_digests, "FAILED_PRECONDITION", "manifest.digest_algorithm", "NO_DIGESTS"),
    ],
)
async def test_bad_manifest_is_refused_before_any_read(
    start_prefill: Any, start_decode: Any, channel_to: Any, mutate: Any, status: str, field: str, reason: str
) -> None:
    prefill = await start_prefill()
    decode = await start_decode(prefill.port)
    corrupt_manifests(prefill, mutate)
    posted = decode.host.poller.stats.reads_posted  # the loopback and probe READs at start-up
    assert posted > 0  # the count is live: a READ of this request would show
    failure = await failure_of(
        channel_to(decode.port), dpb.GenerateRequest(prompt_token_ids=[1, 2, 3, 4, 5], max_tokens=3), timeout=20
    )
    assert failure.status == status and failure.reason == reason, failure
    assert failure.message.startswith(field) and "prefill test-prefill" in failure.message, failure
    assert decode.host.poller.stats.reads_posted == posted  # nothing was read
    assert decode.host.allocator.num_used == 0
    # Decode released the request on prefill: its blocks are free long before any lease.
    await until(lambda: prefill.host.allocator.num_used == 0)
    assert prefill.pins.ended["released"] == 1 and not prefill.pins.ended["lease_expired"]


async def test_notifications_for_unknown_requests_are_ignored_and_counted(start_prefill: Any) -> None:
    prefill = await start_prefill()
    stranger = await RankAgent.create("stranger", 0)
    pump = CompletionPoller()  # without a progress thread, the sender must be pumped too
    pump.attach(stranger)
    try:
        target = prefill.host.message.ranks[0]
        await stranger.add_remote(target.agent_metadata)
        before = prefill.metrics.telemetry.unknown_notifications._value.get()
        for message in (b"t-no-such-transfer", b"garbage \x00\xff"):
            await stranger.send_notif(target.agent_name, message)
        await until(lambda: prefill.host.poller.stats.notifs_unknown == 2)
        assert prefill.metrics.telemetry.unknown_notifications._value.get() == before + 2
        assert prefill.host.allocator.num_used == 0 and len(prefill.pins) == 0
        assert "hybrid_pd_unknown_notifications_total 2.0" in prefill.metrics.exposition()
    finally:
        await pump.aclose()
        await stranger.aclose()


async def test_peer_agent_metadata_nixl_cannot_load(start_prefill: Any, start_decode: Any) -> None:
    prefill = await start_prefill()
    decode = await start_decode(prefill.port, ready=False)
    bad = lpb.EngineLayout()
    bad.CopyFrom(prefill.host.message)
    bad.ranks[0].agent_metadata = b"not NIXL agent metadata"
    with pytest.raises(InvalidArgument) as err:
        await PeerLink.open(decode.host, f"127.0.0.1:{prefill.port}", bad)
    assert err.value.fields == ("layout.ranks[0].agent_metadata",)
    assert decode.host.allocator.num_used == 0


async def test_unknown_model_stops_the_service_with_exit_2() -> None:
    async def run(role: str) -> tuple[int, str]:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", f"{role}_svc", "--model", "no-such-model", "--port", "0",
            *(["--prefill", "127.0.0.1:1"] if role == "decode" else []),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        _, err = await asyncio.wait_for(proc.communicate(), 50)
        assert proc.returncode is not None
        return proc.returncode, err.decode()

    for code, err in await asyncio.gather(run("prefill"), run("decode")):
        assert code == 2, err
        assert "INVALID_ARGUMENT: --model: model 'no-such-model' is neither a preset" in err, err


async def test_the_read_count_moves_when_a_request_reads(start_prefill: Any, start_decode: Any, channel_to: Any) -> None:
    """Negative control of `nothing was read` above: a good request's READ shows in the count."""
    prefill = await start_prefill()
    decode = await start_decode(prefill.port)
    posted = decode.host.poller.stats.reads_posted
    stub = dpb_grpc.DecodeServiceStub(channel_to(decode.port))
    async for _ in stub.Generate(dpb.GenerateRequest(prompt_token_ids=[1, 2, 3, 4, 5], max_tokens=3), timeout=20):
        pass
    assert decode.host.poller.stats.reads_posted == posted + 1
