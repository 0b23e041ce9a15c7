"""A prefill job as the job path sees it (`Job`), what computing it gives (`ComputedState`),
where its first token and its manifest parts go, and the manifest that describes it (`manifest_of`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from prefill_svc.pins import Pin
from shared import limits
from shared.cache.digest import DIGEST_ALGORITHM, SectionDigest
from shared.cache.manifest import Manifest, ManifestPart
from shared.engine.first_logprobs import fork_draws, run_logprobs, scored_prompt
from shared.engine.logprobs import TokenLogprobs
from shared.engine.protocol import PrefillRun, RequestBlocks
from shared.engine.sampling import GREEDY, SamplingParams
from shared.pb.hybridpd.v1 import prefill_service_pb2 as pb
from shared.rpc.proto_time import seconds
from shared.rpc.sampling_message import sampling_of_job
from shared.rpc.token_ids import token_list


@dataclass(frozen=True)
class Job:
    """One job of a Session, as the session hands it to `JobRunner.run`."""

    request_id: str
    prompt: list[int]
    deadline: float | None  # event-loop time; None: the job has no deadline
    owner: str  # the decode incarnation whose pin this becomes
    readers_per_rank: list[int]  # decode ranks that READ from each prefill rank
    sampling: SamplingParams = GREEDY  # draws the first output token at the full-N boundary
    accepts_parts: bool = False  # decode takes the state in manifest parts (pipelined transfer)
    cached_tokens: int = 0  # leading prompt tokens whose K/V decode holds: not digested (nor READ)
    wants_first_token: bool = False  # full-N: the first token goes out the moment it is drawn
    accepts_layer_parts: bool = False  # with parts: the last chunk's state may come in layer parts
    logprobs: int | None = None  # full-N: the first token's logprobs with the k likeliest (None: none)
    prompt_logprobs: int | None = None  # the prompt's logprobs with the k likeliest (None: none)
    fork_seeds: tuple[int, ...] = ()  # full-N: output token 0 drawn again with each (several sequences)


def job_from_message(job: pb.PrefillJob, *, owner: str, readers_per_rank: list[int], now: float) -> Job:
    """The job once as domain values; `now` is event-loop time (the timeout travels as a duration)."""
    deadline = now + seconds(job.timeout) if job.HasField("timeout") else None
    return Job(
        job.request_id,
        token_list(job.prompt_token_ids),
        deadline,
        owner,
        readers_per_rank,
        sampling_of_job(job),
        job.accept_manifest_parts,
        job.cached_prompt_tokens,
        job.accept_first_token,
        job.accept_layer_parts,
        job_count(job, "logprobs"),
        job_count(job, "prompt_logprobs"),
        tuple(job.fork_seeds),
    )


def job_count(job: pb.PrefillJob, name: Literal["logprobs", "prompt_logprobs"]) -> int | None:
    """A job's top-logprobs count (None: unset)."""
    if not job.HasField(name):
        return None
    return limits.LOGPROBS.check(getattr(job, name), f"job.{name}")


@dataclass
class FirstLogprobs:
    """The logprobs a job asked for, set on a compute thread: the first token's as it is drawn
    (full-N), the prompt's once the last chunk is computed, and the forks' first tokens."""

    value: TokenLogprobs | None = None
    prompt: tuple[TokenLogprobs, ...] | None = None
    forks: tuple[int, ...] = ()  # output token 0 drawn with each fork seed
    fork_logprobs: tuple[TokenLogprobs, ...] = ()

    def draw(self, run: PrefillRun, first_token: int | None, job: Job, *, prompt: bool = True) -> None:
        """What `job` asked for besides the state, from the logits `run` kept (on a compute
        thread, as a colocated run draws them); `prompt`: the prompt's logprobs too (its last chunk)."""
        self.value = run_logprobs(run, first_token, job.logprobs)
        self.forks, self.fork_logprobs = fork_draws(run, first_token, job.sampling, job.fork_seeds, job.logprobs)
        if prompt:
            self.prompt = scored_prompt(run, job.prompt_logprobs)


def draws_more(job: Job, first_token: int | None) -> bool:
    """Whether the job asked for more than the state: logprobs, or its forks' first tokens."""
    wants_first = first_token is not None and (job.logprobs is not None or bool(job.fork_seeds))
    return wants_first or job.prompt_logprobs is not None


PartSink = Callable[[Manifest], None]
"""Takes each manifest part but the last (which `JobRunner.run` returns), in order."""

TokenSink = Callable[[int, float, TokenLogprobs | None], None]
"""Takes the first output token of a job that asked for it, with the engine's seconds computing
the prompt and its logprobs (when the job asked), on the event loop, the moment it was drawn:
before the digests, the pin and the manifest."""


@dataclass(frozen=True)
class ComputedState:
    """What computing a job (or one span of its parts) gave: the first token (full-N boundary,
    the prompt's last chunk; else None), the digests of what it made final, and the seconds the
    digests on the compute path and the engine took."""

    first_token: int | None
    digests: list[SectionDigest]
    digest_seconds: float
    engine_seconds: float


def deadline_passed(deadline: float | None, now: float) -> bool:
    return deadline is not None and now >= deadline


def manifest_of(
    verify_transfer: bool,
    job: Job,
    tid: str,
    blocks: RequestBlocks,
    computed: int,
    pin: Pin,
    started: float,
    state: ComputedState,
    drawn: FirstLogprobs,
    part: ManifestPart | None = None,
) -> Manifest:
    """The one place a job's manifest (or one of its parts) is made, once `pin` holds its
    blocks; `started`: when its compute began (monotonic clock). The first token's logprobs and
    the forks' first tokens travel with the first token; the prompt's logprobs with the last part."""
    lease = pin.lease_left()
    drew = state.first_token is not None
    last = part is None or part.index == part.count - 1
    return Manifest(
        request_id=job.request_id,
        transfer_id=tid,
        block_ids=tuple(blocks.block_ids),
        num_computed_tokens=computed,
        prompt_token_count=len(job.prompt),
        lease_ns=lease.ns,
        lease_expire_time_ns=lease.expire_time_ns,
        prefill_ns=int((time.monotonic() - started) * 1e9),
        digests=tuple(state.digests),
        digest_algorithm=DIGEST_ALGORITHM if verify_transfer else "",
        digest_ns=int(state.digest_seconds * 1e9),
        first_token=state.first_token,
        part=part,
        skipped_tokens=job.cached_tokens,
        engine_ns=int(state.engine_seconds * 1e9),
        first_logprobs=drawn.value if drew else None,
        prompt_logprobs=drawn.prompt if last else None,
        fork_first_tokens=drawn.forks if drew else (),
        fork_first_logprobs=drawn.fork_logprobs if drew else (),
    )
