"""Our output is ours: making a checkpoint and loading and running it with transformers (what the
demo and the hf engine's services do) prints no library progress bar and no transformers line of
its own; its kernel-fallback warnings (expected on a CPU machine) are said once, at INFO, by our
logger, naming what to install. A subprocess: transformers' warnings are once per process."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

SCRIPT = textwrap.dedent(
    """
    import tempfile
    from shared.logs.setup import configure_logging
    configure_logging("INFO")
    from shared.engine.hf.checkpoint import HfCheckpoint
    from shared.engine.hf.colocated import colocated_generate
    from shared.engine.hf.tiny_checkpoints import build_checkpoint
    with tempfile.TemporaryDirectory() as directory:
        build_checkpoint("qwen3_5", directory)  # transformers' save_pretrained: "Writing model shards"
        for _ in range(2):  # loaded twice ("Loading weights"), each prefilled and stepped
            checkpoint = HfCheckpoint(directory, dtype="fp32")
            print(colocated_generate(checkpoint, [5, 6, 7, 8], 3).token_ids)
    """
)


def test_load_path_prints_no_progress_bar_and_kernel_fallbacks_once_through_our_logger() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_", "TQDM_"))}
    env |= {"PYTHONPATH": os.getcwd(), "CI": "1"}  # CI=1: transformers would also propagate to the root logger
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=280, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(done.stdout.splitlines()) == 2
    err = done.stderr
    for bar in ("Writing model shards", "Loading weights", "it/s]", "%|"):
        assert bar not in err, err
    assert "[transformers]" not in err and "falling back" not in err, err
    ours = [line for line in err.splitlines() if "reference PyTorch kernels" in line]
    assert len(ours) == 1, err
    assert " INFO shared.third_party: " in ours[0]
    assert "`causal_conv1d`" in ours[0] and "`flash-linear-attention`" in ours[0] and "pip install" in ours[0]
    assert err.strip() == ours[0], err  # nothing else on stderr
