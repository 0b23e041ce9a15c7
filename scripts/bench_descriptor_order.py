"""What descriptor order is worth: the same READ with the read lists as built today, with
each region's part reordered so that NIXL can merge contiguous blocks, and with one descriptor
per region (the floor: `bench transfer`'s baseline (b)).

Today a read list is region-major, then piece (K, V / conv sections, SSM), then block: the K
halves of consecutive kernel blocks get consecutive ids but are not adjacent in memory (the V
half sits between them), so `make_prepped_xfer` cannot merge them and every kernel block
costs two descriptors. Reordered unit-major (K_u, V_u, K_u+1, ...) and block-major for Mamba,
consecutive ids of contiguously allocated blocks are adjacent, and NIXL merges them into about
one descriptor per region. Both READs move the same bytes between the same plain agents
(raw_nixl.py); the source is rewritten before each, as prefill does.

    python scripts/bench_descriptor_order.py --model nemotron-3-nano-30b-a3b --prompt-tokens 2048
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import numpy.typing as npt

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shared.bench.pairs import PairRead, pair_lists, request_reads  # noqa: E402
from shared.bench.raw_nixl import PreparedRead, RawReader, RawTarget, coalesce_per_region  # noqa: E402
from shared.bench.sizing import blocks_needed, prefill_tokens, request_blocks  # noqa: E402
from shared.bench.stats import Summary, json_number, ratio  # noqa: E402
from shared.layout.hf_config import load_model  # noqa: E402
from shared.layout.page import build_engine_layout  # noqa: E402
from shared.layout.plan import build_plan  # noqa: E402
from shared.layout.read_lists import SideGeometry  # noqa: E402

IntArray = npt.NDArray[np.int64]


def unit_major(num_rows: int, geometry: SideGeometry, regions: int, fa_pieces: int, mamba_pieces: int) -> IntArray:
    """Old id -> new id: FA (region, piece, unit) -> (region, unit, piece); Mamba likewise by block."""
    fa = geometry.fa_part
    order_fa = np.arange(fa).reshape(regions, fa_pieces, -1).transpose(0, 2, 1).reshape(-1) if fa else np.zeros(0, np.int64)
    rest = num_rows - fa
    order_m = fa + np.arange(rest).reshape(regions, mamba_pieces, -1).transpose(0, 2, 1).reshape(-1) if rest else np.zeros(0, np.int64)
    order = np.concatenate([order_fa, order_m]).astype(np.int64)
    new_id = np.empty_like(order)
    new_id[order] = np.arange(len(order))
    return new_id


def reordered(reader: RawReader, r: PairRead, regions: tuple[int, int]) -> PreparedRead:
    lists = r.pair.lists
    lmap = unit_major(len(lists.local), lists.local_geometry, regions[0], lists.fa_pieces, lists.mamba_pieces)
    rmap = unit_major(len(lists.remote), lists.remote_geometry, regions[1], lists.fa_pieces, lists.mamba_pieces)
    local, remote = np.empty_like(lists.local), np.empty_like(lists.remote)
    local[lmap], remote[rmap] = lists.local, lists.remote
    by_local = np.argsort(lmap[r.local_idx], kind="stable")  # ascending ids: runs NIXL can merge
    lidx, ridx = lmap[r.local_idx][by_local], rmap[r.remote_idx][by_local]
    assert np.array_equal(local[lidx, 1], remote[ridx, 1])
    return reader.prepare(r.pair.decode_rank, r.pair.prefill_rank, local, remote, lidx, ridx)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="nemotron-3-nano-30b-a3b")
    parser.add_argument("--prefill-tp", type=int, default=1)
    parser.add_argument("--decode-tp", type=int, default=1)
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    spec = load_model(args.model)
    pre = build_engine_layout(spec, args.prefill_tp, kernel_block_size=16)
    dec = build_engine_layout(spec, args.decode_tp, kernel_block_size=16)
    tokens = prefill_tokens(spec, args.prompt_tokens)
    p_blocks, d_blocks = blocks_needed(pre, tokens), blocks_needed(dec, args.prompt_tokens + 1)
    target = RawTarget(args.prefill_tp, pre.num_regions, pre.region_bytes(p_blocks))
    reader = RawReader(target, args.decode_tp, dec.num_regions, dec.region_bytes(d_blocks))
    try:
        pairs = pair_lists(
            build_plan(pre, dec),
            local_bases=[reader.bases(d) for d in range(args.decode_tp)],
            remote_bases=[t.bases for t in target.ranks],
            local_num_blocks=d_blocks,
            remote_num_blocks=p_blocks,
        )
        reads = request_reads(pairs, request_blocks(dec, args.prompt_tokens + 1), request_blocks(pre, tokens), tokens)
        today = [
            reader.prepare(r.pair.decode_rank, r.pair.prefill_rank, r.pair.lists.local, r.pair.lists.remote, r.local_idx, r.remote_idx)
            for r in reads
        ]
        merged = [reordered(reader, r, (dec.num_regions, pre.num_regions)) for r in reads]
        per_region = []
        for r in reads:
            d, p = r.pair.decode_rank, r.pair.prefill_rank
            local, remote = coalesce_per_region(r.pair.lists.local, r.local_idx, reader.bases(d), target.ranks[p].bases)
            ids = np.arange(len(local), dtype=np.int64)
            per_region.append(reader.prepare(d, p, local, remote, ids, ids))
        times: dict[str, list[float]] = {"today": [], "unit_major": [], "per_region": []}
        for i in range(args.rounds + 1):
            for name, prepared in (("today", today), ("unit_major", merged), ("per_region", per_region)):
                target.rewrite()
                seconds = reader.run(prepared, f"order-{name}-{i}".encode())
                if i:
                    times[name].append(seconds)
    finally:
        reader.close()
        target.close()
    nbytes = sum(r.nbytes for r in reads)
    t, m, b = Summary.of(times["today"]), Summary.of(times["unit_major"]), Summary.of(times["per_region"])
    result = {
        "model": args.model, "prefill_tp": args.prefill_tp, "decode_tp": args.decode_tp, "prompt_tokens": args.prompt_tokens,
        "bytes": nbytes, "descriptors": sum(r.descriptors for r in reads),
        "today_ms": json_number(t.median * 1e3), "unit_major_ms": json_number(m.median * 1e3),
        "per_region_ms": json_number(b.median * 1e3), "speedup": json_number(ratio(t.median, m.median)),
        "today_vs_per_region": json_number(ratio(b.median, t.median)),
        "unit_major_vs_per_region": json_number(ratio(b.median, m.median)),
    }  # fmt: skip
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(
            f"{args.model} TP {args.prefill_tp}->{args.decode_tp}, {args.prompt_tokens}-token prompt: {nbytes / 1e6:.2f} MB in "
            f"{result['descriptors']} descriptors\nas listed today: {result['today_ms']} ms median; unit-major order: "
            f"{result['unit_major_ms']} ms median; one descriptor per region: {result['per_region_ms']} ms median\n"
            f"speed-up {result['speedup']}x; GB/s against one per region: today {result['today_vs_per_region']}, "
            f"unit-major {result['unit_major_vs_per_region']} ({args.rounds} rounds each, interleaved)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
