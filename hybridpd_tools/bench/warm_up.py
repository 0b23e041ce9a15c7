"""What the paged engine's warm-up (`PagedEngine.warm_up`, run by each service at start) saves the
first request: a 128-token prefill and one decode step on a fresh engine, cold against warmed
up, in interleaved rounds (each a new engine, the call-size checks forgotten), with the warm-up's
own time. Two random checkpoints made offline: nemotron_h `bench64` and `small`.

    python -m hybridpd_tools.bench.warm_up [--rounds 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

from hybridpd_tools.bench.paged_blocks import engine_with_blocks
from shared.engine.compute_threads import pin_intra_op_threads
from shared.engine.hf.tiny_checkpoints import cached_checkpoint
from shared.engine.paged import call_sizes

PROMPT = list(range(10, 138))  # 128 tokens


def first_request(directory: str, warm: bool) -> tuple[float, float]:
    """(ms of the warm-up, ms of the first request) on a fresh engine; 0 warm-up ms when cold."""
    call_sizes.forget()
    engine, blocks = engine_with_blocks(directory, 2, len(PROMPT) + 32)
    began = time.perf_counter()
    if warm:
        engine.warm_up(blocks[0])
    warmed = time.perf_counter()
    first = engine.prefill(PROMPT, blocks[1])
    computed = engine.num_prefill_tokens(len(PROMPT))
    session = engine.start_decode(PROMPT, computed, blocks[1], lambda _tokens: blocks[1], first_token=first)
    engine.step_batch([session])
    done = time.perf_counter()
    return ((warmed - began) * 1e3 if warm else 0.0), (done - warmed) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds (the median counts)")
    args = parser.parse_args()
    pin_intra_op_threads(1)
    print(f"{'checkpoint':>10} {'cold first ms':>14} {'warm-up ms':>11} {'warmed first ms':>16} {'ratio':>6}")
    for size in ("bench64", "small"):
        directory = cached_checkpoint("nemotron_h", size=size)
        cold, warm_up, warmed = [], [], []
        for _ in range(args.rounds):
            cold.append(first_request(directory, False)[1])
            spent, first = first_request(directory, True)
            warm_up.append(spent)
            warmed.append(first)
        c, w, f = statistics.median(cold), statistics.median(warm_up), statistics.median(warmed)
        print(f"{size:>10} {c:>14.0f} {w:>11.0f} {f:>16.0f} {f / c:>6.2f}")
    call_sizes.forget()


if __name__ == "__main__":
    main()
