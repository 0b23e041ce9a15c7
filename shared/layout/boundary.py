"""Where prefill stops and decode takes over: the boundary the manifest states explicitly.

`n-1` (vLLM's convention, the default): with SSM layers prefill computes all but the last
prompt token, because a recurrent state cannot be rolled back and must not see that token twice;
decode computes the last one. Attention-only models transfer every prompt token. `full`: prefill
computes all N prompt tokens (and samples the first output token itself).
"""

from __future__ import annotations

from typing import Literal

from shared.layout.spec import ModelSpec

Boundary = Literal["n-1", "full"]
BOUNDARIES: tuple[Boundary, ...] = ("n-1", "full")


def num_prefill_tokens(spec: ModelSpec, prompt_len: int, boundary: Boundary = "n-1") -> int:
    """Prompt tokens whose state prefill computes and decode reads."""
    if prompt_len < 1:
        raise ValueError("empty prompt: at least one token is needed")
    if boundary == "full" or not spec.ssm_layers:
        return prompt_len
    return prompt_len - 1
