"""`bench transfer`: our READ path against raw NIXL and memcpy, in the same run.

Ours: a real prefill and a real decode service (subprocesses, synthetic engine at the
model's real sizes) serve K sequential requests; each request's READ time is the decode
service's own measurement, GenerateSummary.read_duration (first READ posted -> last READ
done, all (decode rank, prefill rank) READs of the request). Its bytes and descriptor count
come from the same summary.

Transfer digests (on, as by default): decode reports how long its check of prefill's digests
took and prefill how long taking them took, per request; both are reported as a share of that
request's READ time (the READ itself never includes them), next to one pass of the digests' hash
over the same bytes (hash_pass.py), the least a digest of every byte can cost.

Baselines, measured in rounds interleaved with the requests (so drift on a shared machine hits
all alike): (a) and (b) from raw_nixl.py, between plain agents in this process and a raw
target process, with memory sized like the services' and rewritten by the target before each
READ (prefill has always just written what decode reads); (c) one single-threaded torch copy
of the same number of bytes (memcpy.py).

`--device cuda`: the services' caches (rank r on cuda:r), the raw agents' regions and the copy's
buffers are GPU memory; the READs are VRAM to VRAM and (c) is a device-to-device copy. The hash
pass stays on the host (the digests of VRAM state are taken from host copies of it).

Both raw targets pump while a raw READ is in flight, as a pumping strategy says, and the reader
polls the same way (raw_pumping.py). Across hosts (UCX over TCP, where that pumping bounds the
READ) every round measures (a) and (b) under each strategy, in a rotating order, and each counts
with its fastest strategy (the others are reported as `raw_nixl_pumping`); on one host (cma) the
strategy cannot matter and only one is run.

The descriptor set of (a) is rebuilt from the layout math: same plan, same read lists, and the
block ids the services allocate (sizing.py). Its byte and descriptor counts are checked against
every GenerateSummary (`descriptor_set_matches`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import grpc
import numpy as np

from hybridpd_tools.bench.client import generate, seconds
from hybridpd_tools.bench.hash_pass import HashPassBaseline
from hybridpd_tools.bench.local_pair import start_pair
from hybridpd_tools.bench.memcpy import CopyBaseline
from hybridpd_tools.bench.pairs import pair_lists, request_reads, total_sections
from hybridpd_tools.bench.progress import Progress
from hybridpd_tools.bench.raw_nixl import PreparedRead, RawReader, RawTarget, coalesce_per_region
from hybridpd_tools.bench.raw_pumping import ACROSS_HOSTS, ONE_HOST
from hybridpd_tools.bench.sections import SectionBytes
from hybridpd_tools.bench.sizing import blocks_needed, prefill_tokens, request_blocks
from hybridpd_tools.bench.transfer_report import TransferSamples, build_result
from shared.layout.models import load_model
from shared.layout.page import build_engine_layout
from shared.layout.plan import build_plan
from shared.pb.hybridpd.v1 import decode_service_pb2_grpc as pb_grpc

MAX_TOKENS = 1  # one decode step: the request is about its transfer
SETTLE_SECONDS = 0.02  # let the services finish a request's bookkeeping before a baseline round


@dataclass
class ServiceCounts:
    """What the decode service reported moving per request (the same for every request)."""

    sections: SectionBytes | None = None
    descriptors: int = 0


@dataclass(frozen=True)
class TransferConfig:
    model: str
    prefill_tp: int
    decode_tp: int
    prompt_tokens: int
    requests: int
    warmup: int = 1
    kernel_block_size: int = 16
    check_state: bool = False
    seed: int = 0
    huge_pages: bool = True  # the services' caches and every baseline's buffers alike
    device: str = "cpu"  # cuda: the services' caches and every baseline's buffers on GPUs (rank r on cuda:r)


async def run_transfer(
    cfg: TransferConfig,
    *,
    command: str,
    show_progress: bool = True,
    prefill_launch: Sequence[str] = (),
    prefill_host: str = "127.0.0.1",
    link: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """`prefill_launch` puts the prefill service and the raw target on another host (see
    hybridpd_tools/bench/hosts.py); `link` describes that link in the result."""
    spec = load_model(cfg.model)
    prefill = build_engine_layout(spec, cfg.prefill_tp, kernel_block_size=cfg.kernel_block_size)
    decode = build_engine_layout(spec, cfg.decode_tp, kernel_block_size=cfg.kernel_block_size)
    plan = build_plan(prefill, decode)
    tokens = prefill_tokens(spec, cfg.prompt_tokens)
    p_blocks = blocks_needed(prefill, tokens)
    d_blocks = blocks_needed(decode, cfg.prompt_tokens + MAX_TOKENS)
    common = [
        "--model", cfg.model, "--engine", "synthetic", "--kernel-block-size", str(cfg.kernel_block_size),
        "--log-level", "WARNING", "--huge-pages", "on" if cfg.huge_pages else "off", "--device", cfg.device,
    ]  # fmt: skip
    prefill_args = [*common, "--tp", str(cfg.prefill_tp), "--num-blocks", str(p_blocks), "--engine-id", "bench-prefill"]
    decode_args = [*common, "--tp", str(cfg.decode_tp), "--num-blocks", str(d_blocks), "--engine-id", "bench-decode"]
    if cfg.check_state:
        decode_args.append("--check-state")
    rounds = cfg.warmup + cfg.requests
    progress = Progress("bench transfer", rounds + 1, enabled=show_progress)
    progress.advance(0, "starting services and raw agents")
    pair = await start_pair(prefill_args, decode_args, prefill_launch=prefill_launch, prefill_host=prefill_host)
    target: RawTarget | None = None
    reader: RawReader | None = None
    try:
        target = RawTarget(
            cfg.prefill_tp,
            prefill.num_regions,
            prefill.region_bytes(p_blocks),
            huge_pages=cfg.huge_pages,
            device=cfg.device,
            launch=prefill_launch,
        )
        reader = RawReader(
            target, cfg.decode_tp, decode.num_regions, decode.region_bytes(d_blocks), huge_pages=cfg.huge_pages, device=cfg.device
        )
        pairs = pair_lists(
            plan,
            local_bases=[reader.bases(d) for d in range(cfg.decode_tp)],
            remote_bases=[r.bases for r in target.ranks],
            local_num_blocks=d_blocks,
            remote_num_blocks=p_blocks,
        )
        reads = request_reads(
            pairs, request_blocks(decode, cfg.prompt_tokens + MAX_TOKENS), request_blocks(prefill, tokens), tokens
        )
        identical = [
            reader.prepare(
                r.pair.decode_rank, r.pair.prefill_rank, r.pair.lists.local, r.pair.lists.remote, r.local_idx, r.remote_idx
            )
            for r in reads
        ]
        coalesced = [
            _coalesced(reader, target, r.pair.decode_rank, r.pair.prefill_rank, r.pair.lists.local, r.local_idx) for r in reads
        ]
        sections = total_sections(reads)
        copy = CopyBaseline(sections.total, huge_pages=cfg.huge_pages, device=cfg.device)
        hashing = HashPassBaseline(sections.total, huge_pages=cfg.huge_pages)
        progress.advance(1, "measuring")
        pumpings = ACROSS_HOSTS if prefill_launch else ONE_HOST
        samples, service, matches = await _rounds(
            cfg, pair.decode.address, spec.vocab_size, target, reader, identical, coalesced, copy, hashing, progress, pumpings
        )
        samples.take_fastest_pumping()
    finally:
        progress.finish()
        if reader is not None:
            reader.close()
        if target is not None:
            target.close()
        pair.stop()
    config = (
        asdict(cfg)
        | {
            "transferred_tokens": tokens,
            "prefill_block_size": prefill.block_size,
            "decode_block_size": decode.block_size,
            "prefill_blocks": p_blocks,
            "decode_blocks": d_blocks,
            "engine": "synthetic",
        }
        | ({"hosts": link} if link is not None else {})
    )
    return build_result(
        config=config,
        sections=service.sections or sections,
        descriptors={
            "ours": service.descriptors,
            "raw_nixl": sum(r.descriptors for r in identical),
            "raw_nixl_coalesced": sum(r.descriptors for r in coalesced),
        },
        reads=len(identical),
        samples=samples,
        descriptor_set_matches=matches and service.sections == sections,
        command=command,
        moved_bytes={"raw_nixl": sum(r.nbytes for r in identical), "raw_nixl_coalesced": sum(r.nbytes for r in coalesced)},
    )


def _coalesced(reader: RawReader, target: RawTarget, d: int, p: int, local_descs: Any, local_idx: Any) -> PreparedRead:
    local, remote = coalesce_per_region(local_descs, local_idx, reader.bases(d), target.ranks[p].bases)
    ids = np.arange(len(local), dtype=np.int32)  # the id dtype of our own READ path
    return reader.prepare(d, p, local, remote, ids, ids)


async def _rounds(
    cfg: TransferConfig,
    decode_address: str,
    vocab: int,
    target: RawTarget,
    reader: RawReader,
    identical: list[PreparedRead],
    coalesced: list[PreparedRead],
    copy: CopyBaseline,
    hashing: HashPassBaseline,
    progress: Progress,
    pumpings: Sequence[str],
) -> tuple[TransferSamples, ServiceCounts, bool]:
    rng = np.random.default_rng(cfg.seed)
    samples = TransferSamples()
    service = ServiceCounts()
    expected_descriptors = sum(r.descriptors for r in identical)
    samples.by_pumping = {m: {p: [] for p in pumpings} for m in ("raw_nixl", "raw_nixl_coalesced")}
    matches = True
    async with grpc.aio.insecure_channel(decode_address) as channel:
        stub = pb_grpc.DecodeServiceStub(channel)
        for i in range(cfg.warmup + cfg.requests):
            prompt = rng.integers(0, vocab, cfg.prompt_tokens).tolist()
            timed = await generate(stub, prompt, MAX_TOKENS, request_id=f"bench-transfer-{i}")
            if timed.error or timed.summary is None:
                raise RuntimeError(f"request {i} failed: {timed.error or 'no summary'}")
            s = timed.summary
            t = s.transfer
            got = SectionBytes(fa=t.attention_bytes, conv=t.conv_bytes, ssm=t.ssm_bytes)
            matches = matches and service.sections in (None, got) and t.descriptor_count == expected_descriptors
            service.sections, service.descriptors = got, int(t.descriptor_count)
            await asyncio.sleep(SETTLE_SECONDS)
            raw: list[tuple[str, str, float]] = []
            for k in range(len(pumpings)):
                pumping = pumpings[(i + k) % len(pumpings)]  # rotated: no strategy always goes first
                for method, prepared in (("raw_nixl", identical), ("raw_nixl_coalesced", coalesced)):
                    notif = f"bench-{method}-{i}-{pumping}".encode()
                    target.serve(pumping, notif, len(prepared))
                    raw.append((method, pumping, reader.run(prepared, notif, pumping)))
            mem = copy.run()
            hash_pass = hashing.run()
            if i >= cfg.warmup:
                samples.ours.append(seconds(s.read_duration))
                for method, pumping, took in raw:
                    samples.add_raw(method, pumping, took)
                samples.memcpy.append(mem)
                samples.ttft.append(seconds(s.time_to_first_token))
                samples.prefill.append(seconds(s.prefill_duration))
                samples.digest_check.append(seconds(s.digest_check_duration))
                samples.prefill_digest.append(seconds(s.prefill_digest_duration))
                samples.hash_pass.append(hash_pass)
            progress.advance(1, f"READ {seconds(s.read_duration) * 1e3:.1f} ms")
    return samples, service, matches
