"""The benchmarks that drive real services still run end to end (no time is asserted).

`bench control` drives the decode and prefill services through their own pieces in this
process, so a change there shows up here first; `bench transfer` must rebuild exactly the
descriptor set the services use, or its raw NIXL baseline would not move the same bytes.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable
from typing import Any

import pytest

from hybridpd_tools.bench.control import PHASES, ControlConfig, format_control, run_control
from hybridpd_tools.bench.control_trace import NOTIFICATION_WAIT_STEP, STEPS
from hybridpd_tools.bench.transfer import TransferConfig, run_transfer
from shared import observe as tracing
from shared.transport.owner_thread import OwnerThread


@pytest.mark.integration
@pytest.mark.timeout(120)
@pytest.mark.parametrize("prompt_tokens", [8, 4000], ids=["short", "beyond-64-blocks-and-the-vocabulary"])
def test_control_runs_and_frees_everything(prompt_tokens: int) -> None:
    cfg = ControlConfig(requests=5, warmup=1, prompt_tokens=prompt_tokens)
    result = asyncio.run(run_control(cfg, command="test", show_progress=False))
    for phase in PHASES:
        assert result["ms"][phase]["count"] == 5
        if phase != "ids":  # timed apart, on the loop's time only
            assert result["loop_cpu_us"][phase]["count"] == 5
            assert 0 <= result["loop_cpu_us"][phase]["p10"] <= result["loop_cpu_us"][phase]["median"]
    assert result["blocks_in_use_after"] == {"prefill": 0, "decode": 0}
    assert result["reads_per_request"] == 1 and result["bytes_per_request"] > 0
    assert "calls" not in result and "loop CPU p10" in format_control(result)


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_control_with_prefill_in_its_own_process_times_its_free_from_there(monkeypatch: pytest.MonkeyPatch) -> None:
    from hybridpd_tools.bench.control_prefill import PrefillProcess

    asked: list[str] = []
    pin_ended_at = PrefillProcess.pin_ended_at

    async def counted(self: PrefillProcess, request_id: str, timeout: float = 30.0) -> float:
        asked.append(request_id)
        return await pin_ended_at(self, request_id, timeout)

    monkeypatch.setattr(PrefillProcess, "pin_ended_at", counted)
    cfg = ControlConfig(requests=5, warmup=1, separate_processes=True)
    result = asyncio.run(run_control(cfg, command="test", show_progress=False))
    assert result["config"]["in_process"] is False
    for phase in PHASES:
        assert result["ms"][phase]["count"] == 5
    # Every request's free was read from the prefill process, once, by its own id.
    assert asked == [f"bench-control-{i}" for i in range(cfg.warmup + cfg.requests)]
    # Asked of the prefill process itself, after its last pin ended.
    assert result["blocks_in_use_after"] == {"prefill": 0, "decode": 0}


def test_control_refuses_a_breakdown_across_processes() -> None:
    with pytest.raises(ValueError, match="--breakdown"):
        ControlConfig(breakdown=True, separate_processes=True)
    with pytest.raises(ValueError, match="--calls"):
        ControlConfig(calls=True, separate_processes=True)


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(300)
def test_transfer_baselines_move_the_services_descriptors() -> None:
    cfg = TransferConfig(model="tiny-gdn", prefill_tp=2, decode_tp=1, prompt_tokens=100, requests=2)
    result = asyncio.run(run_transfer(cfg, command="test", show_progress=False))
    assert result["descriptor_set_matches"] is True
    assert result["reads"] == 2
    assert result["descriptors"]["ours"] == result["descriptors"]["raw_nixl"] > result["descriptors"]["raw_nixl_coalesced"]
    assert result["bytes"]["total"] == result["bytes"]["fa"] + result["bytes"]["conv"] + result["bytes"]["ssm"]
    assert result["seconds"]["ours"]["count"] == 2


def _post_inline_always(self: OwnerThread, fn: Callable[..., Any], *args: Any) -> tuple[bool, Any]:
    """TEST-ONLY `OwnerThread.try_inline` that waits for a busy owner thread instead of handing
    the call over: where a READ is posted would otherwise depend on whether the owner thread
    happened to be pumping at that instant."""
    with self._busy:
        result = fn(*args)
    self.wake()
    return True, result


def _post_on_the_owner_thread(self: OwnerThread, fn: Callable[..., Any], *args: Any) -> tuple[bool, Any]:
    """TEST-ONLY `OwnerThread.try_inline` that always hands the call over, as when the owner is busy."""
    return False, None


@pytest.mark.integration
@pytest.mark.timeout(120)
@pytest.mark.parametrize("post", ["inline", "owner thread"])
def test_control_breakdown_times_every_step_and_unwraps_the_services(post: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import decode_svc.reader as reader
    from decode_svc.session_client import SessionClient
    from prefill_svc.session import PrefillSession
    from shared.layout.read_lists import read_indices

    monkeypatch.setattr(OwnerThread, "try_inline", _post_inline_always if post == "inline" else _post_on_the_owner_thread)
    originals = (SessionClient._send, SessionClient._resolve, PrefillSession._start_job, reader._pair_bytes)
    cfg = ControlConfig(requests=5, warmup=1, breakdown=True, calls=True)
    result = asyncio.run(run_control(cfg, command="test", show_progress=False))
    steps = result["breakdown"]["steps"]
    assert len(steps) == len(STEPS)
    # Marked on other threads: the compute thread's, and the owner thread's notification fetch;
    # the READ's post marks too where the post was handed to the owner thread (a READ this small
    # is posted inline on the loop whenever the owner thread is idle).
    off_loop = {tracing.Step.COMPUTE, tracing.Step.NOTIFICATION_FETCHED}
    if post == "owner thread":
        off_loop |= {tracing.Step.POST_START, tracing.Step.POST_END}
    on_loop = {label for label, start, stop in STEPS if not {start, stop} & off_loop}
    for step in steps:
        assert step["count"] == 5, step  # every mark of every request was seen
        # Each step's end is caused by its start, so it cannot come first; but for the notification
        # wait: prefill's pump may fetch the notification before decode's post call returns.
        if step["step"] != NOTIFICATION_WAIT_STEP:
            assert step["median"] >= 0, step
        # The loop's CPU for the steps whose marks all lie on the event loop, and only those.
        assert step["loop_cpu_us"]["count"] == (5 if step["step"] in on_loop else 0), step
    # The counted pass: every loop step of every request counted, and the whole request and RPC.
    counted = {s["step"]: s for s in result["calls"]["steps"]}
    assert {label for label, s in counted.items() if s["count"] == 5} == on_loop
    assert all(counted[label]["python_mean"] > 0 for label in on_loop)
    for whole in ("request", "generate_rpc"):
        assert result["calls"][whole]["count"] == 5 and result["calls"][whole]["python_mean"] > 0
    assert sys.getprofile() is None  # the counter is uninstalled again
    text = format_control(result)
    assert "calls on the event loop" in text and "Generate RPC" in text
    assert result["breakdown"]["design_floor_ms"] > 0
    assert result["blocks_in_use_after"] == {"prefill": 0, "decode": 0}
    # The instrumentation is gone again: the classes and the module hold their own functions.
    assert (SessionClient._send, SessionClient._resolve, PrefillSession._start_job, reader._pair_bytes) == originals
    assert reader.read_indices is read_indices
    assert tracing._sink is None  # and nobody listens to the marks any more
