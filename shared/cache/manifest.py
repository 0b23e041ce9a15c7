"""A prefilled request's state as decode learns it: which blocks hold it, for how long, and the
digests prefill took of it. The domain form of `hybridpd.v1.Manifest`, converted once at each
service's edge (shared/rpc/manifest_message.py); pure, no I/O.

Times are integral nanoseconds, as the message carries them, so a manifest survives the trip to
the wire and back unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from shared.cache.digest import SectionDigest
from shared.token_logprobs import TokenLogprobs

IntArray = npt.NDArray[np.int64]


@dataclass(frozen=True)
class ManifestPart:
    """Which part of the state a manifest carries (pipelined transfer): the attention K/V of
    tokens [tokens_from, tokens_to) of every attention group, final; the last part also the
    conv and SSM state. A layer part (`layers`) covers only those model layers of the last
    chunk's tokens: their K/V, and the conv and SSM state of its SSM layers. See
    `hybridpd.v1.ManifestPart`."""

    index: int
    count: int
    tokens_from: int
    tokens_to: int
    layers: range | None = None  # None: every layer

    @property
    def last(self) -> bool:
        return self.index == self.count - 1

    def describe(self) -> str:
        layers = "" if self.layers is None else f", layers {self.layers.start}..{self.layers.stop}"
        return f"part {self.index + 1} of {self.count} (tokens {self.tokens_from}..{self.tokens_to}{layers})"


@dataclass(frozen=True)
class Manifest:
    request_id: str
    transfer_id: str  # the notification payload the READs carry
    block_ids: tuple[IntArray, ...]  # per group of the prefill layout, in group order
    num_computed_tokens: int  # prompt tokens whose state sits in the blocks
    prompt_token_count: int
    lease_ns: int  # lease left when prefill sent the manifest
    lease_expire_time_ns: int  # prefill's wall clock, for people; timers use lease_ns
    prefill_ns: int  # prefill's compute, digests included
    digests: tuple[SectionDigest, ...] = ()
    digest_algorithm: str = ""  # "" when prefill took no digests
    digest_ns: int = 0
    # The full-N boundary: the first output token prefill sampled (None at n-1).
    first_token: int | None = None
    # Decode's prefix cache: leading prompt tokens whose K/V decode already holds, so the FA
    # digests cover no K/V before it and decode READs none (every part repeats it).
    skipped_tokens: int = 0
    # One part of the state (pipelined transfer); None: the whole state in this one manifest.
    part: ManifestPart | None = None
    # The engine's own model calls for the prompt (part of prefill_ns; parts: the sum so far).
    engine_ns: int = 0
    # With first_token, for a job that asked: its logprobs.
    first_logprobs: TokenLogprobs | None = None
    # For a job that asked (the last part only): prompt tokens 1..N-1's logprobs.
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = None
    # With first_token, for a job with fork seeds: output token 0 drawn with each, and their logprobs.
    fork_first_tokens: tuple[int, ...] = ()
    fork_first_logprobs: tuple[TokenLogprobs, ...] = ()

    @property
    def last(self) -> bool:
        """Whether this manifest completes the state (a whole-state manifest, or the last part)."""
        return self.part is None or self.part.last

    @property
    def ends_prompt(self) -> bool:
        """Whether this manifest's token range reaches the end of the computed tokens, so it
        carries the conv and SSM state of its layers (every layer part, the last token part)."""
        return self.tokens_to == self.num_computed_tokens

    @property
    def layers(self) -> range | None:
        """The model layers whose state this manifest carries (None: every layer)."""
        return None if self.part is None else self.part.layers

    @property
    def tokens_from(self) -> int:
        """First token whose attention K/V this manifest makes final (the K/V before it is
        decode's prefix cache's, or an earlier part's)."""
        return self.skipped_tokens if self.part is None else self.part.tokens_from

    @property
    def tokens_to(self) -> int:
        """End of the tokens whose attention K/V this manifest makes final."""
        return self.num_computed_tokens if self.part is None else self.part.tokens_to

    @property
    def lease_seconds(self) -> float:
        return self.lease_ns / 1e9

    def __eq__(self, other: object) -> bool:  # arrays compare by value
        if not isinstance(other, Manifest):
            return NotImplemented
        same_blocks = len(self.block_ids) == len(other.block_ids) and all(
            np.array_equal(a, b) for a, b in zip(self.block_ids, other.block_ids)
        )
        fields = ("request_id", "transfer_id", "num_computed_tokens", "prompt_token_count", "lease_ns")
        more = ("lease_expire_time_ns", "prefill_ns", "digests", "digest_algorithm", "digest_ns", "engine_ns")
        parts = ("first_token", "part", "skipped_tokens", "first_logprobs", "prompt_logprobs")
        forks = ("fork_first_tokens", "fork_first_logprobs")
        return same_blocks and all(getattr(self, f) == getattr(other, f) for f in (*fields, *more, *parts, *forks))

    __hash__ = None  # type: ignore[assignment]
