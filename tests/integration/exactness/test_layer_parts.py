"""Layer parts (--layer-parts): the last chunk's state leaves in parts of consecutive model
layers, each as soon as the last chunk computed its layers, so decode READs the first layers'
K/V and conv / SSM state while the later layers still compute.

Real services in this process (grpc.aio on port 0, NIXL READs over UCX on DRAM), reference
engine unless named. Tokens must equal a colocated run bit for bit with every part's digests
checked, at TP pairs and kernel block sizes that split groups differently; a layer part is shown
READ (its notification counted by prefill) while the last chunk is held after its layers; a byte
flipped in one layer fails the request naming that layer part; a layer part left unread changes
the tokens (negative control); a request released inside the last chunk stops it at the next
layer and frees both sides; a decode engine that does not ask gets one last part of every layer.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import cache
from typing import Any

import grpc
import pytest

import prefill_svc.session as session
from prefill_svc.layer_parts import LayerPartFeed
from prefill_svc.part_plan import part_spans
from shared.cache.manifest import Manifest
from shared.engine.reference.colocated import colocated_generate
from shared.layout.models import load_model
from shared.layout.page import build_engine_layout
from shared.layout.presets import TINY_PRESETS
from shared.layout.spec import layer_ranges
from shared.pb.hybridpd.v1 import prefill_service_pb2 as pb
from shared.runtime.faults import FaultPlan, Injector
from tests.integration.exactness.multi_turn import random_tokens, run_turns
from tests.integration.exactness.pair import all_freed, cancel_until_released, drop_part_reads, parts_arrive_late, service_pair
from tests.integration.exactness.subjects import Subject

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

TEXT = bytes(range(32, 127)) * 3
CHUNK = 20
MAX_TOKENS = 6
LENGTH = 100  # 99 computed, blocks of 32, chunks of 20: token parts [0,32) [32,64), then the last chunk's layers


def prompt_of(length: int) -> list[int]:
    return list(TEXT[:length])


@cache
def expected(model: str, length: int) -> tuple[int, ...]:
    return tuple(colocated_generate(TINY_PRESETS[model], prompt_of(length), MAX_TOKENS))


def flags(layer_parts: int) -> list[str]:
    return ["--prefill-chunk-tokens", str(CHUNK), "--layer-parts", str(layer_parts)]


@contextmanager
def parts_sent(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[int, int, int, int, int]]]:
    """Every manifest part prefill sends: (index, count, tokens_from, layers_from, layers_to)."""
    sent: list[tuple[int, int, int, int, int]] = []
    to_message = session.manifest_message

    def message_of(m: Manifest) -> pb.Manifest:
        msg = to_message(m)
        if msg.HasField("part"):
            p = msg.part
            sent.append((p.index, p.count, p.tokens_from, p.layers_from, p.layers_to))
        return msg

    monkeypatch.setattr(session, "manifest_message", message_of)
    yield sent


CASES = [
    ("tiny-mamba2", 1, 1, 16, 16, 2),
    ("tiny-gdn", 2, 1, 16, 16, 3),
    ("tiny-mamba1", 1, 2, 16, 16, 99),  # capped at the model's layers: one part per layer
    ("tiny-gdn", 1, 1, 16, 32, 2),  # decode blocks of 64 tokens, prefill's of 48
    ("tiny-mamba2", 2, 2, 32, 16, 3),
]


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "model,prefill_tp,decode_tp,prefill_kb,decode_kb,layer_parts",
    CASES,
    ids=[f"{m}-P{p}-D{d}-kb{a}-{b}-L{n}" for m, p, d, a, b, n in CASES],
)
async def test_layer_parts_tokens_equal_colocated(
    monkeypatch: pytest.MonkeyPatch,
    model: str,
    prefill_tp: int,
    decode_tp: int,
    prefill_kb: int,
    decode_kb: int,
    layer_parts: int,
) -> None:
    spec = TINY_PRESETS[model]
    block_size = build_engine_layout(spec, prefill_tp, kernel_block_size=prefill_kb).block_size
    lengths = [3 * block_size + 7, 2 * block_size + 1, CHUNK + 1]
    with parts_sent(monkeypatch) as sent:
        async with service_pair(
            model,
            prefill_tp,
            decode_tp,
            extra_prefill=[*flags(layer_parts), "--kernel-block-size", str(prefill_kb)],
            extra_decode=["--check-state", "--kernel-block-size", str(decode_kb)],
        ) as pair:
            got = [await pair.generate(prompt_of(n), MAX_TOKENS) for n in lengths]  # one at a time: parts in order
            assert await all_freed(pair)
            ended = dict(pair.prefill.pins.ended)
    ranges = layer_ranges(spec.num_layers, min(layer_parts, spec.num_layers))
    for n, g in zip(lengths, got):
        assert tuple(g.token_ids) == expected(model, n), f"prompt of {n} tokens"
        assert g.summary.digests_verified and g.summary.state_verified
    # Each prompt in parts: its token parts, then one part per layer range, all of the last chunk's tokens.
    in_parts = [n for n in lengths if len(part_spans(n - 1, CHUNK, block_size)) > 1]
    assert len(in_parts) == 2 and ended.get("read") == len(lengths), ended
    at = 0
    for n in in_parts:
        spans = part_spans(n - 1, CHUNK, block_size)
        count = len(spans) - 1 + len(ranges)
        mine = sent[at : at + count]
        at += count
        assert [s[:2] for s in mine] == [(i, count) for i in range(count)]
        assert [s[3:] for s in mine] == [(0, 0)] * (len(spans) - 1) + [(r.start, r.stop) for r in ranges]
        assert {s[2] for s in mine[len(spans) - 1 :]} == {spans[-1].tokens_from}
    assert at == len(sent)


@pytest.mark.asyncio
async def test_a_layer_part_is_read_while_the_last_chunk_still_computes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The compute thread, right after the engine reported the first range's last layer, waits
    (at most 10 s) for prefill to count the NIXL notification of that layer part's READ. Sent
    only after the last chunk (a pure ordering test: the tokens would equal colocated all the
    same), it never would."""
    model = "tiny-mamba2"
    on_layer = LayerPartFeed.on_layer
    seen: list[bool] = []
    router: list[Any] = []

    def spy(self: LayerPartFeed, layer: int) -> None:
        before = router[0].received
        on_layer(self, layer)
        if layer == self.ranges[0].stop - 1:
            for _ in range(1000):
                if router[0].received > before:
                    break
                threading.Event().wait(0.01)
            seen.append(router[0].received > before)

    monkeypatch.setattr(LayerPartFeed, "on_layer", spy)
    async with service_pair(model, 1, 1, extra_prefill=flags(2)) as pair:
        router.append(pair.prefill.host.poller.router)
        got = await pair.generate(prompt_of(LENGTH), MAX_TOKENS)
    assert seen == [True]
    assert tuple(got.token_ids) == expected(model, LENGTH)


