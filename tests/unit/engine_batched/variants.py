"""The tiny checkpoint variants the paged engine serves (routed experts of Nemotron-H, scaled
RoPE) and those it leaves to the hf engine."""

from __future__ import annotations

PAGED_VARIANTS: tuple[str, ...] = ("moe", "moe-latent", "rope-linear", "rope-llama3", "rope-yarn")
HF_ONLY_VARIANTS: tuple[str, ...] = ("rope-dynamic", "rope-longrope")
# Variants whose tokens are routed to experts (bf16 is compared as MOE_FAMILIES are).
ROUTED_VARIANTS: tuple[str, ...] = ("moe", "moe-latent")
