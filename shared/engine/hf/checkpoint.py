"""A Hugging Face checkpoint directory loaded for serving: model, EOS ids, one forward call.

Loaded with AutoConfig / AutoModelForCausalLM (local files only: nothing is ever downloaded).
A multimodal wrapper (qwen3_5, qwen3_5_moe) loads as its language model. A checkpoint that
leaves weights missing is refused: transformers would initialise them at random, differently
in every process, and prefill and decode would then run different models.

`forward` runs the way generate() runs (explicit position ids, no attention mask for an
unpadded request, logits of the last position only), which is what makes a resumed request
bit-identical to generate().
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from shared.cache.model_views import torch_dtype
from shared.engine.compute_threads import pin_intra_op_threads
from shared.engine.hf.identity import CheckpointError
from shared.logs.third_party import kernel_fallbacks_note, transformers_module


def _transformers() -> Any:
    """transformers, untyped (its signatures do not type-check under --strict); its progress bars
    off and its logs through ours (shared/logs/third_party.py)."""
    return transformers_module()


def _eos_ids(directory: str, config: Any) -> frozenset[int]:
    eos: Any = None
    if os.path.isfile(os.path.join(directory, "generation_config.json")):
        eos = _transformers().GenerationConfig.from_pretrained(directory, local_files_only=True).eos_token_id
    if eos is None:
        eos = getattr(config, "eos_token_id", None)
    if eos is None:
        return frozenset()
    return frozenset(int(i) for i in (eos if isinstance(eos, (list, tuple)) else [eos]))


def decoder_layers(model: Any) -> list[Any] | None:
    """The model's decoder layers in execution order (one per cache layer), found generically:
    `get_decoder().layers`, else `model.model.layers`; None where neither is a module list."""
    holders = [getattr(model, "model", None)]
    with contextlib.suppress(AttributeError, NotImplementedError, ValueError):  # no get_decoder, or no rule
        holders.insert(0, model.get_decoder())
    for holder in holders:
        layers = getattr(holder, "layers", None)
        if isinstance(layers, torch.nn.ModuleList):
            return list(layers)
    return None


class HfCheckpoint:
    def __init__(self, directory: str, *, dtype: str, device: str = "cpu") -> None:
        self.directory = directory
        self.dtype = torch_dtype(dtype)
        self.device = torch.device(device)
        try:
            model, info = _transformers().AutoModelForCausalLM.from_pretrained(
                directory, local_files_only=True, dtype=self.dtype, output_loading_info=True
            )
        except (OSError, ValueError, KeyError) as e:
            raise CheckpointError(f"{directory}: transformers cannot load the checkpoint: {e}") from None
        missing = sorted(info.get("missing_keys") or ())
        if missing:
            shown = ", ".join(missing[:4]) + (", ..." if len(missing) > 4 else "")
            raise CheckpointError(f"{directory}: {len(missing)} weights missing from the checkpoint ({shown})")
        self.model: Any = model.to(self.device).eval().requires_grad_(False)
        self.config: Any = self.model.config
        self.vocab_size = int(self.model.get_output_embeddings().weight.shape[0])
        self.eos_token_ids = _eos_ids(directory, self.config)

    def new_cache(self) -> Any:
        return _transformers().DynamicCache(config=self.config)

    @torch.no_grad()
    def forward(self, ids: Sequence[int], start: int, cache: Any) -> Tensor:
        """Run tokens `ids` at positions start.. on `cache` (updated in place); logits of the last one."""
        return self._forward(ids, start, cache, 1)[-1]

    def forward_all(self, ids: Sequence[int], start: int, cache: Any) -> Tensor:
        """`forward`, with the logits of every token [len(ids), vocab] (prompt logprobs). The
        last row comes out of the same matmul as the others, so its bits may differ from
        `forward`'s."""
        return self._forward(ids, start, cache, 0)

    def _forward(self, ids: Sequence[int], start: int, cache: Any, keep: int) -> Tensor:
        # Bits must not depend on the core count or on which thread calls (see compute_threads).
        pin_intra_op_threads(1)
        input_ids = torch.tensor([list(ids)], dtype=torch.long, device=self.device)
        positions = torch.arange(start, start + len(ids), dtype=torch.long, device=self.device).unsqueeze(0)
        # Explicit positions always: Bamba otherwise puts every resumed token at position 0.
        out = self.model(input_ids=input_ids, cache=cache, position_ids=positions, use_cache=True, logits_to_keep=keep)
        kernel_fallbacks_note()  # transformers' first calls may have fallen back to PyTorch kernels: said once
        logits: Tensor = out.logits[0]
        return logits
