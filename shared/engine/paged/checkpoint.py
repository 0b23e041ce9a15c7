"""A checkpoint directory loaded for the paged engine: config, model math, EOS ids."""

from __future__ import annotations

from typing import Any

import torch

from shared.cache.model_views import torch_dtype
from shared.engine.hf.checkpoint import _eos_ids
from shared.engine.paged.families import check_family
from shared.engine.paged.gemm_layout import lay_out
from shared.engine.paged.model import Model
from shared.engine.paged.weights import Weights, load_config


class PagedCheckpoint:
    def __init__(self, directory: str, *, dtype: str, device: str = "cpu") -> None:
        self.directory = directory
        self.dtype = torch_dtype(dtype)
        self.device = torch.device(device)
        self.config: Any = load_config(directory)
        # The family is checked before any tensor is read: an unsupported one fails fast.
        builder = check_family(str(self.config.model_type))
        self.model: Model = builder(self.config, Weights(directory, self.dtype, self.device))
        lay_out(self.model)
        self.vocab_size = self.model.vocab_size
        self.eos_token_ids = _eos_ids(directory, self.config)
