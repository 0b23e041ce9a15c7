"""`--engine hf` through the real services at their default boundary for it (full-N): real
grpc.aio servers on port 0, real NIXL READs over UCX on DRAM, a tiny transformers checkpoint
loaded from disk. The full-N boundary itself (generate() equality, the first token before the
READ, the N-1 mode) is tested in test_services_hf_boundary.py."""

from __future__ import annotations

import asyncio
import json
import shutil
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest
from transformers import AutoTokenizer

from decode_svc.request_options import sampling_from
from hybridpd_tools.bench.colocated_server import colocated_servicer
from shared.engine.hf.checkpoint import HfCheckpoint
from shared.engine.hf.colocated import colocated_generate
from shared.engine.hf.tiny_checkpoints import build_checkpoint
from shared.engine.hf.tokenizer import HfTokenizer
from shared.http.chat_template import BYTE_TEMPLATE
from shared.http.params import ChatMessage
from shared.pb.hybridpd.v1 import decode_service_pb2 as dpb
from shared.pb.hybridpd.v1 import decode_service_pb2_grpc as dpb_grpc
from tests.integration.services.colocated import colocated_port
from tests.integration.services.colocated_tokens import CHECKPOINT_ENGINES, colocated_tokens
from tests.integration.services.hf_services import generate_ids, generate_with, hf_pair

pytestmark = [pytest.mark.integration, pytest.mark.asyncio, pytest.mark.timeout(120)]


