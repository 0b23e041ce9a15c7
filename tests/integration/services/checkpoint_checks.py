"""Checks on decode's state checkpoints: a spy on the jobs prefill receives, and TEST-ONLY
faults in a held checkpoint (faults no real part makes on purpose), the negative controls that
show the restored bytes are what a request decodes from."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from decode_svc.app import DecodeApp
from decode_svc.state_checkpoints import Checkpoint
from prefill_svc import session as session_module
from prefill_svc.job import Job
from shared.cache.model_views import torch_dtype
from shared.pb.hybridpd.v1 import prefill_service_pb2 as prefill_pb


def count_jobs(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The request ids of the jobs prefill receives (a spy on the real parser)."""
    jobs: list[str] = []
    real = session_module.job_from_message

    def counting(job: prefill_pb.PrefillJob, **kw: Any) -> Job:
        jobs.append(job.request_id)
        return real(job, **kw)

    monkeypatch.setattr(session_module, "job_from_message", counting)
    return jobs


def oldest_checkpoint(decode: DecodeApp) -> Checkpoint:
    """The least recently used checkpoint decode holds."""
    return next(iter(decode.servicer.generation.reuse.states._entries.values()))


def checkpoint_pages(decode: DecodeApp, checkpoint: Checkpoint) -> list[list[torch.Tensor]]:
    """Copies of the bytes a checkpoint holds in the pool: per rank, per region, its blocks."""
    where = torch.from_numpy(checkpoint.blocks)
    return [[view.cache.blocks(r)[where].clone() for r in range(view.cache.num_regions)] for view in decode.host.views]


def shift_checkpoint_ssm(decode: DecodeApp) -> None:
    """Shift the SSM state held in the least recently used checkpoint's pool blocks. Its blocks:
    per group in order, the attention blocks after its lead, or the Mamba group's block."""
    host = decode.host
    checkpoint = oldest_checkpoint(decode)
    shapes, dtype, layout = host.layout.shapes, torch_dtype(host.spec.ssm_dtype), host.layout
    tail = -(-checkpoint.computed // layout.block_size) - checkpoint.lead
    row, shifted = 0, 0
    for group in layout.groups:
        if group.kind == "attention":
            row += tail
            continue
        block = int(checkpoint.blocks[row])
        for view in host.views:
            for region in range(len(group.layers)):
                page = view.cache.blocks(region)[block, shapes.ssm_offset : shapes.ssm_offset + shapes.ssm_bytes]
                page.view(dtype).add_(3.0)
                shifted += 1
        row += 1
    assert row == checkpoint.num_blocks and shifted
