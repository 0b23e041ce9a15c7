"""Model identity: config content and weights, never the directory's name."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from shared.engine.hf import identity
from shared.engine.hf.identity import CheckpointError, checkpoint_digest
from shared.engine.hf.model_spec import hf_model_spec
from shared.engine.hf.tiny_checkpoints import build_checkpoint


def test_one_checkpoint_in_two_differently_named_directories_is_one_model(
    hf_checkpoint: Callable[[str], str], tmp_path: Path
) -> None:
    original = hf_checkpoint("jamba")
    copy = tmp_path / "some-other-name"
    shutil.copytree(original, copy)
    # Formatting of config.json is not content.
    cfg = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps(cfg, indent=7))
    a, b = hf_model_spec(original), hf_model_spec(str(copy))
    assert checkpoint_digest(original) == checkpoint_digest(copy) == a.checkpoint_digest
    assert a == b and a.fingerprint() == b.fingerprint() and a.name == b.name == "jamba"


def test_different_weights_or_config_are_different_models(hf_checkpoint: Callable[[str], str], tmp_path: Path) -> None:
    original = hf_checkpoint("jamba")
    reseeded = build_checkpoint("jamba", str(tmp_path / "jamba"), seed=1)
    assert hf_model_spec(original).fingerprint() != hf_model_spec(reseeded).fingerprint()
    edited = tmp_path / "edited"
    shutil.copytree(original, edited)
    cfg = json.loads((edited / "config.json").read_text())
    (edited / "config.json").write_text(json.dumps(cfg | {"rms_norm_eps": 1e-3}))
    assert checkpoint_digest(edited) != checkpoint_digest(original)


def test_sampled_digest_of_large_files_still_tells_weights_apart(
    hf_checkpoint: Callable[[str], str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(identity, "FULL_HASH_LIMIT", 1024)  # every file counts as large
    monkeypatch.setattr(identity, "SAMPLE_BYTES", 256)
    reseeded = build_checkpoint("jamba", str(tmp_path / "jamba"), seed=1)
    assert checkpoint_digest(hf_checkpoint("jamba")) != checkpoint_digest(reseeded)
    assert checkpoint_digest(reseeded) == checkpoint_digest(reseeded)


def test_state_dtypes_follow_the_compute_dtype(hf_checkpoint: Callable[[str], str]) -> None:
    directory = hf_checkpoint("qwen3_5")
    fp32 = hf_model_spec(directory)  # the checkpoint is float32
    assert (fp32.kv_dtype, fp32.conv_dtype, fp32.ssm_dtype) == ("fp32", "fp32", "fp32")
    bf16 = hf_model_spec(directory, dtype="bf16")
    assert (bf16.kv_dtype, bf16.conv_dtype, bf16.ssm_dtype) == ("bf16", "bf16", "fp32")
    assert bf16.fingerprint() != fp32.fingerprint()
    assert hf_model_spec(directory, dtype="bf16", ssm_dtype="bf16").ssm_dtype == "bf16"


def test_what_is_not_a_checkpoint_is_refused_by_name(hf_checkpoint: Callable[[str], str], tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="checkpoint directory"):
        hf_model_spec("tiny-mamba2")
    (tmp_path / "config.json").write_text(Path(hf_checkpoint("jamba"), "config.json").read_text())
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors"):
        hf_model_spec(str(tmp_path))
    (tmp_path / "model.safetensors").write_bytes(b"\xff" * 4)
    with pytest.raises(CheckpointError, match=r"model\.safetensors"):
        checkpoint_digest(tmp_path)
    with pytest.raises(CheckpointError, match="--dtype"):
        hf_model_spec(hf_checkpoint("jamba"), dtype="fp8")
