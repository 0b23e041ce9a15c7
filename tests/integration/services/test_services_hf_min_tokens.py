"""min_tokens through the real hf services (grpc.aio on port 0, NIXL over UCX on DRAM, a tiny
transformers checkpoint from disk) where the EOS is the token greedy picks first: decode's copy of
the checkpoint names it as its EOS, so without min_tokens the request ends at its first token.
With min_tokens the EOS is masked in the sampler, by prefill for the first token (full-N: the job
carries min_tokens and the ids decode resolved) and by decode for the rest, and the tokens equal
the colocated run with the same min_tokens; at N-1 decode masks them all.

vLLM's P/D legs (N-1 state): the prefill leg gets the router's max_tokens 1 and min_tokens 1,
the decode leg the client's min_tokens, which its sampler applies: the colocated run's tokens.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from shared.engine.hf.colocated import colocated_generate
from shared.pb.hybridpd.v1 import decode_service_pb2 as dpb
from tests.integration.http.conftest import request
from tests.integration.services.hf_services import generate_with, hf_pair
from tests.unit.engine_hf.helpers import checkpoint

pytestmark = [pytest.mark.integration, pytest.mark.asyncio, pytest.mark.timeout(180)]

PROMPT = [9, 40, 41, 42, 43, 44]
PREFILL_LEG = {"max_tokens": 1, "min_tokens": 1, "stream": False,
               "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                                      "remote_block_ids": None, "remote_host": None, "remote_port": None}}  # fmt: skip
MAX_TOKENS = 6


def with_eos(original: str, eos: int, target: Path) -> str:
    """A copy of the checkpoint whose generation_config names `eos` (not part of the fingerprint)."""
    shutil.copytree(original, target)
    config = json.loads((target / "generation_config.json").read_text())
    config["eos_token_id"] = [eos]
    (target / "generation_config.json").write_text(json.dumps(config))
    return str(target)


@pytest.mark.parametrize("boundary", ["full", "n-1"])
async def test_min_tokens_keeps_an_early_eos_from_ending_the_request(
    hf_checkpoint: Callable[[str], str], tmp_path: Path, boundary: str
) -> None:
    original = hf_checkpoint("qwen3_5")
    free = await asyncio.to_thread(colocated_generate, checkpoint(original), PROMPT, MAX_TOKENS, stop_at_eos=False)
    eos = free.token_ids[0]
    eos_dir = with_eos(original, eos, tmp_path / "eos")
    early = checkpoint(eos_dir)
    # Colocated (engine level): the EOS ends the request at once; with min_tokens it is not drawn before.
    assert (await asyncio.to_thread(colocated_generate, early, PROMPT, MAX_TOKENS, boundary=boundary)).token_ids == [eos]
    want = await asyncio.to_thread(colocated_generate, early, PROMPT, MAX_TOKENS, boundary=boundary, min_tokens=3)
    assert len(want.token_ids) >= 3 and eos not in want.token_ids[:3] and want.token_ids[0] != free.token_ids[0]
    flags = ("--boundary", boundary)
    async with hf_pair(original, eos_dir, 1, 2, decode_flags=flags, prefill_flags=flags) as (_, decode):
        ids, summary = await generate_with(decode.port, prompt_token_ids=PROMPT, max_tokens=MAX_TOKENS)
        assert (ids, summary.finish_reason) == ([eos], dpb.FINISH_REASON_STOP)  # negative control
        ids, summary = await generate_with(decode.port, prompt_token_ids=PROMPT, max_tokens=MAX_TOKENS, min_tokens=3)
        assert ids == want.token_ids
        assert summary.finish_reason == (dpb.FINISH_REASON_STOP if want.finish_reason == "stop" else dpb.FINISH_REASON_LENGTH)
        # min_tokens = max_tokens: never an EOS.
        ids, summary = await generate_with(decode.port, prompt_token_ids=PROMPT, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS)
        assert len(ids) == MAX_TOKENS and eos not in ids and summary.finish_reason == dpb.FINISH_REASON_LENGTH


async def test_pd_legs_with_min_tokens_equal_colocated(hf_checkpoint: Callable[[str], str], tmp_path: Path) -> None:
    original = hf_checkpoint("qwen3_5")
    free = await asyncio.to_thread(colocated_generate, checkpoint(original), PROMPT, MAX_TOKENS, stop_at_eos=False)
    eos = free.token_ids[0]
    eos_dir = with_eos(original, eos, tmp_path / "eos")
    n_1 = ("--boundary", "n-1")
    want = await asyncio.to_thread(colocated_generate, checkpoint(eos_dir), PROMPT, MAX_TOKENS, boundary="n-1", min_tokens=3)
    async with hf_pair(original, eos_dir, 1, 1, prefill_flags=(*n_1, "--http-port", "0"), decode_flags=n_1) as (
        prefill,
        decode,
    ):
        url = f"http://127.0.0.1:{prefill.shell.http_port}/v1/completions"
        runs = {}
        for rid, min_tokens in (("plain", 0), ("min3", 3)):
            body = {"model": original, "prompt": PROMPT, "max_tokens": MAX_TOKENS}
            reply = await asyncio.to_thread(request, url, body | PREFILL_LEG, None, {"X-Request-Id": rid})
            assert reply.status == 200, reply.body
            kv = reply.json()["kv_transfer_params"]
            runs[min_tokens] = await generate_with(
                decode.port,
                request_id=rid,
                prompt_token_ids=PROMPT,
                max_tokens=MAX_TOKENS,
                min_tokens=min_tokens,
                kv_transfer_params=json.dumps(kv),
            )
        assert (runs[0][0], runs[0][1].finish_reason) == ([eos], dpb.FINISH_REASON_STOP)  # negative control
        ids, summary = runs[3]
        assert ids == want.token_ids and eos not in ids[:3]
        assert summary.transfer.read_count > 0
        async with asyncio.timeout(10):
            while len(prefill.pins) or prefill.host.allocator.num_used or decode.host.allocator.num_used:
                await asyncio.sleep(0.02)
