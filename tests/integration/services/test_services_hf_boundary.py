"""The full-N boundary through the real services (grpc.aio on port 0, NIXL READs over UCX on
DRAM, tiny transformers checkpoints from disk): prefill computes all N prompt tokens and samples
the first output token, decode streams it before its READ completes and continues from the state.

- Disaggregated tokens equal transformers' own generate(do_sample=False), fp32 and bf16, at
  several TP pairs; the N-1 mode stays available and equals its colocated run.
- The first chunk leaves before the READ has finished: the decode agent's TEST-ONLY hold
  (RankAgent.test_hold_seconds) keeps the READ in flight, because a DRAM READ finishes within
  its post and a real one cannot be slowed on demand. When the first chunk arrives, the READ is
  complete if it was posted (a step mark) and its handle released (decode releases it before the
  READ counts as done): not so at full-N; at N-1 (the negative control) always.
- A first token that ends the request (max_tokens 1, or an EOS) needs no READ: prefill's pin is
  released at once.
- Engines of different boundaries are refused at handshake, naming the field.
- The first token travels ahead of the manifest, once per request; a prefill that sends it only
  in the manifest (an older peer) serves the same tokens.
"""

from __future__ import annotations

import asyncio
import functools
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from decode_svc.app import DecodeApp
from decode_svc.session_client import SessionClient
from prefill_svc import jobs
from prefill_svc.app import PrefillApp
from shared.engine.hf.colocated import colocated_generate
from shared.observe import Step, tracing_into
from shared.pb.hybridpd.v1 import decode_service_pb2 as dpb
from shared.pb.hybridpd.v1 import decode_service_pb2_grpc as dpb_grpc
from shared.transport.agent import RankAgent
from tests.integration.services.hf_services import generate_with, hf_pair
from tests.unit.engine_hf.helpers import checkpoint, transformers_generate
from tests.waiting import until

pytestmark = [pytest.mark.integration, pytest.mark.asyncio, pytest.mark.timeout(180)]

N_MINUS_1 = ("--boundary", "n-1")
HOLD_SECONDS = 3.0  # the TEST-ONLY READ hold; well inside the READ timeout (10 s)
MAX_TOKENS = 8


class Marks:
    """The step marks of the services in this process, in order (shared/observe.py)."""

    def __init__(self) -> None:
        self.steps: list[str] = []

    def mark(self, step: str) -> None:
        self.steps.append(step)


def nothing_held(prefill: PrefillApp, decode: DecodeApp, agent: RankAgent | None = None) -> bool:
    held = len(prefill.pins) or prefill.host.allocator.num_used or decode.host.allocator.num_used
    return not held and (agent is None or agent.live_xfers == 0)


@pytest.mark.parametrize(
    ("family", "dtype", "p_tp", "d_tp"),
    [("nemotron_h", "fp32", 1, 2), ("qwen3_5", "bf16", 2, 1), ("granitemoehybrid", "bf16", 2, 4), ("jamba", "fp32", 1, 1)],
)
async def test_full_n_tokens_equal_transformers_generate(
    family: str, dtype: str, p_tp: int, d_tp: int, hf_checkpoint: Callable[[str], str]
) -> None:
    directory = hf_checkpoint(family)
    flags = ("--dtype", dtype)
    async with hf_pair(directory, directory, p_tp, d_tp, decode_flags=flags, prefill_flags=flags) as (prefill, decode):
        assert prefill.host.message.boundary == decode.host.message.boundary  # full: the default for hf
        block = decode.host.layout.block_size
        ckpt = await asyncio.to_thread(checkpoint, directory, dtype)  # loaded off the event loop
        for prompt in ([42], [(7 * i) % 200 + 4 for i in range(block)], [(5 * i) % 150 + 4 for i in range(block + 1)]):
            want, _ = await asyncio.to_thread(transformers_generate, ckpt.model, prompt, MAX_TOKENS)
            ids, summary = await generate_with(decode.port, prompt_token_ids=prompt, max_tokens=MAX_TOKENS)
            assert ids == want, (family, dtype, prompt)
            assert summary.num_transferred_tokens == len(prompt)  # the state after all N tokens
            assert summary.state_verified and summary.transfer.read_count > 0


async def test_the_first_chunk_leaves_before_the_read_completes(hf_checkpoint: Callable[[str], str]) -> None:
    directory = hf_checkpoint("bamba")
    prompt = [(3 * i) % 180 + 4 for i in range(21)]
    ckpt = checkpoint(directory)
    read_completed_at_first_chunk: dict[str, bool] = {}
    for boundary, flags in (("full", ()), ("n-1", N_MINUS_1)):
        want = await asyncio.to_thread(colocated_generate, ckpt, prompt, MAX_TOKENS, boundary=boundary, stop_at_eos=False)
        async with (
            hf_pair(directory, directory, 1, 1, decode_flags=flags, prefill_flags=flags) as (prefill, decode),
            grpc.aio.insecure_channel(f"127.0.0.1:{decode.port}") as channel,
        ):
            agent = decode.host.agents[0]
            agent.test_hold_seconds = HOLD_SECONDS
            request = dpb.GenerateRequest(prompt_token_ids=prompt, max_tokens=MAX_TOKENS, ignore_eos=True)
            ids: list[int] = []
            marks = Marks()
            # The poller counts a READ done only once it completed (a held READ stays in flight):
            # the count, not whether a handle exists, which is also 0 while the READ is being posted.
            reads_done = decode.host.poller.stats.reads_done
            with tracing_into(marks):
                async for reply in dpb_grpc.DecodeServiceStub(channel).Generate(request, timeout=60):
                    if reply.HasField("chunk") and reply.chunk.token_ids:
                        if not ids:
                            first_chunk = len(ids) == 0 and len(reply.chunk.token_ids) == 1
                            done = decode.host.poller.stats.reads_done > reads_done
                            read_completed_at_first_chunk[boundary] = done
                        ids.extend(reply.chunk.token_ids)
            assert Step.POST_START in marks.steps, boundary  # the request did READ
            agent.test_hold_seconds = 0.0
            assert first_chunk and ids == want.token_ids, boundary
            await until(
                functools.partial(nothing_held, prefill, decode, agent), "blocks, pins and READ handles freed", timeout=10
            )
    assert read_completed_at_first_chunk == {"full": False, "n-1": True}


