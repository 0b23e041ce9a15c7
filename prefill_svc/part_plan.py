"""Where a chunked prefill sends manifest parts (pipelined transfer); pure.

Prefill computes the first `computed` tokens in chunks of `chunk_tokens`. After a chunk, the
attention K/V of every whole block of the prefill layout whose every token is computed is
final (later chunks never write it again), and a part names the blocks that became final since
the previous part. A chunk that completes no new block sends nothing; with `part_tokens`, neither
does one after which fewer than that many tokens became final, except the chunk before the last
(so what is left to move after the prompt stays one chunk), since every part costs the same
fixed work on both sides (a digest call, a message, a READ, a check) whatever its size. The last
part covers the rest, up to `computed`, and the conv and SSM state, final only then. The plan is known before
the first chunk, so prefill knows how many READ notifications to expect per reader (one per
part). With decode's prefix cache, the parts start after the cached prefix (`tokens_from`): the
chunks still compute from token 0 (or from a boundary prefill kept), but only blocks that end
after it become parts.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PartSpan:
    compute_to: int  # compute up to this token before sending the part (a chunk end)
    tokens_from: int  # the part makes the K/V of tokens [tokens_from, tokens_to) final
    tokens_to: int


def part_spans(
    computed: int, chunk_tokens: int, block_tokens: int, *, tokens_from: int = 0, part_tokens: int = 0
) -> list[PartSpan]:
    """The parts of a prefill of `computed` tokens; one span (the whole state, no parts) when
    chunking is off, the prompt fits one chunk, or no block completes before the last chunk.
    `block_tokens`: tokens per block of the prefill layout's attention groups (0: none).
    `tokens_from`: the K/V before it is decode's already (its prefix cache), so the first part
    starts there and a chunk that completes no block after it sends nothing. `part_tokens`: the
    least tokens a part but the last two carries (0: a part after every chunk that completes a block)."""
    if chunk_tokens <= 0 or block_tokens <= 0 or computed <= chunk_tokens:
        return [PartSpan(computed, tokens_from, computed)]
    spans: list[PartSpan] = []
    final = tokens_from
    ends = range(chunk_tokens, computed, chunk_tokens)  # every chunk's end but the last's
    for end in ends:
        whole = end // block_tokens * block_tokens
        if whole > final and (whole - final >= part_tokens or end == ends[-1]):
            spans.append(PartSpan(end, final, whole))
            final = whole
    spans.append(PartSpan(computed, final, computed))
    return spans
