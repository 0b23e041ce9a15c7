"""Decode's state checkpoints (--prefix-cache-states) at the hf engine's default, the full-N
boundary, with chunked prefill (--prefill-chunk-tokens C): prefill samples the first output
token, so a checkpoint keeps the token the manifest brought, keyed also by that draw's sampling
identity. A greedy retry, or a sample with the same seed, restores it: the stored first token
goes out at once, decode feeds it and runs no prefill job and READs nothing; another seed, or
min_tokens masking other ids, misses and runs a job.

Real services in this process (grpc.aio on port 0, NIXL READs over UCX on DRAM), tiny seeded
checkpoints. Every response equals the colocated run with the same chunks, sampling and
min_tokens bit for bit (greedy: also transformers' own generate), digests on, and decode's
--check-state recomputes in prefill's chunks.
Negative controls: the seeds give different tokens; a stored first token replaced, or SSM bytes
shifted with digests off, change the tokens.

With the prefill service stopped, a greedy retry still restores and decodes, and one whose stored
first token ends it answers that token alone; another prompt fails UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from decode_svc.app import DecodeApp
from prefill_svc.app import PrefillApp
from shared.engine.hf.colocated import colocated_generate
from shared.engine.sampling import GREEDY, SamplingParams
from shared.pb.hybridpd.v1 import decode_service_pb2 as dpb
from shared.rpc.status import describe
from tests.integration.services.checkpoint_checks import count_jobs, oldest_checkpoint, shift_checkpoint_ssm
from tests.integration.services.hf_services import generate_with, hf_pair
from tests.unit.engine_hf.helpers import checkpoint, transformers_generate

pytestmark = [pytest.mark.integration, pytest.mark.asyncio, pytest.mark.timeout(300)]

CHUNK = 40
PREFILL = ("--prefill-chunk-tokens", str(CHUNK))
DECODE = ("--prefix-cache-blocks", "64", "--prefix-cache-states", "4", "--num-blocks", "128")
SAMPLED = dict(temperature=1.3, top_p=0.95, top_k=50)
MAX_TOKENS = 6


def _prompt(seed: int, n: int = 100) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(4, 300, n)]


def _restored(summary: dpb.GenerateSummary, computed: int) -> None:
    assert summary.prefix_state_reused and summary.prefix_cached_tokens == computed
    assert summary.transfer.total_bytes == 0 and summary.transfer.read_count == 0 and summary.num_transferred_tokens == 0


def _read(summary: dpb.GenerateSummary) -> None:
    assert not summary.prefix_state_reused and summary.transfer.ssm_bytes > 0


def _nothing_held(prefill: PrefillApp, decode: DecodeApp) -> None:
    """Every request's blocks are free on both sides: decode holds only its prefix cache's and checkpoints'."""
    assert not len(prefill.pins) and prefill.host.allocator.num_used == 0
    reuse = decode.servicer.generation.reuse  # the checkpoints' copies are pool blocks too
    assert decode.host.allocator.num_used == reuse.prefix.num_blocks + reuse.states.num_blocks


async def _colocated(directory: str, prompt: list[int], max_tokens: int, **kw: Any) -> list[int]:
    ckpt = checkpoint(directory)
    got = await asyncio.to_thread(colocated_generate, ckpt, prompt, max_tokens, prefill_chunk_tokens=CHUNK, **kw)
    return got.token_ids