@pytest.mark.parametrize("engine", CHECKPOINT_ENGINES)
async def test_hf_pair_equals_colocated_and_pairs_across_directory_names(
    hf_checkpoint: Callable[[str], str], tmp_path: Path, engine: str
) -> None:
    original = hf_checkpoint("qwen3_5")
    renamed = str(tmp_path / "a-different-name")
    shutil.copytree(original, renamed)  # same config and weights elsewhere: the same model
    async with hf_pair(original, renamed, 2, 4, engine=engine) as (prefill, decode):
        assert prefill.host.message.model.fingerprint == decode.host.message.model.fingerprint
        block = decode.host.layout.block_size
        for prompt in ([42], [7, 8, 9, 10, 11], [(5 * i) % 150 + 4 for i in range(block + 1)]):
            ids, summary = await generate_ids(decode.port, prompt, block // 2 + 3)
            # Off the event loop: the services in this process keep their heartbeats meanwhile.
            want = await colocated_tokens(engine, original, prompt, block // 2 + 3, stop_at_eos=False)
            assert ids == want, prompt
            assert summary.state_verified
            assert summary.prompt_token_count == len(prompt)
            # prefill's engine time came through the manifest: part of the time prefill took
            engine_ns = summary.prefill_engine_duration.ToNanoseconds()
            assert 0 < engine_ns < summary.prefill_duration.ToNanoseconds()
            assert summary.first_step_engine_duration.ToNanoseconds() == 0  # full-N: prefill drew the first token


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


SEEDED = dpb.SamplingParams(temperature=0.9, top_p=0.9, top_k=40, seed=1234)


async def test_hf_seeded_sampling_is_the_same_disaggregated_and_colocated(hf_checkpoint: Callable[[str], str]) -> None:
    directory = hf_checkpoint("nemotron_h")
    prompt = [(11 * i) % 300 + 4 for i in range(21)]
    ckpt = HfCheckpoint(directory, dtype="fp32")
    want = await asyncio.to_thread(
        colocated_generate, ckpt, prompt, 12, boundary="full", sampling=sampling_from(SEEDED), stop_at_eos=False
    )
    async with (
        hf_pair(directory, directory, 1, 2) as (_, decode),
        colocated_port(colocated_servicer("hf", directory, 1, 32)) as colocated,
    ):
        runs = {}
        for port, where in ((decode.port, "disaggregated"), (colocated, "colocated")):
            for seed in (1234, 1235):
                sampling = dpb.SamplingParams()
                sampling.CopyFrom(SEEDED)
                sampling.seed = seed
                ids, summary = await generate_with(
                    port, prompt_token_ids=prompt, max_tokens=12, sampling=sampling, ignore_eos=True
                )
                assert summary.finish_reason == dpb.FINISH_REASON_LENGTH and summary.seed == seed
                runs[where, seed] = ids
        greedy, _ = await generate_with(decode.port, prompt_token_ids=prompt, max_tokens=12, ignore_eos=True)
    assert runs["disaggregated", 1234] == runs["colocated", 1234] == want.token_ids
    assert runs["disaggregated", 1235] == runs["colocated", 1235]
    assert runs["disaggregated", 1234] != runs["disaggregated", 1235]  # negative control: the seed decides
    assert runs["disaggregated", 1234] != greedy


async def test_hf_stops_at_the_eos_of_generation_config(hf_checkpoint: Callable[[str], str], tmp_path: Path) -> None:
    original = hf_checkpoint("qwen3_5")
    prompt = [9, 40, 41, 42, 43, 44]
    ckpt = HfCheckpoint(original, dtype="fp32")
    full = (await asyncio.to_thread(colocated_generate, ckpt, prompt, 16, boundary="full", stop_at_eos=False)).token_ids
    cut = next(i for i, t in enumerate(full) if i >= 2 and t not in full[:i])
    # Decode's copy names that token as its EOS (generation_config is not part of the fingerprint).
    eos_dir = tmp_path / "eos"
    shutil.copytree(original, eos_dir)
    config = json.loads((eos_dir / "generation_config.json").read_text())
    config["eos_token_id"] = [full[cut]]
    (eos_dir / "generation_config.json").write_text(json.dumps(config))
    async with hf_pair(original, str(eos_dir), 1, 1) as (_, decode):
        ids, summary = await generate_with(decode.port, prompt_token_ids=prompt, max_tokens=16)
        assert ids == full[: cut + 1] and summary.finish_reason == dpb.FINISH_REASON_STOP
        ignored, summary = await generate_with(decode.port, prompt_token_ids=prompt, max_tokens=16, ignore_eos=True)
        assert ignored == full and summary.finish_reason == dpb.FINISH_REASON_LENGTH  # control: ignore_eos goes on


async def test_hf_text_in_and_out_with_the_checkpoint_tokenizer(hf_checkpoint: Callable[[str], str]) -> None:
    directory = hf_checkpoint("bamba")
    tok = HfTokenizer(directory)
    text = "Hello wörld, the fox 🦊 jumps"
    prompt = tok.encode(text)
    assert len(prompt) < len(text.encode())  # negative control: BPE merges, not the byte tokenizer
    ckpt = HfCheckpoint(directory, dtype="fp32")
    want = (await asyncio.to_thread(colocated_generate, ckpt, prompt, 20, boundary="full", stop_at_eos=False)).token_ids
    async with (
        hf_pair(directory, directory, 1, 1, decode_flags=("--http-port", "0")) as (_, decode),
        grpc.aio.insecure_channel(f"127.0.0.1:{decode.port}") as channel,
    ):
        ids: list[int] = []
        pieces: list[str] = []
        request = dpb.GenerateRequest(prompt=text, max_tokens=20, ignore_eos=True)
        async for reply in dpb_grpc.DecodeServiceStub(channel).Generate(request, timeout=60):
            if reply.HasField("chunk"):
                ids.extend(reply.chunk.token_ids)
                pieces.append(reply.chunk.text)
            else:
                assert reply.summary.prompt_token_count == len(prompt)
        assert ids == want
        assert "".join(pieces) == tok.decode(want)
        assert "".join(pieces) != bytes(t for t in want if t < 256).decode("utf-8", errors="replace")

        def complete() -> Any:
            url = f"http://127.0.0.1:{decode.shell.http_port}/v1"
            with openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=30) as client:
                return client.completions.create(model=directory, prompt=text, max_tokens=20, extra_body={"ignore_eos": True})

        out = await asyncio.to_thread(complete)
        assert out.choices[0].text == tok.decode(want)
        assert out.usage.prompt_tokens == len(prompt)


async def test_hf_chat_completion_uses_the_checkpoint_chat_template(hf_checkpoint: Callable[[str], str]) -> None:
    directory = hf_checkpoint("bamba")
    tok = HfTokenizer(directory)
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello, fox"}]
    hf_tok = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    rendered = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prompt = tok.encode(rendered)
    byte_rendered = BYTE_TEMPLATE.render([ChatMessage(m["role"], m["content"]) for m in messages])
    assert prompt != tok.encode(byte_rendered)  # negative control: the templates give other prompts
    ckpt = HfCheckpoint(directory, dtype="fp32")
    want = (await asyncio.to_thread(colocated_generate, ckpt, prompt, 12, boundary="full", stop_at_eos=False)).token_ids
    async with hf_pair(directory, directory, 1, 1, decode_flags=("--http-port", "0")) as (_, decode):

        def chat() -> Any:
            url = f"http://127.0.0.1:{decode.shell.http_port}/v1"
            with openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=30) as client:
                return client.chat.completions.create(
                    model=directory, messages=messages, max_tokens=12, extra_body={"ignore_eos": True}
                )

        out = await asyncio.to_thread(chat)
    assert out.choices[0].message.content == tok.decode(want)
    assert out.usage.prompt_tokens == len(prompt)
    assert out.usage.completion_tokens == len(want)


async def test_hf_render_and_the_prefill_leg_encode_with_the_checkpoint_tokenizer(hf_checkpoint: Callable[[str], str]) -> None:
    """Both workers render text (and the prefill leg encodes it) as the generation does: with the
    checkpoint's tokenizer and chat template, not bytes, so both P/D legs see the same prompt."""
    directory = hf_checkpoint("bamba")
    tok = HfTokenizer(directory)
    text = "Hello, fox"
    assert tok.encode(text) != list(text.encode())  # negative control: BPE-merged, not bytes
    messages = [{"role": "user", "content": text}]
    rendered = AutoTokenizer.from_pretrained(directory, local_files_only=True).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    flags = ("--http-port", "0")
    async with hf_pair(directory, directory, 1, 1, decode_flags=flags, prefill_flags=flags) as (prefill, decode):
        for app in (prefill, decode):
            base = f"http://127.0.0.1:{app.shell.http_port}"
            [completion] = await asyncio.to_thread(
                _post_json, base + "/v1/completions/render", {"model": directory, "prompt": text}
            )
            assert completion["token_ids"] == tok.encode(text), app
            chat = await asyncio.to_thread(
                _post_json, base + "/v1/chat/completions/render", {"model": directory, "messages": messages}
            )
            assert chat["token_ids"] == tok.encode(rendered), app


def _post_json(url: str, body: Any) -> Any:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as reply:
        return json.loads(reply.read())