@pytest.mark.asyncio
@pytest.mark.parametrize("section", ["ssm", "conv"])
async def test_a_flipped_byte_in_a_layer_part_fails_naming_it(inject_faults: Callable[[Injector], None], section: str) -> None:
    """The byte flipped is in the first SSM layer's state, after its layer part's digests were
    taken: decode's check of that part fails DATA_LOSS naming the part and its layers."""
    inject_faults(FaultPlan(corrupt=f"{section}:victim-"))
    model = "tiny-mamba2"
    spec = TINY_PRESETS[model]
    first_ssm = spec.ssm_layers[0]
    ranges = layer_ranges(spec.num_layers, 3)
    k = next(i for i, r in enumerate(ranges) if first_ssm in r)
    async with service_pair(model, 1, 1, extra_prefill=flags(3)) as pair:
        healthy = await pair.generate(prompt_of(LENGTH), MAX_TOKENS)
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await pair.generate(prompt_of(LENGTH), MAX_TOKENS, request_id="victim-1")
        assert await all_freed(pair)
    assert tuple(healthy.token_ids) == expected(model, LENGTH)
    assert failed.value.code() == grpc.StatusCode.DATA_LOSS
    details = failed.value.details() or ""
    count = 2 + len(ranges)  # two token parts (see LENGTH)
    name = f"part {2 + k + 1} of {count} (tokens 64..99, layers {ranges[k].start}..{ranges[k].stop})"
    assert "victim-1" in details and name in details and f"{section} of layer group" in details, details


@pytest.mark.asyncio
async def test_negative_control_a_layer_part_left_unread_changes_the_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """TEST-ONLY: decode drops the READ of the first layer part (digests off, so nothing else
    notices): the tokens must differ from colocated, so the exactness test above can fail."""
    drop_part_reads(monkeypatch, lambda part: part.layers is not None and part.layers.start == 0)
    off = ["--verify-transfer", "off"]
    async with service_pair("tiny-mamba2", 1, 1, extra_prefill=[*flags(2), *off], extra_decode=off) as pair:
        got = await pair.generate(prompt_of(LENGTH), MAX_TOKENS)
    assert tuple(got.token_ids) != expected("tiny-mamba2", LENGTH)


