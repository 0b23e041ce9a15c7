"""Multi-turn conversations against a running pair, for the prefix-cache tests: every turn extends
the previous prompt with its answer and new tokens, and must equal the colocated run."""

from __future__ import annotations

import numpy as np

from tests.integration.exactness.pair import Generated, RunningPair
from tests.integration.exactness.subjects import Subject

ANSWER = 4  # tokens generated per turn


def random_tokens(seed: int, count: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 256, count)]


async def run_turns(pair: RunningPair, subject: Subject, prompt: list[int], added: int, turns: int, seed: int) -> list[Generated]:
    """Run `turns` turns, each extending the last prompt and answer by `added` tokens; every
    turn's tokens must equal the subject's colocated run."""
    rng = np.random.default_rng(seed + 1)
    out = []
    for t in range(turns):
        got = await pair.generate(prompt, ANSWER, request_id=f"c{seed}-t{t}")
        assert got.token_ids == await subject.expected(prompt, ANSWER), (subject.id, t)
        out.append(got)
        prompt = [*prompt, *got.token_ids, *(int(x) for x in rng.integers(0, 256, added))]
    return out


def fa_unit_tokens(pair: RunningPair) -> int:
    """Tokens per attention READ unit of the pair's first (decode rank, prefill rank) lists."""
    link = pair.decode.peers.peers[0].link
    assert link is not None
    return link.pairs[0].lists.fa_unit_tokens
