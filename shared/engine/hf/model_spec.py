"""The `ModelSpec` the hf engine serves a checkpoint directory with.

The layout comes from config.json as for every engine. Two things differ from a bare config:
the state dtypes are the ones transformers computes in (K/V and conv state in the compute
dtype, recurrent state in fp32 in every family, bf16 models included), so moving state through
the paged blocks loses no bit; and the checkpoint digest (config content + weights) is the
model's identity at handshake.
"""

from __future__ import annotations

import json
import os
from typing import Any

from shared.engine.hf.identity import CheckpointError, checkpoint_digest
from shared.layout.hf_config import parse_dtype
from shared.layout.models import load_model
from shared.layout.spec import DType, ModelSpec

COMPUTE_DTYPES: tuple[DType, ...] = ("fp32", "bf16", "fp16")


def _config(directory: str) -> dict[str, Any]:
    path = os.path.join(directory, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {path}: {e}") from None
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{path}: a config.json must hold a JSON object")
    return cfg


def compute_dtype(directory: str, requested: str | None = None) -> DType:
    """`requested` (--dtype), else the checkpoint's own dtype (also looked up in text_config), else fp32."""
    if requested is None:
        cfg = _config(directory)
        text: dict[str, Any] = cfg["text_config"] if isinstance(cfg.get("text_config"), dict) else {}
        requested = cfg.get("dtype") or cfg.get("torch_dtype") or text.get("dtype") or text.get("torch_dtype") or "float32"
    dtype = parse_dtype(str(requested), what="--dtype")
    if dtype not in COMPUTE_DTYPES:
        raise CheckpointError(f"--dtype {requested!r}: the hf engine computes in one of {', '.join(COMPUTE_DTYPES)}")
    return dtype


def hf_model_spec(
    directory: str,
    *,
    dtype: str | None = None,
    kv_dtype: str | None = None,
    conv_dtype: str | None = None,
    ssm_dtype: str | None = None,
) -> ModelSpec:
    """Spec of the checkpoint in `directory`; explicit state dtypes override the lossless defaults."""
    if not os.path.isdir(directory):
        raise CheckpointError(
            f"--model {directory!r}: the hf engine serves a checkpoint directory (config.json, *.safetensors, "
            "tokenizer files), not a preset name or a single file"
        )
    compute = compute_dtype(directory, dtype)
    spec = load_model(directory)
    spec = spec.with_dtypes(
        kv=parse_dtype(kv_dtype, what="kv dtype") if kv_dtype else compute,
        conv=parse_dtype(conv_dtype, what="conv dtype") if conv_dtype else compute,
        ssm=parse_dtype(ssm_dtype, what="ssm dtype") if ssm_dtype else "fp32",
    )
    return spec.with_checkpoint(checkpoint_digest(directory))
