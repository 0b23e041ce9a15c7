"""Model bits do not depend on which thread computes, the harness, or the machine's core count.

torch sets a thread's OpenMP thread count lazily, at its first parallel ATen op: before that, a
fresh thread carries the default (OMP_NUM_THREADS or the core count), and a BLAS call made first
there is split across that many threads. These tests run in a subprocess with
OMP_NUM_THREADS=2 and the main thread set to 1 (as a test harness or a service might), so they
see the same conditions on any runner. The checks on the thread count in force at the model's
first op fail deterministically without the per-thread set-up; the bit comparisons show the
consequence on machines whose BLAS splits these shapes differently.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from shared.engine.compute_threads import compute_executor, pin_intra_op_threads
from shared.engine.reference.colocated import cached_model
from shared.engine.reference.state_store import read_global_state
from shared.engine.reference.tokenizer import encode
from shared.layout.presets import TINY_PRESETS

PROBE = textwrap.dedent(
    """
    import asyncio, ctypes, json, sys, threading
    import torch
    from torch.overrides import TorchFunctionMode
    from shared.engine.compute_threads import compute_executor
    from shared.engine.reference.colocated import cached_model
    from shared.engine.reference.state_store import read_global_state
    from shared.layout.presets import TINY_PRESETS
    from shared.runtime.compute_thread import ComputeThread

    def libgomp():
        for line in open("/proc/self/maps"):
            if "libgomp" in line:
                return ctypes.CDLL(line.split()[-1])
        raise SystemExit("torch is not built with GNU OpenMP here")

    omp = libgomp()

    class FirstOp(TorchFunctionMode):
        '''Records the OpenMP thread count in force when the first torch function runs.'''
        def __init__(self):
            super().__init__()
            self.threads = None
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if self.threads is None:
                self.threads = omp.omp_get_max_threads()
            return func(*args, **(kwargs or {}))

    torch.set_num_threads(1)  # the main thread only, as a harness would
    prompt = list(b"thread identity")
    out = {"fresh_default": None, "executor": None, "compute_thread": None, "first_op": {}, "bits_equal": {}}

    def on_fresh_thread(fn):
        box = {}
        t = threading.Thread(target=lambda: box.setdefault("v", fn()))
        t.start(); t.join()
        return box["v"]

    out["fresh_default"] = on_fresh_thread(omp.omp_get_max_threads)
    out["executor"] = compute_executor("probe").submit(omp.omp_get_max_threads).result()
    # Every worker of a pool (the paged engine's decode threads): each task waits for the others,
    # so the three run on three threads.
    started = threading.Barrier(3)
    def on_a_worker():
        started.wait(timeout=60)
        return omp.omp_get_max_threads()
    with compute_executor("probe-workers", workers=3) as pool:
        out["workers"] = [f.result() for f in [pool.submit(on_a_worker) for _ in range(3)]]

    async def on_compute_thread():
        worker = ComputeThread("probe-thread")
        try:
            return await worker.submit(omp.omp_get_max_threads)
        finally:
            worker.shutdown(wait=True)

    out["compute_thread"] = asyncio.run(on_compute_thread())
    for name, spec in TINY_PRESETS.items():
        model = cached_model(spec)
        # Stores are made on the main thread: making one runs ops that would set the thread up.
        main_store, fresh_store = model.new_store(), model.new_store()
        main_logits = model.prefill(prompt, main_store)
        main_state = read_global_state(main_store, spec, len(prompt))
        def first_call():
            mode = FirstOp()
            with mode:
                logits = model.prefill(prompt, fresh_store)
            return mode.threads, logits
        threads, logits = on_fresh_thread(first_call)
        state = read_global_state(fresh_store, spec, len(prompt))
        out["first_op"][name] = threads
        out["bits_equal"][name] = bool(torch.equal(logits, main_logits) and state.equal(main_state))
    print(json.dumps(out))
    """
)


def run_probe() -> dict[str, object]:
    env = {**os.environ, "OMP_NUM_THREADS": "2", "PYTHONPATH": os.getcwd()}
    done = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


@pytest.fixture(scope="module")
def probe() -> dict[str, object]:
    return run_probe()


def test_the_probe_sees_the_lazy_default(probe: dict[str, object]) -> None:
    """Negative control: a fresh plain thread really starts with 2 OpenMP threads, so the checks
    below would see 2 without the per-thread set-up."""
    assert probe["fresh_default"] == 2


def test_a_compute_executor_thread_is_set_up_before_its_first_task(probe: dict[str, object]) -> None:
    assert probe["executor"] == 1


def test_every_worker_of_a_compute_executor_is_set_up_before_its_first_task(probe: dict[str, object]) -> None:
    assert probe["workers"] == [1, 1, 1]


def test_a_compute_executor_refuses_fewer_than_one_worker() -> None:
    with pytest.raises(ValueError, match="compute workers"):
        compute_executor("none", workers=0)


def test_a_compute_thread_is_set_up_before_its_first_call(probe: dict[str, object]) -> None:
    assert probe["compute_thread"] == 1


@pytest.mark.parametrize("name", sorted(TINY_PRESETS))
def test_first_model_call_on_a_fresh_thread_runs_single_threaded(probe: dict[str, object], name: str) -> None:
    first_op = probe["first_op"]
    assert isinstance(first_op, dict)
    assert first_op[name] == 1, "the model's first op on a fresh thread ran under the thread's default count"


@pytest.mark.parametrize("name", sorted(TINY_PRESETS))
def test_first_model_call_on_a_fresh_thread_equals_the_main_thread(probe: dict[str, object], name: str) -> None:
    bits = probe["bits_equal"]
    assert isinstance(bits, dict)
    assert bits[name], "logits or state computed on a fresh thread differ from the main thread's"


@pytest.mark.parametrize("name", sorted(TINY_PRESETS))
def test_the_callers_thread_count_does_not_change_bits(name: str) -> None:
    spec = TINY_PRESETS[name]
    model = cached_model(spec)
    prompt = encode("thread count")
    before = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            store = model.new_store()
            logits = model.prefill(prompt, store)
            results.append((logits, read_global_state(store, spec, len(prompt))))
    finally:
        torch.set_num_threads(before)
    (one, one_state), (two, two_state) = results
    assert one is not None and two is not None
    assert torch.equal(one, two) and one_state.equal(two_state)


def test_pin_refuses_a_count_below_one() -> None:
    with pytest.raises(ValueError, match="intra-op threads"):
        pin_intra_op_threads(0)


def test_compute_executor_names_its_thread() -> None:
    import threading

    with compute_executor("named") as pool:
        assert pool.submit(lambda: threading.current_thread().name).result().startswith("named")
