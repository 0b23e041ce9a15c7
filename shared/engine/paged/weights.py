"""A checkpoint's config and tensors, read without building the transformers model.

config.json goes through AutoConfig (local files only), which fills every default the modeling
code would use; the tensors come straight from the *.safetensors files, cast to the compute
dtype on the chosen device. Multimodal wrappers (qwen3_5, qwen3_5_moe) serve their text model.
"""

from __future__ import annotations

import glob
import os
from typing import Any

import torch
from torch import Tensor

from shared.engine.hf.identity import CheckpointError


def load_config(directory: str) -> Any:
    """The checkpoint's transformers config (the text config of a multimodal wrapper)."""
    from transformers import AutoConfig

    try:
        config: Any = AutoConfig.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise CheckpointError(f"{directory}: transformers cannot read config.json: {e}") from None
    text = getattr(config, "text_config", None)
    return text if text is not None and config.model_type in ("qwen3_5", "qwen3_5_moe") else config


class Weights:
    """Named tensors of one checkpoint; `take` hands each out once so leftovers can be reported."""

    def __init__(self, directory: str, dtype: torch.dtype, device: torch.device) -> None:
        from safetensors import safe_open

        files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
        if not files:
            raise CheckpointError(f"{directory}: no *.safetensors files")
        self.dtype, self.device = dtype, device
        self._tensors: dict[str, Tensor] = {}
        for path in files:
            with safe_open(path, "pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    self._tensors[name] = f.get_tensor(name)

    def names(self) -> list[str]:
        return sorted(self._tensors)

    def has(self, name: str) -> bool:
        return name in self._tensors

    def get(self, name: str, *, fp32: bool = False) -> Tensor:
        """Tensor `name` in the compute dtype (`fp32`: in fp32, for SSM decays and the like)."""
        try:
            t = self._tensors[name]
        except KeyError:
            raise CheckpointError(f"weight {name!r} missing from the checkpoint") from None
        return t.to(device=self.device, dtype=torch.float32 if fp32 else self.dtype).contiguous()

    def maybe(self, name: str) -> Tensor | None:
        return self.get(name) if name in self._tensors else None