@pytest.mark.asyncio
@pytest.mark.parametrize("part_arrives_late", [False, True])
async def test_a_request_released_inside_the_last_chunk_stops_it_at_the_next_layer(
    monkeypatch: pytest.MonkeyPatch, part_arrives_late: bool
) -> None:
    """The compute thread is held right after the first layer range (its part already sent);
    the client goes away and decode releases the request. Let go, the last chunk computes no
    further layer (the next report raises), both sides free everything, and the next request
    is exact. The client goes only once decode has a part (`cancel_until_released`); the late
    case makes every part reach decode half a second after it left prefill."""
    model = "tiny-mamba2"
    on_layer = LayerPartFeed.on_layer
    held, release = threading.Event(), threading.Event()
    after_release: list[int] = []

    def spy(self: LayerPartFeed, layer: int) -> None:
        on_layer(self, layer)
        if release.is_set():
            after_release.append(layer)
        if layer == self.ranges[0].stop - 1 and not release.is_set():
            held.set()
            release.wait(30)

    monkeypatch.setattr(LayerPartFeed, "on_layer", spy)
    if part_arrives_late:
        parts_arrive_late(monkeypatch, "gone-1")
    async with service_pair(model, 1, 1, extra_prefill=flags(2)) as pair:
        call = asyncio.ensure_future(pair.generate(prompt_of(LENGTH), MAX_TOKENS, request_id="gone-1"))
        loop = asyncio.get_running_loop()
        assert await loop.run_in_executor(None, held.wait, 60)
        released = await cancel_until_released(pair, call, "gone-1")
        release.set()
        freed = await all_freed(pair)
        stopped_after = list(after_release)
        monkeypatch.setattr(LayerPartFeed, "on_layer", on_layer)
        healthy = await pair.generate(prompt_of(LENGTH), MAX_TOKENS)
    assert released and freed
    assert stopped_after == [], stopped_after  # no layer was reported final after the release
    assert tuple(healthy.token_ids) == expected(model, LENGTH)


@pytest.mark.asyncio
@pytest.mark.parametrize("digest_starts_late", [False, True])
async def test_a_release_while_a_layer_part_is_digested_frees_the_blocks_only_after_the_digest(
    monkeypatch: pytest.MonkeyPatch, digest_starts_late: bool
) -> None:
    """The first layer part's digests are held on the digest thread while the last chunk is
    computed to its end; the client goes away and decode releases the request (it has the token
    parts). The pin ends, but the blocks stay until the digest thread is done with them; then
    everything is free and the next request is exact.

    The last chunk waits for the digest thread to hold the first layer part before it ends: the
    digests are queued through the event loop and may start after the chunk's last layers. The
    late case makes that order happen (the digest thread starts half a second late)."""
    from prefill_svc.parted_job import PartedJob

    in_digest, go_on, computed = threading.Event(), threading.Event(), threading.Event()
    compute_span, digest_span = PartedJob.compute_span, PartedJob.digest_span

    def spy_span(self: PartedJob, job: Any, run: Any, blocks: Any, start: int, span: Any, last: bool, *rest: Any) -> Any:
        result = compute_span(self, job, run, blocks, start, span, last, *rest)
        if job.request_id == "gone-L" and last and in_digest.wait(30):
            computed.set()  # the last chunk is done: only the digest thread still reads the blocks
        return result

    def spy_digest(self: PartedJob, job: Any, blocks: Any, span: Any, ends: bool, layers: Any = None) -> Any:
        if job.request_id == "gone-L" and layers is not None and layers.start == 0:
            if digest_starts_late:
                time.sleep(0.5)
            in_digest.set()
            go_on.wait(30)
        return digest_span(self, job, blocks, span, ends, layers)

    monkeypatch.setattr(PartedJob, "compute_span", spy_span)
    monkeypatch.setattr(PartedJob, "digest_span", spy_digest)
    async with service_pair("tiny-mamba2", 1, 1, extra_prefill=flags(2)) as pair:
        call = asyncio.ensure_future(pair.generate(prompt_of(LENGTH), MAX_TOKENS, request_id="gone-L"))
        try:
            for _ in range(6000):
                if computed.is_set():
                    break
                await asyncio.sleep(0.01)
            assert computed.is_set()
            released = await cancel_until_released(pair, call, "gone-L")
            held_while_released = pair.prefill.host.allocator.num_used > 0
        finally:
            go_on.set()
        freed = await all_freed(pair)
        healthy = await pair.generate(prompt_of(LENGTH), MAX_TOKENS)
    assert released and freed
    assert held_while_released  # the digest thread was still reading them
    assert tuple(healthy.token_ids) == expected("tiny-mamba2", LENGTH)


