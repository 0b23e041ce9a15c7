"""Threads that run model math, set up so that their bits cannot depend on the machine.

torch applies its intra-op thread count to each OS thread lazily: a thread that has not yet run a
parallel ATen op still carries OpenMP's default (one thread per core, or OMP_NUM_THREADS), and a
BLAS call such as `torch.mv` made first on that thread runs split across that many threads. A
split changes the summation order, so the first model call on a fresh compute thread could
differ by an ulp from every later one, and from a run on a machine with another core count.

So every thread that computes sets its count explicitly before its first op: executors made here
do it in their initializer, and engines call `pin_intra_op_threads` at each entry point, which
also covers threads they did not create (a CLI's main thread, a test's helper thread).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

DEFAULT_INTRA_OP_THREADS = 1


def pin_intra_op_threads(count: int = DEFAULT_INTRA_OP_THREADS) -> None:
    """Run this thread's torch ops on `count` intra-op threads from now on (cheap: call it often)."""
    if count < 1:
        raise ValueError(f"intra-op threads must be >= 1, got {count}")
    # Sets this OS thread's OpenMP count (and torch's and MKL's process-wide ones): the thread's
    # next op no longer runs under the default it was born with.
    torch.set_num_threads(count)


def compute_executor(name: str, intra_op_threads: int = DEFAULT_INTRA_OP_THREADS, *, workers: int = 1) -> ThreadPoolExecutor:
    """`workers` threads for model calls (one by default), each with its torch thread count set
    before it runs anything."""
    if workers < 1:
        raise ValueError(f"compute workers must be >= 1, got {workers}")
    return ThreadPoolExecutor(workers, thread_name_prefix=name, initializer=pin_intra_op_threads, initargs=(intra_op_threads,))
