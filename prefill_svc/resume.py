"""Where a job's compute starts and the boundary it keeps on the way (prefix reuse on prefill:
prefill_svc/boundary_cache.py), as both job paths (prefill_svc/jobs.py, prefill_svc/parted_job.py)
use them."""

from __future__ import annotations

from dataclasses import dataclass

from prefill_svc.boundary_cache import BoundaryCache, Pending
from prefill_svc.job import Job
from shared.engine.protocol import ChunkedPrefill, PrefillRun, RequestBlocks, ResumablePrefill


@dataclass(frozen=True)
class Resume:
    """Where a job's compute starts (`tokens`: a kept boundary restored into its blocks; 0: from
    the first token) and the boundary it keeps on the way (`pending`)."""

    cache: BoundaryCache
    tokens: int = 0
    pending: Pending | None = None

    def start(self, engine: ChunkedPrefill, job: Job, blocks: RequestBlocks) -> PrefillRun:
        if self.tokens:
            assert isinstance(engine, ResumablePrefill)
            return engine.start_prefill_at(job.prompt, blocks, self.tokens, job.sampling)
        return engine.start_prefill(job.prompt, blocks, job.sampling)

    def keeps_at(self, end: int) -> bool:
        return self.pending is not None and end == self.pending.tokens

    def take(self, engine: object, run: PrefillRun, blocks: RequestBlocks) -> None:
        """On the compute thread, after the chunk ending at the boundary it keeps."""
        assert self.pending is not None and isinstance(engine, ResumablePrefill)
        self.cache.take(self.pending, engine, run, blocks)
