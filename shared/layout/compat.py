"""Can a prefill engine and a decode engine exchange state? The pairing rules, in one place.

The rules read `EngineFacts`: what pairing depends on, as an engine states it. The handshake
builds them from the peer's layout message (before anything is rebuilt: a peer of another model
cannot be rebuilt with our spec), the plan from two `EngineLayout`s. Both ask the same
functions, so the handshake and `build_plan` cannot disagree about a pair:
- `pairing_issues`: what both engines must agree on, and the TP sizes that must divide;
- `handshake_issues`: those, plus what only two live engines can get wrong (protocol versions,
  the conv layout, kernel block sizes, clashing engine ids);
- `spec_issues`: the model's dimensions, which only full layouts carry (at the handshake the
  fingerprint covers them).
Every issue names the layout message's field and both values, and says it in words for the plan.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.layout.page import EngineLayout

Groups = tuple[tuple[str, tuple[int, ...]], ...]  # (kind, layers) per KV-cache group


@dataclass(frozen=True)
class EngineFacts:
    """What pairing looks at, in human form (dtypes as "fp32", the conv layout as "ds")."""

    model_name: str
    fingerprint: str
    family: str
    kv_dtype: str
    conv_dtype: str
    ssm_dtype: str
    num_layers: int
    num_spec_tokens: int
    vocab_size: int
    num_regions: int
    groups: Groups
    tp: int
    kernel_block_size: int
    conv_layout: str = "ds"  # our layout math always stores conv state dim-major per rank
    boundary: str = "n-1"  # where prefill stops (shared/layout/boundary.py): the engine's, not the layout's
    protocol_version: int = 0  # 0: not a live engine (a layout the plan was given)
    engine_id: str = ""

    @classmethod
    def of(cls, layout: EngineLayout, *, protocol_version: int = 0, engine_id: str = "", boundary: str = "n-1") -> EngineFacts:
        spec = layout.spec
        return cls(
            model_name=spec.name,
            fingerprint=spec.fingerprint(),
            family=spec.family,
            kv_dtype=spec.kv_dtype,
            conv_dtype=spec.conv_dtype,
            ssm_dtype=spec.ssm_dtype,
            num_layers=spec.num_layers,
            num_spec_tokens=spec.num_spec_tokens,
            vocab_size=spec.vocab_size,
            num_regions=layout.num_regions,
            groups=tuple((g.kind, tuple(g.layers)) for g in layout.groups),
            tp=layout.tp,
            kernel_block_size=layout.kernel_block_size,
            protocol_version=protocol_version,
            engine_id=engine_id,
            boundary=boundary,
        )


@dataclass(frozen=True)
class PairingIssue:
    field: str  # the layout message's field path, e.g. "model.kv_dtype"
    description: str  # both values, e.g. "prefill fp32, decode fp8"
    words: str  # the same for a person reading a plan error, e.g. "KV dtype differs: prefill fp32, decode fp8"


def _shown(field: str, value: object) -> str:
    if field == "model.fingerprint":
        return str(value)[:12]
    if isinstance(value, str) and not field.endswith(("dtype", "family", "conv_layout", "boundary")):
        return repr(value)
    return str(value)


# (message field, the same in words, the fact): values both engines must state identically.
MUST_MATCH: tuple[tuple[str, str, str], ...] = (
    ("protocol_version", "protocol version", "protocol_version"),
    ("model.name", "model", "model_name"),
    ("model.fingerprint", "model fingerprint", "fingerprint"),
    ("model.family", "SSM family", "family"),
    ("model.kv_dtype", "KV dtype", "kv_dtype"),
    ("model.conv_dtype", "conv dtype", "conv_dtype"),
    ("model.ssm_dtype", "SSM dtype", "ssm_dtype"),
    ("model.num_layers", "layer count", "num_layers"),
    ("model.num_spec_tokens", "speculative conv rows", "num_spec_tokens"),
    ("model.vocab_size", "vocabulary size", "vocab_size"),
    ("conv_layout", "conv layout", "conv_layout"),
    ("boundary", "prefill/decode boundary (--boundary)", "boundary"),
    ("num_regions", "regions", "num_regions"),
)


def _mismatch(field: str, words: str, prefill: object, decode: object) -> PairingIssue:
    description = f"prefill {_shown(field, prefill)}, decode {_shown(field, decode)}"
    return PairingIssue(field, description, f"{words} differs: {description}")


def _tp_issue(prefill: EngineFacts, decode: EngineFacts) -> list[PairingIssue]:
    p, d = prefill.tp, decode.tp
    if p >= 1 and d >= 1 and max(p, d) % min(p, d) == 0:
        return []
    description = f"prefill {p}, decode {d}: the larger must be a multiple of the smaller"
    return [PairingIssue("tp_size", description, f"TP sizes do not divide: {description}")]


def pairing_issues(prefill: EngineFacts, decode: EngineFacts) -> list[PairingIssue]:
    """Everything that keeps this pair from exchanging state, whatever the engines' code."""
    issues = [
        _mismatch(field, words, getattr(prefill, fact), getattr(decode, fact))
        for field, words, fact in MUST_MATCH
        if getattr(prefill, fact) != getattr(decode, fact)
    ]
    if prefill.groups != decode.groups:
        issues.append(PairingIssue("groups", "the KV-cache groups (kinds and layers) differ", "KV-cache groups differ"))
    return issues + _tp_issue(prefill, decode)


