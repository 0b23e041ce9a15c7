"""What running a batched prefill step's chunks on several threads buys: `--prefill-threads` 1 against N.

Runs the paged engine's batch-invariant `prefill_batch` over B fresh prompts of 128 tokens (B in
1, 4, 8, 16: a burst of B arrivals in one step) on one engine, switching its prefill thread count
between 1 and N in interleaved rounds (a shared machine's drift hits both alike), and prints the
median wall time per step of each, their ratio, and the cores the N-thread runs used (process
CPU seconds over wall seconds: near 1, the other threads found no idle core and nothing can be
gained). The checkpoint is the one
scripts/bench-vs-vllm.sh runs (nemotron_h `bench64`), random and made offline. A step of one
prompt has nothing to share: its ratio is the cost of the switch alone (none).

    python -m hybridpd_tools.bench.prefill_threads [--threads 2] [--steps 5] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

from hybridpd_tools.bench.paged_blocks import engine_with_blocks
from shared.engine.compute_threads import pin_intra_op_threads
from shared.engine.hf.tiny_checkpoints import cached_checkpoint
from shared.engine.paged.engine import PagedEngine
from shared.engine.protocol import PrefillChunk, RequestBlocks

BATCHES = (1, 4, 8, 16)
PROMPT_TOKENS = 128


def step(engine: PagedEngine, blocks: list[RequestBlocks]) -> None:
    """One batched prefill step: every prompt whole, from token 0 (each writes over its blocks)."""
    prompts = [[(7 * i + 3 * b + 5) % 300 + 4 for i in range(PROMPT_TOKENS)] for b in range(len(blocks))]
    runs = [engine.start_prefill(p, blk) for p, blk in zip(prompts, blocks)]
    engine.prefill_batch([PrefillChunk(run, PROMPT_TOKENS) for run in runs])


def measure(directory: str, threads: int, steps: int, rounds: int) -> list[tuple[int, float, float, float]]:
    """(batch, ms per step on 1 thread, ms per step on `threads`, cores the latter used) per batch size."""
    out = []
    for batch in BATCHES:
        engine, blocks = engine_with_blocks(directory, batch, PROMPT_TOKENS)
        times: dict[int, list[float]] = {1: [], threads: []}
        cores: list[float] = []
        for count in times:  # warm-up (and the workers' start)
            engine.prefill_threads = count
            step(engine, blocks)
        for _ in range(rounds):
            for count in times:
                engine.prefill_threads = count
                start, cpu = time.perf_counter(), time.process_time()
                for _ in range(steps):
                    step(engine, blocks)
                wall = time.perf_counter() - start
                times[count].append(wall / steps * 1e3)
                if count == threads:
                    cores.append((time.process_time() - cpu) / wall)
        out.append((batch, statistics.median(times[1]), statistics.median(times[threads]), statistics.median(cores)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2, help="prefill threads to compare with 1")
    parser.add_argument("--steps", type=int, default=5, help="prefill steps per timed run")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (the median counts)")
    args = parser.parse_args()
    if args.threads < 2:
        parser.error("--threads must be >= 2")
    pin_intra_op_threads(1)
    directory = cached_checkpoint("nemotron_h", size="bench64")
    print(f"nemotron_h bench64, fp32, prompts of {PROMPT_TOKENS} tokens, 1 intra-op thread per prefill thread:")
    print(f"  {'prompts':>7} {'1 thread ms/step':>17} {f'{args.threads} threads ms/step':>18} {'speed-up':>8} {'cores used':>10}")
    for batch, one, many, used in measure(directory, args.threads, args.steps, args.rounds):
        print(f"  {batch:>7} {one:>17.2f} {many:>18.2f} {one / many:>8.2f} {used:>10.2f}")


if __name__ == "__main__":
    main()
