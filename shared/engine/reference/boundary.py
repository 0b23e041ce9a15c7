"""The prefill/decode split: the N-1 protocol, and a split at any boundary for invariance tests.

N-1 protocol (vLLM PR #37310 for SSM models): prefill computes prompt tokens `0..N-2`; decode
computes token `N-1` from the transferred state (never applying it twice), samples, continues.
A prompt of length 1 leaves prefill nothing to compute.
"""

from __future__ import annotations

from collections.abc import Sequence

from shared.engine.reference.model import ReferenceModel, greedy
from shared.engine.reference.state_store import StateStore, read_global_state, write_global_state


def num_prefill_tokens(prompt_len: int) -> int:
    """Tokens the prefill side computes under the N-1 protocol."""
    if prompt_len < 1:
        raise ValueError("empty prompt: at least one token is needed")
    return prompt_len - 1


def prefill_part(model: ReferenceModel, prompt: Sequence[int], store: StateStore) -> int:
    """Prefill side: compute prompt tokens `0..N-2` into `store`; return how many (N-1)."""
    n = num_prefill_tokens(len(prompt))
    model.prefill(prompt[:n], store)
    return n


def decode_part(model: ReferenceModel, last_prompt_token: int, pos: int, store: StateStore, max_tokens: int) -> list[int]:
    """Decode side: compute `last_prompt_token` at `pos` (= N-1) from `store`, then generate."""
    return model.decode(last_prompt_token, pos, store, max_tokens)


def split_generate(model: ReferenceModel, prompt: Sequence[int], max_tokens: int, boundary: int) -> list[int]:
    """Prefill tokens `[0, boundary)` in one store, copy the state into a fresh store (a perfect
    transfer), and finish there. `boundary` in `[0, N]`; at N the prefill side also samples the
    first token (the alternative protocol)."""
    n = len(prompt)
    if not 0 <= boundary <= n or n == 0:
        raise ValueError(f"boundary {boundary} outside [0, {n}] or empty prompt")
    source = model.new_store()
    logits = model.prefill(prompt[:boundary], source)
    target = model.new_store()
    write_global_state(target, read_global_state(source, model.spec, boundary))
    if max_tokens <= 0:
        return []
    if boundary < n:
        logits = model.prefill(prompt[boundary:], target, start_pos=boundary)
        assert logits is not None
        return model.continue_greedy(logits, n, target, max_tokens)
    assert logits is not None
    first = greedy(logits)
    return [first, *model.decode(first, n, target, max_tokens - 1)]