async def test_a_first_token_that_ends_the_request_reads_nothing(hf_checkpoint: Callable[[str], str], tmp_path: Path) -> None:
    original = hf_checkpoint("qwen3_5")
    prompt = [9, 40, 41, 42, 43, 44]
    full = (await asyncio.to_thread(colocated_generate, checkpoint(original), prompt, 4, stop_at_eos=False)).token_ids
    # Decode's copy names the first token as its EOS (generation_config is not part of the fingerprint).
    eos_dir = tmp_path / "eos"
    shutil.copytree(original, eos_dir)
    config = json.loads((eos_dir / "generation_config.json").read_text())
    config["eos_token_id"] = [full[0]]
    (eos_dir / "generation_config.json").write_text(json.dumps(config))
    async with hf_pair(original, str(eos_dir), 1, 2) as (prefill, decode):
        cases: list[tuple[dict[str, Any], list[int], int]] = [
            ({"max_tokens": 1, "ignore_eos": True}, full[:1], dpb.FINISH_REASON_LENGTH),
            ({"max_tokens": 4}, full[:1], dpb.FINISH_REASON_STOP),  # the first token is an EOS
        ]
        for fields, want, reason in cases:
            ids, summary = await generate_with(decode.port, prompt_token_ids=prompt, **fields)
            assert (ids, summary.finish_reason) == (want, reason), fields
            assert summary.transfer.read_count == 0 and summary.num_transferred_tokens == 0, fields
            assert summary.generated_token_count == 1 and not summary.state_verified
            await until(lambda: nothing_held(prefill, decode), "prefill's pin released without a READ", timeout=10)
        # Control: past the first token the state is READ and decoding goes on.
        ids, summary = await generate_with(decode.port, prompt_token_ids=prompt, max_tokens=4, ignore_eos=True)
        assert ids == full and summary.transfer.read_count > 0 and summary.finish_reason == dpb.FINISH_REASON_LENGTH


async def test_engines_of_different_boundaries_do_not_pair(hf_checkpoint: Callable[[str], str]) -> None:
    directory = hf_checkpoint("jamba")
    async with (
        hf_pair(directory, directory, 1, 1, ready=False, decode_flags=N_MINUS_1) as (_, decode),
        grpc.aio.insecure_channel(f"127.0.0.1:{decode.port}") as channel,
    ):
        stub = dpb_grpc.DecodeServiceStub(channel)
        for _ in range(300):
            status = (await stub.GetLayout(dpb.GetLayoutRequest(), timeout=5)).peers[0]
            if status.state == dpb.PEER_STATE_FAILED:
                break
            await asyncio.sleep(0.02)
    assert status.state == dpb.PEER_STATE_FAILED
    assert "FAILED_PRECONDITION" in status.last_error and "boundary: prefill full, decode n-1" in status.last_error


async def test_the_first_token_comes_early_and_a_prefill_that_sends_none_still_serves(
    hf_checkpoint: Callable[[str], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prefill sends each job's first token ahead of its manifest (one FirstToken per request);
    a prefill that sends none, as one predating the message would, still serves the same tokens,
    the token then taken from the manifest. The older prefill is a stand-in (no job of this
    version's prefill skips the early token): its jobs are given no one to announce the token to."""
    directory = hf_checkpoint("nemotron_h")
    prompt = [(11 * i) % 170 + 4 for i in range(19)]
    want, _ = await asyncio.to_thread(transformers_generate, checkpoint(directory).model, prompt, MAX_TOKENS)
    early_tokens: list[int] = []
    early_engine_ns: list[int] = []  # the engine time each early token carried
    heard = SessionClient._first_token

    def counted(self: SessionClient, msg: Any) -> None:
        early_tokens.append(msg.token_id)
        early_engine_ns.append(msg.engine_duration.ToNanoseconds())
        heard(self, msg)

    monkeypatch.setattr(SessionClient, "_first_token", counted)
    for sends_early in (True, False):
        if not sends_early:
            monkeypatch.setattr(jobs, "_announcer", lambda job, sink: None)
        early_tokens.clear()
        early_engine_ns.clear()
        async with hf_pair(directory, directory, 1, 2) as (prefill, decode):
            for _ in range(2):
                ids, summary = await generate_with(decode.port, prompt_token_ids=prompt, max_tokens=MAX_TOKENS, ignore_eos=True)
                assert ids == want and summary.transfer.read_count > 0 and summary.generated_token_count == MAX_TOKENS
                if sends_early:  # the same engine time as the manifest's (one clock reading, two encodings)
                    manifest_ns = summary.prefill_engine_duration.ToNanoseconds()
                    assert manifest_ns > 0 and abs(early_engine_ns[-1] - manifest_ns) <= 1, (early_engine_ns, manifest_ns)
            await until(lambda: nothing_held(prefill, decode), "blocks and pins freed", timeout=10)
        assert early_tokens == (want[:1] * 2 if sends_early else []), sends_early