def handshake_issues(prefill: EngineFacts, decode: EngineFacts, *, this_version: int) -> list[PairingIssue]:
    """`pairing_issues` and what two live engines add: a protocol this build does not speak,
    a conv layout head-sharded reads cannot use, kernel block sizes of which neither divides the
    other, and one engine id for both (their NIXL agent names would clash)."""
    issues = pairing_issues(prefill, decode)
    if prefill.protocol_version == decode.protocol_version:
        for side, facts in (("prefill", prefill), ("decode", decode)):
            if facts.protocol_version != this_version:
                said = f"{side} speaks {facts.protocol_version}, this build {this_version}"
                issues.append(PairingIssue("protocol_version", said, f"protocol version: {said}"))
                break
    for side, facts in (("prefill", prefill), ("decode", decode)):
        if facts.conv_layout != "ds":
            said = f"{side} uses {facts.conv_layout}; head-sharded transfers need ds"
            issues.append(PairingIssue("conv_layout", said, f"conv layout: {said}"))
    kp, kd = prefill.kernel_block_size, decode.kernel_block_size
    if kp and kd and max(kp, kd) % min(kp, kd):
        said = f"prefill {kp}, decode {kd}: neither divides the other"
        issues.append(PairingIssue("kernel_block_size", said, f"kernel block sizes: {said}"))
    if prefill.engine_id and prefill.engine_id == decode.engine_id:
        said = f"both engines are named {prefill.engine_id!r}; NIXL agent names would clash"
        issues.append(PairingIssue("engine_id", said, f"engine ids: {said}"))
    return issues


def spec_issues(prefill: EngineLayout, decode: EngineLayout) -> list[PairingIssue]:
    """The model's dimensions and layer kinds, which two full layouts carry."""
    p, d = prefill.spec, decode.spec
    return [
        PairingIssue(field, f"prefill {a!r}, decode {b!r}", f"{words} differs: prefill {a!r}, decode {b!r}")
        for field, words, a, b in (
            ("model.model_type", "model type", p.model_type, d.model_type),
            ("model.layer_kinds", "layer kinds", p.layer_kinds, d.layer_kinds),
            ("model.attention", "attention dims", p.attention, d.attention),
            ("model.ssm", "SSM dims", p.ssm, d.ssm),
            ("conv_rows", "conv rows", prefill.shapes.conv_rows, decode.shapes.conv_rows),
        )
        if a != b
    ]


def layout_issues(prefill: EngineLayout, decode: EngineLayout) -> list[PairingIssue]:
    """Every reason two layouts cannot exchange state (empty when they can)."""
    return pairing_issues(EngineFacts.of(prefill), EngineFacts.of(decode)) + spec_issues(prefill, decode)
