"""`plan_to_json`: the stable JSON form of a transfer plan (schema "hybrid-pd.plan/v1").

The schema is documented in docs/plan-json.md; change it only together with `SCHEMA`.
"""

from __future__ import annotations

from typing import Any

from shared.layout.page import EngineLayout
from shared.layout.plan import ByteRead, TransferPlan
from shared.layout.verify import verify_plan

SCHEMA = "hybrid-pd.plan/v1"


def _side(layout: EngineLayout) -> dict[str, Any]:
    s = layout.shapes
    return {
        "tp": layout.tp,
        "kv_heads_per_rank": s.kv_heads_per_rank,
        "block_size": layout.block_size,
        "kernel_block_size": layout.kernel_block_size,
        "physical_per_logical": layout.physical_per_logical,
        "page_bytes": layout.page_bytes,
        "fa_bytes_per_token": s.fa_bytes_per_token,
        "conv_bytes": s.conv_bytes,
        "ssm_bytes": s.ssm_bytes,
        "section_dims": list(s.section_dims),
        "section_bytes": list(s.section_bytes),
        "num_regions": layout.num_regions,
    }


def _read(read: ByteRead | None) -> dict[str, int] | None:
    if read is None:
        return None
    return {"remote_offset": read.remote_offset, "local_offset": read.local_offset, "bytes": read.size}


def plan_to_json(plan: TransferPlan, violations: list[str] | None = None) -> dict[str, Any]:
    """The plan as a JSON-ready dict; runs `verify_plan` unless `violations` are given."""
    found = verify_plan(plan) if violations is None else violations
    return {
        "schema": SCHEMA,
        "model": plan.decode.spec.name,
        "family": plan.decode.spec.family,
        "tp_ratio": plan.tp_ratio,
        "prefill": _side(plan.prefill),
        "decode": _side(plan.decode),
        "ranks": [
            {
                "decode_rank": rank.decode_rank,
                "fa_sources": list(rank.fa_sources),
                "mamba_sources": list(rank.mamba_sources),
                "reads": [
                    {
                        "prefill_rank": read.prefill_rank,
                        "fa": _read(read.fa),
                        "conv": [_read(c) for c in read.conv],
                        "ssm": _read(read.ssm),
                    }
                    for read in rank.reads
                ],
            }
            for rank in plan.ranks
        ],
        "verified": not found,
        "violations": list(found),
    }
