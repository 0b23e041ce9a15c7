"""The full-N boundary against transformers' own generate(do_sample=False): disaggregated tokens
AND logits bit for bit, fp32 and bf16, every family; EOS from generation_config stops both.

At the N-1 boundary transformers is close but not bit-identical (a chunked scan over N tokens
and a step of the last token sum in different orders): in fp32 the tokens agree here and the
logits stay within 1e-4 (about 1e-5 seen); in bf16 nothing is claimed (tokens may diverge).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from shared.engine.hf.colocated import colocated_generate
from shared.engine.hf.tiny_checkpoints import FAMILIES
from tests.unit.engine_hf.helpers import checkpoint, disaggregated, engine, transformers_generate

PROMPTS = ([11, 4, 29, 77, 5, 16, 140, 9, 63, 22, 31, 8, 57, 19, 101, 44], [42])
MAX_TOKENS = 8


def _upto_eos(tokens: list[int], eos: frozenset[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1]
    return tokens


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_full_n_is_generate_bit_for_bit(family: str, dtype: str, hf_checkpoint: Callable[[str], str]) -> None:
    directory = hf_checkpoint(family)
    ckpt = checkpoint(directory, dtype)
    prefill, decode = engine(directory, 2, dtype=dtype), engine(directory, 4, dtype=dtype)
    for prompt in PROMPTS:
        want_tokens, want_logits = transformers_generate(ckpt.model, prompt, MAX_TOKENS)
        run = disaggregated(prefill, decode, prompt, MAX_TOKENS)
        got = _upto_eos(run.tokens, ckpt.eos_token_ids)
        assert got == want_tokens, (family, dtype, prompt)
        # Logits of every token decode computed (the first one is prefill's sample).
        for i in range(1, len(got)):
            logits = run.logits[i]
            assert logits is not None and torch.equal(logits.float(), want_logits[i]), (family, dtype, i)
        assert colocated_generate(ckpt, prompt, MAX_TOKENS).token_ids == want_tokens  # EOS stops it too


@pytest.mark.parametrize("family", FAMILIES)
def test_n_minus_1_is_close_to_generate_in_fp32(family: str, hf_checkpoint: Callable[[str], str]) -> None:
    directory = hf_checkpoint(family)
    ckpt = checkpoint(directory)
    prompt = PROMPTS[0]
    want_tokens, want_logits = transformers_generate(ckpt.model, prompt, MAX_TOKENS)
    run = disaggregated(engine(directory, 1, boundary="n-1"), engine(directory, 2, boundary="n-1"), prompt, MAX_TOKENS)
    got = _upto_eos(run.tokens, ckpt.eos_token_ids)
    assert got == want_tokens
    worst = max(float((logits.float() - want).abs().max()) for logits, want in zip(run.logits, want_logits) if logits is not None)
    assert 0 < worst < 1e-4  # close (fp32 rounding at these logit scales), and not bit-identical
