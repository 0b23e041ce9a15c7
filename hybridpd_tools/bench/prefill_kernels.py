"""Prefill's per-chunk kernels, the token-by-token or [T, T] way against the blocked one, in
one run: for prompts of 128, 512 and 1,900 tokens, each kernel on random inputs at a model's
shapes, old and new alternating in rounds (a shared machine's drift hits both alike); prints
the median ms of each and old / new, fp32 and bf16, on one intra-op thread as the engines run.

- attention: `Attention.attend` (all [T, T] scores at once) against `causal_chunk_attention`
  (a block of queries at a time, the causal half skipped);
- mamba1: `selective_scan_sequential` (token by token) against `selective_scan` (segments);
- gdn: `delta_rule_sequential` (token by token) against `chunked_delta_rule` (blocks);
- mamba2: `ssd_scan` in blocks of the checkpoint's chunk_size (128) against `SCAN_BLOCK`.

    python -m hybridpd_tools.bench.prefill_kernels [--lengths 128,512,1900] [--rounds 3]
        [--dtypes fp32,bf16] [--families attention,mamba1,gdn,mamba2]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from shared.engine.compute_threads import pin_intra_op_threads
from shared.engine.paged.attention import Attention
from shared.engine.paged.chunk_attention import causal_chunk_attention
from shared.engine.paged.delta_rule import chunked_delta_rule, delta_rule_sequential
from shared.engine.paged.mamba2 import SCAN_BLOCK, ssd_scan
from shared.engine.paged.selective_scan import selective_scan, selective_scan_sequential

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
Kernel = Callable[[], object]


@dataclass(frozen=True)
class Case:
    family: str
    shape: str  # what the dims are, as printed
    make: Callable[[int, torch.dtype, torch.Generator], tuple[Kernel, Kernel]]  # (old, new) at T tokens


def _attention(heads: int, kv: int, hd: int) -> Callable[[int, torch.dtype, torch.Generator], tuple[Kernel, Kernel]]:
    def make(t: int, dtype: torch.dtype, g: torch.Generator) -> tuple[Kernel, Kernel]:
        q = torch.randn(t, heads, hd, generator=g).to(dtype)
        k, v = (torch.randn(t, kv, hd, generator=g).to(dtype) for _ in range(2))
        empty = torch.zeros(1)
        mixer = Attention(empty, empty, empty, empty, num_heads=heads, num_kv_heads=kv, head_dim=hd, scaling=hd**-0.5)
        return (lambda: mixer.attend(q, k, v, 0)), (lambda: causal_chunk_attention(q, k, v, 0, mixer.scaling))

    return make


def _mamba1(d: int, n: int) -> Callable[[int, torch.dtype, torch.Generator], tuple[Kernel, Kernel]]:
    def make(t: int, dtype: torch.dtype, g: torch.Generator) -> tuple[Kernel, Kernel]:
        x = torch.randn(t, d, generator=g).to(dtype)
        dt = F.softplus(torch.randn(t, d, generator=g) - 2)
        a = -torch.arange(1, n + 1, dtype=torch.float32).repeat(d, 1)  # Mamba1's A_log init
        b, c = (torch.randn(t, n, generator=g).to(dtype) for _ in range(2))
        state = torch.randn(d, n, generator=g)
        return (
            (lambda: selective_scan_sequential(x, dt, a, b, c, state, dtype)),
            (lambda: selective_scan(x, dt, a, b, c, state, dtype)),
        )

    return make


def _gdn(heads: int, dk: int, dv: int) -> Callable[[int, torch.dtype, torch.Generator], tuple[Kernel, Kernel]]:
    def make(t: int, dtype: torch.dtype, g: torch.Generator) -> tuple[Kernel, Kernel]:
        del dtype  # the rule runs in fp32 whatever the model's dtype
        q = F.normalize(torch.randn(t, heads, dk, generator=g), dim=-1) / dk**0.5
        k = F.normalize(torch.randn(t, heads, dk, generator=g), dim=-1)
        v = torch.randn(t, heads, dv, generator=g)
        log_decay = -F.softplus(torch.randn(t, heads, generator=g)) * 0.3
        beta = torch.sigmoid(torch.randn(t, heads, generator=g))
        state = torch.randn(heads, dv, dk, generator=g)
        return (
            (lambda: delta_rule_sequential(q, k, v, log_decay, beta, state)),
            (lambda: chunked_delta_rule(q, k, v, log_decay, beta, state)),
        )

    return make


def _mamba2(heads: int, p: int, n: int, chunk: int) -> Callable[[int, torch.dtype, torch.Generator], tuple[Kernel, Kernel]]:
    def make(t: int, dtype: torch.dtype, g: torch.Generator) -> tuple[Kernel, Kernel]:
        del dtype  # the scan runs in fp32 whatever the model's dtype
        x = torch.randn(t, heads, p, generator=g)
        dt = F.softplus(torch.randn(t, heads, generator=g))
        a = -torch.linspace(0.02, 0.2, heads)
        b, c = (torch.randn(t, heads, n, generator=g) for _ in range(2))
        d, state = torch.randn(heads, generator=g), torch.randn(heads, p, n, generator=g)
        return (
            (lambda: ssd_scan(x, dt, a, b, c, d, state, chunk)),
            (lambda: ssd_scan(x, dt, a, b, c, d, state, min(chunk, SCAN_BLOCK))),
        )

    return make


CASES = (
    Case("attention", "bench64: 4 heads, 2 KV heads of 64", _attention(4, 2, 64)),
    Case("attention", "8 heads, 2 KV heads of 128", _attention(8, 2, 128)),
    Case("mamba1", "tiny: D 128, N 8", _mamba1(128, 8)),
    Case("mamba1", "D 512, N 16", _mamba1(512, 16)),
    Case("gdn", "tiny: 8 heads, Dk 8, Dv 12", _gdn(8, 8, 12)),
    Case("gdn", "16 heads, Dk 128, Dv 128", _gdn(16, 128, 128)),
    Case("mamba2", "bench64: 8 heads of 32, N 32, chunk 128", _mamba2(8, 32, 32, 128)),
)


def _ms(kernel: Kernel) -> float:
    start = time.perf_counter()
    kernel()
    return (time.perf_counter() - start) * 1e3


@torch.no_grad()
def measure(case: Case, t: int, dtype: torch.dtype, rounds: int) -> tuple[float, float]:
    """Median ms of (old, new) over `rounds` alternating runs, after one warm-up each."""
    old, new = case.make(t, dtype, torch.Generator().manual_seed(t))
    old(), new()
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(rounds):
        times[0].append(_ms(old))
        times[1].append(_ms(new))
    return statistics.median(times[0]), statistics.median(times[1])


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=_ints, default=[128, 512, 1900], help="prompt lengths in tokens (one chunk each)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating runs of old and new (the median counts)")
    parser.add_argument("--dtypes", default="fp32,bf16", help="comma-separated, of fp32 and bf16")
    parser.add_argument("--families", default="attention,mamba1,gdn,mamba2", help="comma-separated kernels to run")
    args = parser.parse_args()
    dtypes = [d for d in args.dtypes.split(",") if d]
    for d in dtypes:
        if d not in DTYPES:
            parser.error(f"--dtypes: {d!r} is not one of {', '.join(DTYPES)}")
    families = set(args.families.split(","))
    pin_intra_op_threads(1)
    print(f"{'kernel':<10} {'shape':<36} {'dtype':<5} {'tokens':>6} {'old ms':>9} {'new ms':>9} {'old/new':>8}")
    for case in CASES:
        if case.family not in families:
            continue
        for d in dtypes:
            for t in args.lengths:
                old, new = measure(case, t, DTYPES[d], args.rounds)
                print(f"{case.family:<10} {case.shape:<36} {d:<5} {t:>6} {old:>9.2f} {new:>9.2f} {old / new:>8.2f}", flush=True)


if __name__ == "__main__":
    main()
