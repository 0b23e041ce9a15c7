"""One prefill job: validate, allocate blocks on every rank, run the engine off the loop, take
the state's digests, pin, and describe the result in a manifest."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from prefill_svc.pins import PinTable
from shared import tracing
from shared.cache.digest import DIGEST_ALGORITHM, SectionDigest, state_digests
from shared.cache.manifest import Manifest
from shared.engine.protocol import RequestBlocks
from shared.engine.sampling import GREEDY, SamplingParams
from shared.errors import DeadlineExceeded, InvalidArgument
from shared.pb.hybridpd.v1 import prefill_service_pb2 as pb
from shared.rpc import fault_hooks
from shared.rpc.deadlines import wait_deadline
from shared.rpc.proto_time import seconds
from shared.rpc.sampling_message import sampling_of_job
from shared.runtime.engine_host import EngineHost
from shared.tracing import Step


@dataclass(frozen=True)
class Job:
    """One job of a Session, as the session hands it to `JobRunner.run`."""

    request_id: str
    prompt: list[int]
    deadline: float | None  # event-loop time; None: the job has no deadline
    owner: str  # the decode incarnation whose pin this becomes
    readers_per_rank: list[int]  # decode ranks that READ from each prefill rank
    sampling: SamplingParams = GREEDY  # draws the first output token at the full-N boundary
    cached_tokens: int = 0  # leading prompt tokens whose K/V decode holds: not digested (nor READ)


def job_from_message(job: pb.PrefillJob, *, owner: str, readers_per_rank: list[int], now: float) -> Job:
    """The job once as domain values; `now` is event-loop time (the timeout travels as a duration)."""
    deadline = now + seconds(job.timeout) if job.HasField("timeout") else None
    prompt = list(job.prompt_token_ids)
    return Job(job.request_id, prompt, deadline, owner, readers_per_rank, sampling_of_job(job), job.cached_prompt_tokens)


def validate_prompt(host: EngineHost, request_id: str, prompt: Sequence[int]) -> None:
    """Reject a job that could never run, naming the field (nothing is touched)."""
    if not request_id:
        raise InvalidArgument("must be non-empty", field="job.request_id")
    if not prompt:
        raise InvalidArgument("the prompt is empty", field="job.prompt_token_ids")
    host.check_token_ids(prompt, "job.prompt_token_ids")
    needed = sum(host.blocks_per_group(host.engine.num_prefill_tokens(len(prompt))))
    if needed > host.num_blocks:
        raise InvalidArgument(
            f"a prompt of {len(prompt)} tokens needs {needed} blocks; this prefill engine has {host.num_blocks}",
            field="job.prompt_token_ids",
        )


def check_cached_tokens(cached: int, computed: int) -> None:
    """Decode can hold at most the K/V prefill computes."""
    if cached > computed:
        raise InvalidArgument(
            f"{cached} cached prompt tokens, but this prefill engine computes {computed} of the prompt",
            field="job.cached_prompt_tokens",
        )


class JobRunner:
    def __init__(self, host: EngineHost, pins: PinTable) -> None:
        self.host = host
        self.pins = pins
        self._ids = itertools.count(1)

    def next_transfer_id(self) -> str:
        return f"t{next(self._ids):x}"

    async def allocate(self, key: str, num_tokens: int, deadline: float | None) -> RequestBlocks:
        """Blocks for the job; while the cache is full, wait for frees (queued) until shortly
        before the job's deadline, then RESOURCE_EXHAUSTED. Without a deadline: no waiting."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        return await self.host.allocate_queued(key, num_tokens, now if deadline is None else wait_deadline(deadline, now))

    async def run(self, job: Job, *, on_end: Callable[[str], None] | None = None) -> Manifest:
        tracing.mark(Step.JOB_STARTED)
        prompt, deadline = job.prompt, job.deadline
        validate_prompt(self.host, job.request_id, prompt)
        engine = self.host.engine
        computed = engine.num_prefill_tokens(len(prompt))
        check_cached_tokens(job.cached_tokens, computed)
        tid = self.next_transfer_id()
        blocks = await self.allocate(tid, computed, deadline)
        started = time.monotonic()
        compute = asyncio.ensure_future(self.host.run_compute(lambda: self._compute(job, blocks, computed)))
        try:
            first_token, digests, digest_seconds = await asyncio.shield(compute)
        except asyncio.CancelledError:
            # The engine may still be writing these blocks: free them only once it is done.
            compute.add_done_callback(lambda _: self.host.free(tid))
            raise
        except BaseException:
            self.host.free(tid)
            raise
        try:
            await fault_hooks.pause("before_manifest", job.request_id)
            injected = fault_hooks.failure_for(job.request_id)
            if injected is not None:
                raise injected
        except BaseException:
            self.host.free(tid)
            raise
        elapsed = time.monotonic() - started
        loop = asyncio.get_running_loop()
        if deadline is not None and loop.time() >= deadline:
            self.host.free(tid)
            raise DeadlineExceeded(f"the job's deadline passed during prefill ({elapsed:.3f}s)", field="job.timeout")
        # Expectations are registered before the manifest leaves: no notification can beat them.
        pin = self.pins.pin(tid, job.request_id, job.owner, job.readers_per_rank, on_end=on_end)
        lease_ns = max(0, int((pin.lease_deadline - loop.time()) * 1e9))
        tracing.mark(Step.MANIFEST_BUILT)
        return Manifest(
            request_id=job.request_id,
            transfer_id=tid,
            block_ids=tuple(blocks.block_ids),
            num_computed_tokens=computed,
            prompt_token_count=len(prompt),
            lease_ns=lease_ns,
            lease_expire_time_ns=time.time_ns() + lease_ns,
            prefill_ns=int(elapsed * 1e9),
            digests=tuple(digests),
            digest_algorithm=DIGEST_ALGORITHM if self.host.verify_transfer else "",
            digest_ns=int(digest_seconds * 1e9),
            first_token=first_token,
            skipped_tokens=job.cached_tokens,
        )

    def _compute(self, job: Job, blocks: RequestBlocks, computed: int) -> tuple[int | None, list[SectionDigest], float]:
        """On the compute thread: the engine writes the state (and at the full-N boundary samples
        the first token), then its digests are taken (returned with the seconds they took)."""
        first_token = self.host.engine.prefill(job.prompt, blocks, job.sampling)
        if not self.host.verify_transfer:
            return first_token, [], 0.0
        started = time.monotonic()
        digests = state_digests(self.host.layout, self.host.views, blocks.block_ids, computed, tokens_from=job.cached_tokens)
        took = time.monotonic() - started
        section = fault_hooks.corruption_for(job.request_id)
        if section is not None:
            _flip_one_byte(self.host, blocks, section)
        return first_token, digests, took


def _flip_one_byte(host: EngineHost, blocks: RequestBlocks, section: str) -> None:
    """TEST-ONLY (HYBRID_PD_TEST_CORRUPT): flip the first byte of `section` that rank 0 holds for
    this request in the first group of its kind, after the digests were taken."""
    layout, views = host.layout, host.views[0]
    kind = "attention" if section == "fa" else "mamba"
    group = next(g for g, grp in enumerate(layout.groups) if grp.kind == kind)
    ids = np.asarray(blocks.block_ids[group])
    if section == "fa":
        kernel, slot = layout.token_slots(ids, [0])
        target: torch.Tensor = views.fa[0][int(kernel[0]), 0, 0, int(slot[0])]
    else:
        target = (views.conv if section == "conv" else views.ssm)[0][int(ids[0])].reshape(-1)
    raw = target.view(torch.uint8)
    raw[0] = raw[0] ^ 0x01