@pytest.mark.asyncio
async def test_a_decode_engine_that_does_not_ask_gets_one_last_part_of_every_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    """An older decode engine never sets accept_layer_parts: prefill sends its parts as before."""
    real = pb.PrefillJob

    def older_job(**fields: Any) -> pb.PrefillJob:
        fields.pop("accept_layer_parts", None)
        return real(**fields)

    monkeypatch.setattr(pb, "PrefillJob", older_job)
    with parts_sent(monkeypatch) as sent:
        async with service_pair("tiny-gdn", 1, 1, extra_prefill=flags(3)) as pair:
            got = await pair.generate(prompt_of(LENGTH), MAX_TOKENS)
    assert tuple(got.token_ids) == expected("tiny-gdn", LENGTH)
    assert sent and all(s[3:] == (0, 0) for s in sent) and sent[-1][:2] == (len(sent) - 1, len(sent))


@pytest.mark.asyncio
async def test_multi_turn_with_the_prefix_cache_in_layer_parts_equals_colocated() -> None:
    """Decode's prefix cache and layer parts: every turn after the first READs only the K/V after
    the cached prefix, the last chunk's in layer parts; per turn the same attention bytes as
    with one last part, the same conv and SSM bytes, tokens equal colocated."""
    model, cache = "tiny-mamba2", ["--prefix-cache-blocks", "64", "--prefix-cache-states", "0", "--check-state"]
    moved: dict[int, list[tuple[int, int, int, int]]] = {}
    for layer_parts in (0, 3):
        async with service_pair(model, 1, 1, extra_prefill=flags(layer_parts), extra_decode=cache) as pair:
            results = await run_turns(pair, Subject("reference", model), random_tokens(11, 70), 100, 4, seed=11)
        moved[layer_parts] = [
            (
                r.summary.prefix_cached_tokens,
                r.summary.transfer.attention_bytes,
                r.summary.transfer.conv_bytes,
                r.summary.transfer.ssm_bytes,
            )
            for r in results
        ]
        reads = [r.summary.transfer.read_count for r in results]
        assert all(r.summary.digests_verified and r.summary.state_verified for r in results)
        if layer_parts:
            assert all(n > 2 for n in reads[1:]), reads  # the turns after the first came in layer parts
    assert moved[3] == moved[0] and all(cached > 0 for cached, *_ in moved[3][1:]), moved


SYNTHETIC_CASES = [("qwen3.5-0.8b", 2, 1, 4), ("jamba-mini-1.7", 2, 2, 3), ("nemotron-h-8b", 1, 2, 8)]


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "model,prefill_tp,decode_tp,layer_parts", SYNTHETIC_CASES, ids=[f"{m}-P{p}-D{d}-L{n}" for m, p, d, n in SYNTHETIC_CASES]
)
async def test_synthetic_engine_at_real_model_sizes_in_layer_parts_every_byte_checked(
    monkeypatch: pytest.MonkeyPatch, model: str, prefill_tp: int, decode_tp: int, layer_parts: int
) -> None:
    """Real-model layouts (groups spanning the model's layers) in layer parts, every byte compared."""
    spec = load_model(model)
    block_size = build_engine_layout(spec, prefill_tp).block_size
    length, chunk = 2 * block_size + block_size // 2, block_size // 2
    with parts_sent(monkeypatch) as sent:
        async with service_pair(
            model,
            prefill_tp,
            decode_tp,
            engine="synthetic",
            num_blocks=32,
            extra_prefill=["--prefill-chunk-tokens", str(chunk), "--layer-parts", str(layer_parts)],
            extra_decode=["--check-state"],
        ) as pair:
            got = await pair.generate(list(range(length)), 3)
            assert await all_freed(pair)
            ended = dict(pair.prefill.pins.ended)
    assert got.summary.state_verified and got.summary.digests_verified
    assert ended == {"read": 1}, ended  # every reader's notification of every part counted
    ranges = layer_ranges(spec.num_layers, layer_parts)
    assert [s[3:] for s in sent if s[3:] != (0, 0)] == [(r.start, r.stop) for r in ranges]  # the last chunk in layer parts
