"""Decode computing prompts itself on an engine that batches (paged, a real tiny checkpoint):
prompts that arrive together share batched prefill steps (shared/runtime/prefill_loop.py), and
every request's replies (tokens, logprobs, prompt logprobs, forks) are the bits of the same request
computed alone; with batch invariance off they are not (the negative control). A request cancelled
while its prompt is in a step frees its blocks only once the step has ended, and the request
queued with it is untouched."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager

import grpc
import pytest

from decode_svc.app import DecodeApp
from shared.config import parse_settings
from shared.engine.paged import call_sizes
from shared.engine.protocol import BatchedPrefill, PrefillChunk
from shared.pb.hybridpd.v1 import decode_service_pb2 as pb
from shared.pb.hybridpd.v1 import decode_service_pb2_grpc as pb_grpc
from shared.runtime.engine_host import engine_factory_for
from shared.runtime.prefill_loop import PrefillLoop
from tests.waiting import until

pytestmark = [pytest.mark.integration, pytest.mark.asyncio, pytest.mark.timeout(240)]


def prompt_of(n: int, start: int) -> list[int]:
    return [(start + 7 * i) % 300 + 4 for i in range(n)]


# Mixed lengths, and the request paths a local prefill serves: plain, logprobs, prompt logprobs,
# and two sampled sequences drawn from one prefill's logits.
REQUESTS = (
    pb.GenerateRequest(prompt_token_ids=prompt_of(5, 1), max_tokens=6, ignore_eos=True, logprobs=2),
    pb.GenerateRequest(prompt_token_ids=prompt_of(37, 2), max_tokens=5, ignore_eos=True, logprobs=1, prompt_logprobs=2),
    pb.GenerateRequest(
        prompt_token_ids=prompt_of(19, 3),
        max_tokens=4,
        ignore_eos=True,
        n=2,
        logprobs=1,
        sampling=pb.SamplingParams(temperature=0.9, seed=11),
    ),
    pb.GenerateRequest(prompt_token_ids=prompt_of(64, 4), max_tokens=6, ignore_eos=True, logprobs=3),
    pb.GenerateRequest(prompt_token_ids=prompt_of(2, 5), max_tokens=3, ignore_eos=True, logprobs=1),
)


@asynccontextmanager
async def decode_alone(model: str, *extra: str) -> AsyncIterator[DecodeApp]:
    """decode-svc with no prefill engine: every prompt is computed on its own paged engine."""
    args = ["--engine", "paged", "--model", model, "--num-blocks", "256", "--port", "0", "--host", "127.0.0.1"]
    settings = parse_settings("decode", [*args, "--loop", "asyncio", *extra], environ={})
    app = await DecodeApp.start(settings, engine_factory_for("paged", settings))
    try:
        yield app
    finally:
        await app.stop()
        call_sizes.forget()


def local_steps(app: DecodeApp) -> PrefillLoop:
    steps = app.servicer.generation.local.steps
    assert steps is not None, "the paged engine batches prefill: decode's local prefills run in steps"
    return steps


async def replies(stub: pb_grpc.DecodeServiceAsyncStub, request: pb.GenerateRequest) -> dict[str, list[bytes]]:
    """Everything a call streams but its summary (which carries timings), by sequence."""
    out: dict[str, list[bytes]] = {}
    async for reply in stub.Generate(request, timeout=120):
        if reply.HasField("chunk"):
            out.setdefault(f"sequence {reply.chunk.index}", []).append(reply.chunk.SerializeToString())
        elif reply.HasField("prompt_logprobs"):
            out.setdefault("prompt", []).append(reply.prompt_logprobs.SerializeToString())
    return out


async def together_and_alone(
    app: DecodeApp, requests: Sequence[pb.GenerateRequest]
) -> tuple[list[dict[str, list[bytes]]], list[dict[str, list[bytes]]], int]:
    """The requests sent while the compute thread is held, so that their prompts queue and share
    steps; then each again alone. Returns both replies and the steps the together run took.

    The loop takes waiting prompts into a step as soon as it can, and that step then waits for the
    held thread with whatever had arrived: so the first request goes alone and is in its step
    before the others are sent, and the others all wait for the next step."""
    steps = local_steps(app)
    gate = threading.Event()
    held = app.host.submit_compute(lambda: gate.wait(60))
    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as channel:
        stub = pb_grpc.DecodeServiceStub(channel)
        try:
            calls = [asyncio.ensure_future(replies(stub, requests[0]))]
            await until(lambda: steps.in_step == 1, "the first prompt to be in a step", timeout=60)
            calls += [asyncio.ensure_future(replies(stub, r)) for r in requests[1:]]
            await until(lambda: steps.waiting == len(requests) - 1, "the other prompts to queue for a step", timeout=60)
        finally:
            gate.set()
        await held
        before = steps.steps
        together = await asyncio.gather(*calls)
        taken = steps.steps - before
        alone = [await replies(stub, r) for r in requests]
    return together, alone, taken


async def test_prompts_computed_on_decode_share_steps_and_keep_their_bits(hf_checkpoint: Callable[[str], str]) -> None:
    async with decode_alone(hf_checkpoint("nemotron_h")) as app:
        together, alone, taken = await together_and_alone(app, REQUESTS)
        steps = local_steps(app)
        # The first prompt's step, then one step for all the others (the budget holds them all).
        assert (taken, steps.largest_batch) == (2, len(REQUESTS) - 1)
        for i, (a, b) in enumerate(zip(together, alone, strict=True)):
            assert a == b, f"request {i}: replies beside the others differ from alone"
        assert set(together[1]) == {"prompt", "sequence 0"} and set(together[2]) == {"sequence 0", "sequence 1"}
        exposition = app.metrics.telemetry.exposition()
        sizes = next(x for x in exposition.splitlines() if x.startswith("hybrid_pd_prefill_batch_size_sum"))
        assert float(sizes.split()[-1]) == 2 * len(REQUESTS)  # each prompt once together, once alone
        assert app.host.allocator.num_used == 0


async def test_without_batch_invariance_a_prompt_beside_others_has_other_bits(hf_checkpoint: Callable[[str], str]) -> None:
    """The negative control: the comparison above can fail."""
    async with decode_alone(hf_checkpoint("nemotron_h"), "--batch-invariant", "off") as app:
        together, alone, _ = await together_and_alone(app, REQUESTS)
    assert any(a != b for a, b in zip(together, alone, strict=True))


async def test_a_request_cancelled_during_its_prefill_step_frees_its_blocks_after_the_step(
    hf_checkpoint: Callable[[str], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    async with decode_alone(hf_checkpoint("nemotron_h")) as app:
        steps, engine = local_steps(app), app.host.engine
        assert isinstance(engine, BatchedPrefill)
        events: list[str] = []
        cancelled = pb.GenerateRequest(request_id="cancelled", prompt_token_ids=prompt_of(40, 8), max_tokens=4, ignore_eos=True)
        kept = pb.GenerateRequest(request_id="kept", prompt_token_ids=prompt_of(23, 9), max_tokens=4, ignore_eos=True, logprobs=1)
        in_step, release = threading.Event(), threading.Event()
        original_step, original_free = engine.prefill_batch, app.host.free

        def paused_step(chunks: Sequence[PrefillChunk]) -> list[int | None]:
            """The step with the cancelled request's prompt (its 40 tokens) waits to be released."""
            if not any(c.end == len(cancelled.prompt_token_ids) for c in chunks):
                return original_step(chunks)
            in_step.set()
            release.wait(60)
            try:
                return original_step(chunks)
            finally:
                events.append("its step ended")

        def recorded_free(key: str) -> None:
            events.append(f"free {key}")
            original_free(key)

        monkeypatch.setattr(engine, "prefill_batch", paused_step)
        monkeypatch.setattr(app.host, "free", recorded_free)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as channel:
            stub = pb_grpc.DecodeServiceStub(channel)
            gate = threading.Event()
            held = app.host.submit_compute(lambda: gate.wait(60))
            call = stub.Generate(cancelled, timeout=120)
            reading = asyncio.ensure_future(call.read())
            kept_call = asyncio.ensure_future(replies(stub, kept))
            try:
                await until(lambda: steps.waiting + steps.in_step == 2, "both prompts to queue", timeout=60)
            finally:
                gate.set()
            await held
            await asyncio.to_thread(in_step.wait, 60)  # a step with the cancelled prompt is on the compute thread
            call.cancel()
            await asyncio.gather(reading, return_exceptions=True)
            assert "free cancelled" not in events  # the step still writes its blocks
            release.set()
            got = await kept_call
            await until(lambda: app.host.allocator.num_used == 0, "every block to be freed", timeout=60)
            monkeypatch.setattr(engine, "prefill_batch", original_step)
            assert got == await replies(stub, kept)  # alone now: the same bits
        assert events.index("free cancelled") > events.index("its step ended"), events
