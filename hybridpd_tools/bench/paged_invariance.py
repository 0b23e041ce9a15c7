"""What batch invariance costs the paged engine's decode step: tiles against one GEMM.

Runs `step_batch` over B requests (B in 1, 8, 32, 64) on one process, first with the engine's
batch-invariant tiles, then with one forward over the whole batch, interleaved in rounds (a
shared machine's drift hits both alike), and prints the median step time of each and their
ratio. Two checkpoints, both random and made offline: the small nemotron_h benchmark checkpoint
and the one scripts/bench-vs-vllm.sh runs (`bench64`: heads of 64, which vLLM's CPU attention accepts). `--tile N` sets the
tile row count (tiles.TILE_ROWS) to compare tile sizes.

    python -m hybridpd_tools.bench.paged_invariance [--steps 20] [--rounds 3] [--tile 16]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

from hybridpd_tools.bench.paged_blocks import engine_with_blocks
from shared.engine.compute_threads import pin_intra_op_threads
from shared.engine.hf.tiny_checkpoints import cached_checkpoint
from shared.engine.paged import tiles
from shared.engine.paged.engine import PagedDecodeSession, PagedEngine
from shared.engine.protocol import RequestBlocks

BATCHES = (1, 8, 32, 64)
PROMPT_TOKENS = 32


def _fixed(blocks: RequestBlocks) -> Callable[[int], RequestBlocks]:
    """An ensure_capacity for blocks allocated up front for every step."""

    def grow(_tokens: int) -> RequestBlocks:
        return blocks

    return grow


def bench_engine(directory: str, batch: int, steps: int) -> tuple[PagedEngine, list[PagedDecodeSession]]:
    """A paged fp32 engine on caches of its own and `batch` decode sessions, each after a prompt
    of PROMPT_TOKENS tokens, with blocks for `steps` more steps."""
    engine, all_blocks = engine_with_blocks(directory, batch, PROMPT_TOKENS + steps + 8)
    sessions = []
    for b, blocks in enumerate(all_blocks):
        prompt = [(7 * i + 3 * b + 5) % 300 + 4 for i in range(PROMPT_TOKENS)]
        first = engine.prefill(prompt, blocks)
        sessions.append(engine.start_decode(prompt, PROMPT_TOKENS, blocks, _fixed(blocks), first_token=first))
    return engine, sessions


def measure(directory: str, steps: int, rounds: int) -> list[tuple[int, float, float]]:
    """(batch, ms per step with tiles, ms per step with one GEMM) per batch size."""
    out = []
    for batch in BATCHES:
        engine, sessions = bench_engine(directory, batch, 2 * steps * rounds + 4)
        times = interleaved(engine, sessions, "batch_invariant", steps, rounds)
        out.append((batch, times[True], times[False]))
    return out


def interleaved(
    engine: PagedEngine, sessions: list[PagedDecodeSession], switch: str, steps: int, rounds: int
) -> dict[bool, float]:
    """Median ms per `step_batch` with the engine's boolean attribute `switch` on and off, the
    two taking turns for `rounds` rounds of `steps` steps (after one warm-up step each)."""
    times: dict[bool, list[float]] = {True: [], False: []}
    for on in (True, False):
        setattr(engine, switch, on)
        engine.step_batch(sessions)
    for _ in range(rounds):
        for on in (True, False):
            setattr(engine, switch, on)
            start = time.perf_counter()
            for _ in range(steps):
                engine.step_batch(sessions)
            times[on].append((time.perf_counter() - start) / steps * 1e3)
    return {on: statistics.median(t) for on, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20, help="decode steps per timed run")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (the median counts)")
    parser.add_argument("--tile", type=int, default=tiles.TILE_ROWS, help="rows per tile")
    args = parser.parse_args()
    tiles.TILE_ROWS = args.tile
    pin_intra_op_threads(1)
    for name, directory in (
        ("nemotron_h small (hidden 512, 8 layers)", cached_checkpoint("nemotron_h", size="small")),
        ("nemotron_h head_dim 64 (hidden 256, 6 layers)", cached_checkpoint("nemotron_h", size="bench64")),
    ):
        print(f"{name}, tile {args.tile} rows, fp32, 1 thread:")
        print(f"  {'batch':>5} {'tiles ms/step':>14} {'one GEMM ms/step':>17} {'ratio':>6}")
        for batch, tiled, plain in measure(directory, args.steps, args.rounds):
            print(f"  {batch:>5} {tiled:>14.2f} {plain:>17.2f} {tiled / plain:>6.2f}")


if __name__ == "__main__":
    main()