@pytest.mark.parametrize("family,p_tp,d_tp", [("nemotron_h", 1, 1), ("bamba", 1, 2)])
async def test_greedy_and_seeded_repeats_restore_the_first_token_and_equal_colocated(
    hf_checkpoint: Callable[[str], str], family: str, p_tp: int, d_tp: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    directory = hf_checkpoint(family)
    prompt = _prompt(30)
    jobs = count_jobs(monkeypatch)
    runs: dict[str, tuple[list[int], dpb.GenerateSummary]] = {}
    async with hf_pair(directory, directory, p_tp, d_tp, prefill_flags=PREFILL, decode_flags=DECODE) as (
        prefill,
        decode,
    ):
        assert decode.host.engine.boundary == "full"  # the hf default
        for rid, seed, max_tokens in (
            ("greedy", None, MAX_TOKENS),
            ("greedy-again", None, MAX_TOKENS),
            ("greedy-one", None, 1),  # the stored first token ends it: nothing restored
            ("seed5", 5, MAX_TOKENS),
            ("seed5-again", 5, MAX_TOKENS),
            ("seed6", 6, MAX_TOKENS),
        ):
            sampling = dpb.SamplingParams(seed=seed, **SAMPLED) if seed else None
            runs[rid] = await generate_with(
                decode.port, prompt_token_ids=prompt, max_tokens=max_tokens, sampling=sampling, request_id=rid
            )
        _nothing_held(prefill, decode)
        assert len(decode.servicer.generation.reuse.states) == 3  # greedy, seed 5, seed 6
    assert jobs == ["greedy", "seed5", "seed6"]
    greedy, _ = runs["greedy"]
    want, _ = await asyncio.to_thread(transformers_generate, checkpoint(directory).model, prompt, MAX_TOKENS)
    assert greedy == want == await _colocated(directory, prompt, MAX_TOKENS)
    for seed in (5, 6):
        sampling = SamplingParams(seed=seed, **SAMPLED)  # type: ignore[arg-type]
        assert runs[f"seed{seed}"][0] == await _colocated(directory, prompt, MAX_TOKENS, sampling=sampling), seed
    assert runs["greedy-again"][0] == greedy and runs["seed5-again"][0] == runs["seed5"][0]
    assert runs["greedy-one"][0] == greedy[:1] and runs["greedy-one"][1].finish_reason == dpb.FINISH_REASON_LENGTH
    assert len({tuple(runs[r][0]) for r in ("greedy", "seed5", "seed6")}) == 3  # the sampling decides the tokens
    for rid in ("greedy", "seed5", "seed6"):
        _read(runs[rid][1])
    for rid in ("greedy-again", "greedy-one", "seed5-again"):
        _restored(runs[rid][1], len(prompt))
    assert runs["greedy-again"][1].digests_verified


def _with_eos(original: str, eos: int, target: Path) -> str:
    """A copy of the checkpoint whose generation_config names `eos` (not part of the fingerprint)."""
    shutil.copytree(original, target)
    config = json.loads((target / "generation_config.json").read_text())
    config["eos_token_id"] = [eos]
    (target / "generation_config.json").write_text(json.dumps(config))
    return str(target)


async def test_a_restored_first_token_that_is_eos_ends_the_request_and_min_tokens_keys_apart(
    hf_checkpoint: Callable[[str], str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decode's copy of the checkpoint names greedy's first token as its EOS. An ignore_eos
    request READs and keeps the state with that first token; a plain retry restores it and ends
    at the EOS at once; min_tokens masks the EOS in prefill's draw, so its key differs (a job),
    and a repeat of it restores."""
    original = hf_checkpoint("qwen3_5")
    prompt = _prompt(31, 60)
    free = await _colocated(original, prompt, MAX_TOKENS, stop_at_eos=False)
    eos = free[0]
    eos_dir = _with_eos(original, eos, tmp_path / "eos")
    masked = await _colocated(eos_dir, prompt, MAX_TOKENS, min_tokens=3)
    assert eos not in masked[:3] and masked[0] != eos
    jobs = count_jobs(monkeypatch)
    runs: dict[str, tuple[list[int], dpb.GenerateSummary]] = {}
    async with hf_pair(original, eos_dir, 1, 1, prefill_flags=PREFILL, decode_flags=DECODE) as (
        prefill,
        decode,
    ):
        for rid, fields in (
            ("ignore-eos", dict(ignore_eos=True)),
            ("eos-first", {}),
            ("min3", dict(min_tokens=3)),
            ("min3-again", dict(min_tokens=3)),
            ("min1-one", dict(min_tokens=1, max_tokens=1)),
        ):
            fields.setdefault("max_tokens", MAX_TOKENS)
            runs[rid] = await generate_with(decode.port, prompt_token_ids=prompt, request_id=rid, **fields)
        _nothing_held(prefill, decode)
    assert jobs == ["ignore-eos", "min3"]
    assert runs["ignore-eos"][0] == free
    assert runs["eos-first"][0] == [eos] and runs["eos-first"][1].finish_reason == dpb.FINISH_REASON_STOP
    assert runs["min3"][0] == runs["min3-again"][0] == masked
    assert runs["min1-one"][0] == masked[:1]
    _read(runs["ignore-eos"][1])
    _read(runs["min3"][1])
    for rid in ("eos-first", "min3-again", "min1-one"):
        _restored(runs[rid][1], len(prompt))


async def test_a_changed_first_token_or_ssm_state_changes_the_tokens(
    hf_checkpoint: Callable[[str], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The negative controls: the stored first token is what is streamed and fed (one replaced
    changes every token), and with digests off the restored SSM bytes are what decode runs on."""
    directory = hf_checkpoint("nemotron_h")
    prompt = _prompt(32)
    off = ("--verify-transfer", "off")
    jobs = count_jobs(monkeypatch)
    # --check-state off too: it would catch the shifted bytes (DATA_LOSS) before they are decoded.
    async with hf_pair(
        directory, directory, 1, 1, prefill_flags=(*PREFILL, *off), decode_flags=(*DECODE, *off), check_state=False
    ) as (_, decode):
        healthy, _ = await generate_with(decode.port, prompt_token_ids=prompt, max_tokens=MAX_TOKENS, request_id="healthy")
        held = oldest_checkpoint(decode)
        assert held.first_token == healthy[0]
        held.first_token = (healthy[0] + 1) % decode.host.spec.vocab_size
        swapped, summary = await generate_with(decode.port, prompt_token_ids=prompt, max_tokens=MAX_TOKENS)
        _restored(summary, len(prompt))
        held.first_token = healthy[0]
        shift_checkpoint_ssm(decode)
        shifted, summary = await generate_with(decode.port, prompt_token_ids=prompt, max_tokens=MAX_TOKENS)
        _restored(summary, len(prompt))
    assert jobs == ["healthy"]
    assert swapped[0] == (healthy[0] + 1) % decode.host.spec.vocab_size and swapped[1:] != healthy[1:]
    assert shifted[0] == healthy[0] and shifted[1:] != healthy[1:]
    # GREEDY on the colocated run: the healthy tokens are the real ones, not a corrupted copy's.
    assert healthy == await _colocated(directory, prompt, MAX_TOKENS, sampling=GREEDY)


async def test_restores_need_no_ready_prefill(hf_checkpoint: Callable[[str], str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The only prefill service is stopped after a greedy request's checkpoint was taken: a greedy
    retry restores it and decodes, and one of max_tokens 1 gets the stored first token alone,
    both equal to before; a prompt with no checkpoint fails UNAVAILABLE naming the peer."""
    directory = hf_checkpoint("nemotron_h")
    prompt = _prompt(33)
    jobs = count_jobs(monkeypatch)
    runs: dict[str, tuple[list[int], dpb.GenerateSummary]] = {}
    no_fallback = (*DECODE, "--local-prefill", "off")  # else decode computes `other` itself
    async with hf_pair(directory, directory, 1, 1, prefill_flags=PREFILL, decode_flags=no_fallback) as (
        prefill,
        decode,
    ):
        runs["greedy"] = await generate_with(decode.port, prompt_token_ids=prompt, max_tokens=MAX_TOKENS, request_id="greedy")
        _nothing_held(prefill, decode)
        await prefill.stop()
        peers = decode.servicer.generation.peers
        while peers.any_ready or any(p.link is not None for p in peers.peers):
            await asyncio.sleep(0.02)
        for rid, max_tokens in (("greedy-again", MAX_TOKENS), ("greedy-one", 1)):
            runs[rid] = await generate_with(decode.port, prompt_token_ids=prompt, max_tokens=max_tokens, request_id=rid)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await generate_with(decode.port, prompt_token_ids=_prompt(34), max_tokens=MAX_TOKENS, request_id="other")
        failure = describe(err.value)
        assert failure.status == "UNAVAILABLE" and failure.reason == "NO_PREFILL_PEER", failure
        assert failure.message.startswith("no prefill engine is ready (127.0.0.1:"), failure
        reuse = decode.servicer.generation.reuse
        assert decode.host.allocator.num_used == reuse.prefix.num_blocks + reuse.states.num_blocks
        assert all(c.users == 0 for c in reuse.states._entries.values())
        telemetry = decode.servicer.generation.telemetry
        assert telemetry is not None
        served = "hybrid_pd_prefix_state_without_prefill_total 2.0"  # greedy-again and greedy-one, the first-token path too
        assert served in telemetry.exposition().splitlines()
    assert jobs == ["greedy"]
    greedy, _ = runs["greedy"]
    assert greedy == await _colocated(directory, prompt, MAX_TOKENS)
    assert runs["greedy-again"][0] == greedy and runs["greedy-one"][0] == greedy[:1]
    assert runs["greedy-one"][1].finish_reason == dpb.FINISH_REASON_LENGTH
    for rid in ("greedy-again", "greedy-one"):
        _restored(runs[rid][1], len(prompt))
