"""What running a decode step's tiles on several threads buys: `--decode-threads` 1 against N.

Runs the paged engine's batch-invariant `step_batch` over B requests (B in 16, 32, 64: one, two
and four tiles) on one engine, switching its decode thread count between 1 and N in interleaved
rounds (a shared machine's drift hits both alike), and prints the median wall time per step of
each and their ratio. The checkpoint is the one scripts/bench-vs-vllm.sh runs (nemotron_h
`bench64`), random and made offline. A step of one tile has nothing to share: its ratio is the
cost of the switch alone (none).

    python -m hybridpd_tools.bench.decode_threads [--threads 2] [--steps 20] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

from hybridpd_tools.bench.paged_invariance import bench_engine
from shared.engine.compute_threads import pin_intra_op_threads
from shared.engine.hf.tiny_checkpoints import cached_checkpoint

BATCHES = (16, 32, 64)


def measure(directory: str, threads: int, steps: int, rounds: int) -> list[tuple[int, float, float]]:
    """(batch, ms per step on 1 thread, ms per step on `threads`) per batch size."""
    out = []
    for batch in BATCHES:
        engine, sessions = bench_engine(directory, batch, 2 * steps * rounds + 4)
        times: dict[int, list[float]] = {1: [], threads: []}
        for count in times:  # warm-up (and the workers' start)
            engine.decode_threads = count
            engine.step_batch(sessions)
        for _ in range(rounds):
            for count in times:
                engine.decode_threads = count
                start = time.perf_counter()
                for _ in range(steps):
                    engine.step_batch(sessions)
                times[count].append((time.perf_counter() - start) / steps * 1e3)
        out.append((batch, statistics.median(times[1]), statistics.median(times[threads])))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2, help="decode threads to compare with 1")
    parser.add_argument("--steps", type=int, default=20, help="decode steps per timed run")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (the median counts)")
    args = parser.parse_args()
    if args.threads < 2:
        parser.error("--threads must be >= 2")
    pin_intra_op_threads(1)
    directory = cached_checkpoint("nemotron_h", size="bench64")
    print("nemotron_h head_dim 64 (hidden 256, 6 layers), fp32, tiles of 16 rows, 1 intra-op thread per decode thread:")
    print(f"  {'batch':>5} {'1 thread ms/step':>17} {f'{args.threads} threads ms/step':>18} {'speed-up':>8}")
    for batch, one, many in measure(directory, args.threads, args.steps, args.rounds):
        print(f"  {batch:>5} {one:>17.2f} {many:>18.2f} {one / many:>8.2f}")


if __name__ == "__main__":
    main()
