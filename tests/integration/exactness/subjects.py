"""What an exactness suite runs on: an engine, the model it loads, and the colocated run its
disaggregated tokens must equal.

The reference engine runs a tiny preset, compared with the reference model's own colocated run.
The paged engine (the batched one, the default for a checkpoint directory) runs a tiny seeded
checkpoint built on first use (nothing downloaded), compared with the colocated runner of the
same engine at the same boundary (full, its default) and in the same prefill chunks. Its prefix
K/V is stable only in whole chunks (`Engine.prefix_stable_unit`), so a subject that reuses
prefixes runs prefill with `--prefill-chunk-tokens`; the chunk divides every block size the
suites use, so a block's K/V are reusable as soon as the block is full, as on the reference engine.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from functools import cache
from typing import Any

from shared.engine.hf.model_spec import hf_model_spec
from shared.engine.hf.tiny_checkpoints import cached_checkpoint
from shared.engine.reference.colocated import colocated_generate
from shared.layout.boundary import Boundary, num_prefill_tokens
from shared.layout.presets import TINY_PRESETS
from shared.layout.spec import ModelSpec
from tests.integration.exactness.pair import RunningPair, service_pair
from tests.integration.services.colocated_tokens import colocated_tokens


@dataclass(frozen=True)
class Subject:
    engine: str  # "reference" or "paged"
    name: str  # a tiny preset (reference) or a checkpoint family (paged)
    prefill_chunk_tokens: int = 0  # prefill's --prefill-chunk-tokens (0: one forward)
    at_boundary: Boundary | None = None  # --boundary on both sides (None: the engine's default)

    @property
    def id(self) -> str:
        return f"{self.engine}-{self.name}" + (f"-{self.at_boundary}" if self.at_boundary else "")

    @property
    def model(self) -> str:
        """What --model names: the preset, or the checkpoint's directory."""
        return self.name if self.engine == "reference" else cached_checkpoint(self.name)

    @property
    def spec(self) -> ModelSpec:
        return TINY_PRESETS[self.name] if self.engine == "reference" else hf_model_spec(self.model)

    @property
    def boundary(self) -> Boundary:
        """The boundary both services run at: as set, else the engine's default."""
        return self.at_boundary or ("n-1" if self.engine == "reference" else "full")

    @property
    def flags(self) -> tuple[str, ...]:
        """Both services' flags."""
        return ("--boundary", self.at_boundary) if self.at_boundary else ()

    @property
    def prefill_flags(self) -> tuple[str, ...]:
        chunks = ("--prefill-chunk-tokens", str(self.prefill_chunk_tokens)) if self.prefill_chunk_tokens else ()
        return (*self.flags, *chunks)

    def computed(self, prompt_len: int) -> int:
        """Prompt tokens prefill computes (and decode READs) for a prompt of `prompt_len`."""
        return num_prefill_tokens(self.spec, prompt_len, self.boundary)

    def prompt_len(self, computed: int) -> int:
        """The prompt length whose prefill computes `computed` tokens (n-1: one more)."""
        return computed + (self.boundary == "n-1")

    def in_chunks_of(self, tokens: int) -> Subject:
        """The same subject with prefill in chunks of `tokens` (the reference engine's bits do not
        depend on them)."""
        return replace(self, prefill_chunk_tokens=tokens)

    async def expected(self, prompt: Sequence[int], max_tokens: int) -> list[int]:
        """The colocated run's tokens for `prompt`."""
        return list(await _expected(self, tuple(prompt), max_tokens))


@cache
def _colocated_reference(name: str, prompt: tuple[int, ...], max_tokens: int) -> tuple[int, ...]:
    return tuple(colocated_generate(TINY_PRESETS[name], list(prompt), max_tokens))


_PAGED_RUNS: dict[tuple[Subject, tuple[int, ...], int], tuple[int, ...]] = {}


async def _expected(subject: Subject, prompt: tuple[int, ...], max_tokens: int) -> tuple[int, ...]:
    if subject.engine == "reference":
        return _colocated_reference(subject.name, prompt, max_tokens)
    key = (subject, prompt, max_tokens)
    if key not in _PAGED_RUNS:
        _PAGED_RUNS[key] = tuple(
            await colocated_tokens(
                "paged",
                subject.model,
                prompt,
                max_tokens,
                prefill_chunk_tokens=subject.prefill_chunk_tokens,
                boundary=subject.boundary,
            )
        )
    return _PAGED_RUNS[key]


# The representative subjects: one reference preset (the suites' own), one paged family. A paged
# subject that reuses prefixes needs prefill chunks (16 divides the blocks of 16, 32 and 64 tokens).
REFERENCE = Subject("reference", "tiny-mamba2")
PAGED = Subject("paged", "nemotron_h", prefill_chunk_tokens=16)


@asynccontextmanager
async def subject_pair(
    subject: Subject,
    prefill_tp: int,
    decode_tp: int,
    *,
    extra_prefill: Sequence[str] = (),
    extra_decode: Sequence[str] = (),
    **kwargs: Any,
) -> AsyncIterator[RunningPair]:
    """`service_pair` of the subject's engine and model, prefill in the subject's chunks."""
    async with service_pair(
        subject.model,
        prefill_tp,
        decode_tp,
        engine=subject.engine,
        extra_prefill=[*subject.prefill_flags, *extra_prefill],
        extra_decode=[*subject.flags, *extra_decode],
        **kwargs,
    ) as pair:
        yield pair
