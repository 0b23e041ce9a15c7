"""A batched prefill step's chunks on several prefill threads (`prefill_threads`): every prompt's
state bytes, last logits, prompt logprobs and first token are the same with 1, 2 and 3 threads,
from the first step (fresh worker threads) on; and the negative control: the same comparison sees
the difference that one GEMM over the step's chunks makes (so it could see a thread's)."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch
from torch import Tensor

from shared.engine.paged.engine import PagedEngine, PagedPrefillRun
from shared.engine.paged.families import SUPPORTED_FAMILIES
from shared.engine.prefill_chunks import chunk_ends
from shared.engine.protocol import PrefillChunk
from tests.unit.engine_batched.helpers import BlockPool, paged_engine, prompt_of

CHUNK = 16  # prompts of 1..60 tokens: up to four steps, the steps holding fewer and fewer chunks
PROMPTS = 9
SCORED = 4  # this prompt also keeps its prompt logprobs (every row's logits)

Prefilled = tuple[list[int | None], list[Tensor], list[list[object]], list[Tensor]]


def _run(engine: PagedEngine) -> Prefilled:
    """Every prompt's first token, last logits and prompt logprobs, and the bytes of every cache
    region, after prefilling all prompts in batched steps (one chunk of each live run a step)."""
    pool = BlockPool(engine.layout)
    prompts = [prompt_of(1 + (13 * i) % 60, salt=i) for i in range(PROMPTS)]
    runs = [engine.start_prefill(p, pool.blocks(len(p), f"r{i}")) for i, p in enumerate(prompts)]
    runs[SCORED].score_prompt(3)
    ends = [chunk_ends(0, engine.num_prefill_tokens(len(p)), CHUNK) for p in prompts]
    firsts: list[int | None] = [None] * PROMPTS
    for step in range(max(len(e) for e in ends)):
        live = [i for i, e in enumerate(ends) if step < len(e)]
        for i, first in zip(live, engine.prefill_batch([PrefillChunk(runs[i], ends[i][step]) for i in live])):
            firsts[i] = first
    logits = []
    for run in runs:
        assert run.last_logits is not None
        logits.append(run.last_logits.clone())
    logprobs: list[list[object]] = [list(run.prompt_logprobs) for run in runs]
    return firsts, logits, logprobs, [region.clone() for rank in engine.ranks for region in rank.cache.regions]


def _same(a: Prefilled, b: Prefilled) -> bool:
    firsts_a, logits_a, logprobs_a, caches_a = a
    firsts_b, logits_b, logprobs_b, caches_b = b
    return (
        firsts_a == firsts_b
        and logprobs_a == logprobs_b
        and all(torch.equal(x, y) for x, y in zip(logits_a, logits_b, strict=True))
        and all(torch.equal(x, y) for x, y in zip(caches_a, caches_b, strict=True))
    )


def _threaded(directory: str, threads: int, dtype: str = "fp32") -> Prefilled:
    engine = paged_engine(directory, dtype=dtype, chunk=CHUNK, prefill_threads=threads)
    got = _run(engine)
    # The steps really ran on workers (a split that never happened would pass trivially).
    assert (engine._group_workers is not None) == (threads > 1)
    return got


@pytest.mark.parametrize("family", SUPPORTED_FAMILIES)
def test_chunks_on_several_threads_give_one_threads_bytes(family: str, hf_checkpoint: Callable[[str], str]) -> None:
    directory = hf_checkpoint(family)
    one = _threaded(directory, 1)
    for threads in (2, 3):
        assert _same(one, _threaded(directory, threads)), (family, threads)


def test_bf16_chunks_on_several_threads_give_one_threads_bytes(hf_checkpoint: Callable[[str], str]) -> None:
    directory = hf_checkpoint("nemotron_h")
    one = _threaded(directory, 1, "bf16")
    assert _same(one, _threaded(directory, 3, "bf16"))


def test_negative_control_the_comparison_sees_other_bits(hf_checkpoint: Callable[[str], str]) -> None:
    directory = hf_checkpoint("nemotron_h")
    packed = paged_engine(directory, invariant=False, chunk=CHUNK, prefill_threads=3)
    assert not _same(_threaded(directory, 1), _run(packed)), "one GEMM over the step's chunks gave the groups' bits"


def test_prefill_threads_must_be_positive(hf_checkpoint: Callable[[str], str]) -> None:
    engine = paged_engine(hf_checkpoint("nemotron_h"))
    with pytest.raises(ValueError, match="prefill_threads"):
        PagedEngine(engine.layout, engine.ranks, engine.checkpoint, prefill_threads=0)


class _Failed(RuntimeError):
    pass


def _two_groups(directory: str) -> tuple[PagedEngine, list[PagedPrefillRun]]:
    """Two runs on 2 threads: the 60-token one on the calling thread, the 20-token one on a worker."""
    engine = paged_engine(directory, prefill_threads=2)
    pool = BlockPool(engine.layout)
    prompts = [prompt_of(60, salt=1), prompt_of(20, salt=2)]
    return engine, [engine.start_prefill(p, pool.blocks(len(p), f"r{i}")) for i, p in enumerate(prompts)]


def _fail_kv_writes(run: PagedPrefillRun, failed: threading.Event | None = None) -> None:
    def fail(layer: int, start: int, k: Tensor, v: Tensor) -> None:
        if failed is not None:
            failed.set()
        raise _Failed(f"layer {layer}")

    run._store.write_kv_range = fail  # type: ignore[method-assign]


def test_a_workers_error_reaches_the_step(hf_checkpoint: Callable[[str], str]) -> None:
    engine, runs = _two_groups(hf_checkpoint("nemotron_h"))
    _fail_kv_writes(runs[1])
    with pytest.raises(_Failed):
        engine.prefill_batch([PrefillChunk(run, engine.num_prefill_tokens(len(run._prompt))) for run in runs])


def test_the_step_ends_only_once_every_group_has(hf_checkpoint: Callable[[str], str]) -> None:
    """The calling thread's group fails while the worker's group waits to write its SSM state;
    the worker has still written all of it when the error reaches the caller (no worker writes
    blocks after the step)."""
    engine, runs = _two_groups(hf_checkpoint("nemotron_h"))
    failed = threading.Event()
    _fail_kv_writes(runs[0], failed)
    written: list[int] = []
    store = runs[1]._store
    write_ssm = store.write_ssm

    def after_the_failure(layer: int, conv: Tensor, ssm: Tensor) -> None:
        failed.wait(timeout=60)  # a bound only against a hang: the caller fails within the step
        write_ssm(layer, conv, ssm)
        written.append(layer)

    store.write_ssm = after_the_failure  # type: ignore[method-assign]
    with pytest.raises(_Failed):
        engine.prefill_batch([PrefillChunk(run, engine.num_prefill_tokens(len(run._prompt))) for run in runs])
    assert written == list(engine.spec.ssm_layers)


def test_a_step_with_layer_reports_stays_on_the_calling_thread(hf_checkpoint: Callable[[str], str]) -> None:
    """The 20-token run reports its layers (`on_layer`): split, it would compute on the worker."""
    engine, runs = _two_groups(hf_checkpoint("nemotron_h"))
    reported: list[threading.Thread] = []
    ends = [engine.num_prefill_tokens(len(run._prompt)) for run in runs]
    engine.prefill_batch(
        [PrefillChunk(runs[0], ends[0]), PrefillChunk(runs[1], ends[1], lambda _: reported.append(threading.current_thread()))]
    )
    assert len(reported) == engine.spec.num_layers
    assert set(reported) == {threading.current_thread()}
