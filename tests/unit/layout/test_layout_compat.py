"""The pairing rules have one home: the handshake and the plan read the same facts and ask the
same functions, so they cannot disagree about a pair."""

from __future__ import annotations

import dataclasses

from shared.layout.compat import EngineFacts, handshake_issues, layout_issues
from shared.layout.page import EngineLayout, build_engine_layout
from shared.layout.presets import PRESETS, get_preset
from shared.pb.hybridpd.v1 import layout_pb2 as pb
from shared.rpc.compat import facts_of
from shared.runtime.layout_message import RankMemory, engine_layout_message
from shared.runtime.protocol_version import PROTOCOL_VERSION


def message_of(layout: EngineLayout, engine_id: str) -> pb.EngineLayout:
    ranks = [RankMemory(f"{engine_id}-r{r}", b"meta", "cpu", 0, (1,) * layout.num_regions) for r in range(layout.tp)]
    return engine_layout_message(layout, role="decode", engine_id=engine_id, incarnation=3, num_logical_blocks=8, ranks=ranks)


def test_a_layout_and_its_message_state_the_same_facts() -> None:
    for name in sorted(PRESETS):
        layout = build_engine_layout(get_preset(name), 1, kernel_block_size=16)
        want = EngineFacts.of(layout, protocol_version=PROTOCOL_VERSION, engine_id="e")
        assert facts_of(message_of(layout, "e")) == want, name


def test_the_handshake_refuses_every_pair_the_plan_refuses() -> None:
    spec = get_preset("tiny-mamba2")
    base = build_engine_layout(spec, 2, kernel_block_size=16)
    for other in (
        build_engine_layout(spec.with_dtypes(kv="bf16"), 2, kernel_block_size=16),
        build_engine_layout(get_preset("tiny-gdn"), 2, kernel_block_size=16),
        build_engine_layout(dataclasses.replace(spec, num_spec_tokens=1), 2, kernel_block_size=16),
        build_engine_layout(spec, 1, kernel_block_size=16),  # compatible: both say so
    ):
        plan = {i.field for i in layout_issues(base, other)}
        live = {
            i.field
            for i in handshake_issues(
                facts_of(message_of(base, "p")), facts_of(message_of(other, "d")), this_version=PROTOCOL_VERSION
            )
        }
        # Dimensions the message does not carry are covered by the fingerprint.
        assert live == (plan - {"model.model_type", "model.layer_kinds", "model.attention", "model.ssm", "conv_rows"}) | (
            {"model.fingerprint"} if plan else set()
        )
