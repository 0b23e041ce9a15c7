"""What the paged engine's C kernels (--native-kernels) save a decode step: kernels against the
torch path.

Runs `step_batch` over B requests (B in 1, 8, 32, 64) on one process with one intra-op thread,
with the kernels and without, interleaved in rounds (a shared machine's drift hits both alike),
and prints the median step time of each and their ratio, on the checkpoint
scripts/bench-vs-vllm.sh runs (`bench64`, random, made offline) and a larger one (`small`).

    python -m hybridpd_tools.bench.native_kernels [--steps 20] [--rounds 3]
"""

from __future__ import annotations

import argparse

from hybridpd_tools.bench.paged_invariance import BATCHES, bench_engine, interleaved
from shared.engine.compute_threads import pin_intra_op_threads
from shared.engine.hf.tiny_checkpoints import cached_checkpoint
from shared.engine.paged.attention_kernel import attention_kernel
from shared.engine.paged.mamba2_kernel import mamba2_state_kernel


def measure(directory: str, steps: int, rounds: int) -> list[tuple[int, float, float]]:
    """(batch, ms per step with the kernels, ms per step on the torch path) per batch size."""
    out = []
    for batch in BATCHES:
        engine, sessions = bench_engine(directory, batch, 2 * steps * rounds + 4)
        times = interleaved(engine, sessions, "native_kernels", steps, rounds)
        out.append((batch, times[True], times[False]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20, help="decode steps per timed run")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (the median counts)")
    args = parser.parse_args()
    if mamba2_state_kernel() is None or attention_kernel() is None:
        raise SystemExit("the C kernels did not build on this machine (see the log): nothing to compare")
    pin_intra_op_threads(1)
    for name, directory in (
        ("nemotron_h head_dim 64 (hidden 256, 6 layers)", cached_checkpoint("nemotron_h", size="bench64")),
        ("nemotron_h small (hidden 512, 8 layers)", cached_checkpoint("nemotron_h", size="small")),
    ):
        print(f"{name}, fp32, 1 thread:")
        print(f"  {'batch':>5} {'kernels ms/step':>16} {'torch ms/step':>14} {'ratio':>6}")
        for batch, native, plain in measure(directory, args.steps, args.rounds):
            print(f"  {batch:>5} {native:>16.2f} {plain:>14.2f} {native / plain:>6.2f}")


if __name__ == "__main__":
    main()
