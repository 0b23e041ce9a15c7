"""`hybrid-pd demo` runs an hf family next to the reference models: real subprocess services,
its tiny checkpoint made once into the cache directory and reused on the next run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shared.engine.hf.tiny_checkpoints import cached_checkpoint

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def test_a_cached_checkpoint_is_made_once(tmp_path: Path) -> None:
    first = cached_checkpoint("jamba", root=str(tmp_path))
    made = os.stat(os.path.join(first, "model.safetensors")).st_mtime_ns
    assert cached_checkpoint("jamba", root=str(tmp_path)) == first
    assert os.stat(os.path.join(first, "model.safetensors")).st_mtime_ns == made  # reused, not rebuilt
    assert [p.name for p in (tmp_path / "tiny-checkpoints").iterdir()] == [os.path.basename(first)]  # no staging left
    with pytest.raises(ValueError, match="unknown family"):
        cached_checkpoint("llama", root=str(tmp_path))


def test_demo_runs_an_hf_family_exactly(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "hybridpd_tools.cli.main", "demo", "--model", "tiny-mamba2", "--hf-family", "jamba"]
    command += ["--requests", "3", "--max-tokens", "6", "--prefill-tp", "1", "--decode-tp", "2", "--json"]
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "HYBRID_PD_CACHE": str(tmp_path)}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=280, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout)
    assert out["ok"]
    rows = {r["engine"]: r for r in out["rows"]}
    assert rows["hf"]["model"] == "hf:jamba" and rows["hf"]["exact"] == 3 and rows["hf"]["bytes"]["ssm"] > 0
    assert rows["reference"]["exact"] == 3
    assert (tmp_path / "tiny-checkpoints").is_dir()  # made where the cache variable points
    # Our output is ours: no library progress bar ("Writing model shards" as the checkpoint is made,
    # "Loading weights") and no transformers line between the demo's own.
    for third_party in ("Writing model shards", "Loading weights", "%|", "[transformers]", "falling back"):
        assert third_party not in done.stderr, done.stderr[-2000:]


def test_the_small_checkpoint_is_a_real_bigger_model_of_its_own(tmp_path: Path) -> None:
    from shared.engine.hf.model_spec import hf_model_spec

    tiny = hf_model_spec(cached_checkpoint("nemotron_h", root=str(tmp_path)))
    small_dir = cached_checkpoint("nemotron_h", root=str(tmp_path), size="small")
    small = hf_model_spec(small_dir)
    assert "small" in os.path.basename(small_dir)  # cached apart from the tiny one
    assert small.hidden_size > 4 * tiny.hidden_size and small.num_layers > tiny.num_layers
    with pytest.raises(ValueError, match=r"small.*nemotron_h only"):
        cached_checkpoint("jamba", root=str(tmp_path), size="small")
    with pytest.raises(ValueError, match="unknown size"):
        cached_checkpoint("nemotron_h", root=str(tmp_path), size="huge")
    assert sorted(p.name for p in (tmp_path / "tiny-checkpoints").iterdir() if "jamba" in p.name) == []  # nothing written
