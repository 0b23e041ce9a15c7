"""Bytes moved per request against prompt length, from the layout math alone.

Attention K/V grows with the prompt; conv and SSM state is one fixed-size block per layer
whatever the length. The crossover is the shortest prompt whose K/V outweighs the SSM-side
state: below it a hybrid model moves mostly recurrent state, above it mostly K/V. Counted
with the same read lists and descriptor ids the decode service uses, so the numbers are the
bytes a real transfer moves for that (prefill TP, decode TP) pair.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hybridpd_tools.bench.pairs import fake_bases, pair_lists, request_reads, total_sections
from hybridpd_tools.bench.sections import SectionBytes
from hybridpd_tools.bench.sizing import blocks_needed, prefill_tokens, request_blocks
from shared.layout.page import EngineLayout
from shared.layout.plan import build_plan

DEFAULT_LENGTHS = tuple(2**k for k in range(4, 18))  # 16 ... 131072 tokens


@dataclass(frozen=True)
class CrossoverPoint:
    prompt_tokens: int
    bytes: SectionBytes


@dataclass(frozen=True)
class Crossover:
    points: tuple[CrossoverPoint, ...]

    @property
    def crossover_tokens(self) -> int | None:
        """Shortest measured prompt whose FA bytes reach the conv + SSM bytes (None: none does)."""
        for p in self.points:
            if p.bytes.fa >= p.bytes.conv + p.bytes.ssm:
                return p.prompt_tokens
        return None

    @property
    def crossover_estimate_tokens(self) -> float | None:
        """Where FA bytes meet conv + SSM bytes, interpolated between the two bracketing lengths."""
        prev: CrossoverPoint | None = None
        for p in self.points:
            fixed = p.bytes.conv + p.bytes.ssm
            if p.bytes.fa >= fixed:
                if prev is None or p.bytes.fa == prev.bytes.fa:
                    return float(p.prompt_tokens)
                share = (fixed - prev.bytes.fa) / (p.bytes.fa - prev.bytes.fa)
                return prev.prompt_tokens + share * (p.prompt_tokens - prev.prompt_tokens)
            prev = p
        return None

    def as_dict(self) -> dict[str, object]:
        return {
            "prompt_tokens": [p.prompt_tokens for p in self.points],
            "fa_bytes": [p.bytes.fa for p in self.points],
            "conv_bytes": [p.bytes.conv for p in self.points],
            "ssm_bytes": [p.bytes.ssm for p in self.points],
            "total_bytes": [p.bytes.total for p in self.points],
            "crossover_tokens": self.crossover_tokens,
            "crossover_estimate_tokens": self.crossover_estimate_tokens,
        }


def bytes_by_prompt_length(prefill: EngineLayout, decode: EngineLayout, lengths: Sequence[int] = DEFAULT_LENGTHS) -> Crossover:
    plan = build_plan(prefill, decode)
    spec = prefill.spec
    longest = prefill_tokens(spec, max(lengths))
    p_blocks, d_blocks = blocks_needed(prefill, longest), blocks_needed(decode, longest)
    pairs = pair_lists(
        plan,
        local_bases=fake_bases(decode.tp, decode.num_regions, decode.region_bytes(d_blocks), side=1),
        remote_bases=fake_bases(prefill.tp, prefill.num_regions, prefill.region_bytes(p_blocks), side=2),
        local_num_blocks=d_blocks,
        remote_num_blocks=p_blocks,
    )
    points = []
    for n in sorted(lengths):
        tokens = prefill_tokens(spec, n)
        reads = request_reads(pairs, request_blocks(decode, tokens), request_blocks(prefill, tokens), tokens)
        points.append(CrossoverPoint(n, total_sections(reads)))
    return Crossover(tuple(points))
