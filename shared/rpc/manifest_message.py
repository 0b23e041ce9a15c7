"""`shared.cache.manifest.Manifest` <-> the `hybridpd.v1.Manifest` message.

Prefill builds the message from its domain manifest (`manifest_message`, trusted). Decode turns
the message into a domain manifest once, when it arrives (`manifest_from_message`), and refuses
one that does not fit the prefill engine it came from, naming the field: group count and block
ids against the peer's layout, a first token outside the vocabulary or without the whole prompt
computed, a skipped prefix longer than the computed tokens, a part whose token range does not
fit or starts inside the skipped prefix, a layer part outside the model's layers or before the
last chunk (INTERNAL, BAD_MANIFEST: a peer bug), digests missing
or of another kind while decode checks them (FAILED_PRECONDITION, NO_DIGESTS: a configuration
mismatch). Nothing of a refused manifest is read.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from shared.cache.digest import DIGEST_ALGORITHM, Section, SectionDigest
from shared.cache.manifest import IntArray, Manifest, ManifestPart
from shared.engine.logprobs import TokenLogprobs
from shared.errors import FailedPrecondition, Internal
from shared.pb.hybridpd.v1 import prefill_service_pb2 as pb
from shared.rpc.logprobs_message import logprobs_message, logprobs_of
from shared.rpc.proto_time import set_nanoseconds, to_nanoseconds

SECTION_ENUM: dict[Section, pb.StateSection.ValueType] = {
    "fa": pb.STATE_SECTION_FA,
    "conv": pb.STATE_SECTION_CONV,
    "ssm": pb.STATE_SECTION_SSM,
}
SECTION_NAMES: dict[int, Section] = {v: k for k, v in SECTION_ENUM.items()}


@dataclass(frozen=True)
class ManifestSource:
    """The prefill engine a manifest comes from, as far as checking it needs."""

    engine_id: str
    num_groups: int
    num_logical_blocks: int
    digests_required: bool  # this decode engine checks digests (--verify-transfer digest)
    vocab_size: int = 0  # the model's; a first token must be below it (0: unchecked)
    num_layers: int = 0  # the model's; a layer part's range must lie inside it (0: layer parts refused)


def manifest_message(m: Manifest) -> pb.Manifest:
    msg = pb.Manifest(
        request_id=m.request_id,
        transfer_id=m.transfer_id,
        groups=[pb.GroupBlocks(block_ids=ids.tolist()) for ids in m.block_ids],
        num_computed_tokens=m.num_computed_tokens,
        prompt_token_count=m.prompt_token_count,
        digests=[
            pb.StateDigest(prefill_rank=d.rank, section=SECTION_ENUM[d.section], group=d.group, digest=d.digest)
            for d in m.digests
        ],
        digest_algorithm=m.digest_algorithm,
        skipped_prompt_tokens=m.skipped_tokens,
    )
    msg.lease_expire_time.FromNanoseconds(m.lease_expire_time_ns)
    set_nanoseconds(msg.lease_duration, m.lease_ns)
    set_nanoseconds(msg.prefill_duration, m.prefill_ns)
    set_nanoseconds(msg.digest_duration, m.digest_ns)
    set_nanoseconds(msg.engine_duration, m.engine_ns)
    if m.first_token is not None:
        msg.first_token_id = m.first_token
    if m.first_logprobs is not None:
        msg.first_token_logprobs.CopyFrom(logprobs_message(m.first_logprobs))
    if m.prompt_logprobs is not None:
        msg.prompt_logprobs.extend(logprobs_message(lp) for lp in m.prompt_logprobs)
    msg.fork_first_token_ids.extend(m.fork_first_tokens)
    msg.fork_first_token_logprobs.extend(logprobs_message(lp) for lp in m.fork_first_logprobs)
    if m.part is not None:
        p = m.part
        msg.part.CopyFrom(pb.ManifestPart(index=p.index, count=p.count, tokens_from=p.tokens_from, tokens_to=p.tokens_to))
        if p.layers is not None:
            msg.part.layers_from, msg.part.layers_to = p.layers.start, p.layers.stop
    return msg


def _bad(message: str, field: str) -> Internal:
    return Internal(message, field=field, reason="BAD_MANIFEST")


def _block_ids(msg: pb.Manifest, source: ManifestSource) -> tuple[IntArray, ...]:
    peer = source.engine_id
    if len(msg.groups) != source.num_groups:
        raise _bad(
            f"prefill {peer} sent a manifest with {len(msg.groups)} groups; its layout has {source.num_groups}", "manifest.groups"
        )
    # Each group's repeated field to numpy in one copy (upb hands numpy its ids; no Python int
    # per id), concatenated; each group's ids are then a run of that one array.
    fields = [np.asarray(g.block_ids, dtype=np.int64) for g in msg.groups]
    counts = [ids.size for ids in fields]
    flat = np.concatenate(fields) if fields else np.zeros(0, dtype=np.int64)
    blocks, start = [], 0
    for n in counts:
        blocks.append(flat[start : start + n])
        start += n
    everything = np.sort(flat)
    if everything.size and int(everything[-1]) >= source.num_logical_blocks:
        raise _bad(
            f"prefill {peer} sent block id {int(everything[-1])} >= its {source.num_logical_blocks} blocks",
            "manifest.groups.block_ids",
        )
    if everything.size > 1 and bool((everything[1:] == everything[:-1]).any()):  # sorted: duplicates are neighbours
        raise _bad(f"prefill {peer} sent a manifest with duplicated block ids", "manifest.groups.block_ids")
    return tuple(blocks)


def _digests(msg: pb.Manifest, source: ManifestSource) -> tuple[SectionDigest, ...]:
    if source.digests_required and msg.digest_algorithm != DIGEST_ALGORITHM:
        said = f"digests of kind {msg.digest_algorithm!r}" if msg.digest_algorithm else "no digests"
        raise FailedPrecondition(
            f"prefill {source.engine_id} sent {said}; this decode engine checks {DIGEST_ALGORITHM} digests "
            "(run both services with the same --verify-transfer)",
            field="manifest.digest_algorithm",
            reason="NO_DIGESTS",
        )
    digests: list[SectionDigest] = []
    for d in msg.digests:
        if d.section not in SECTION_NAMES:
            raise _bad(f"prefill {source.engine_id} sent a digest of unknown section {d.section}", "manifest.digests")
        digests.append(SectionDigest(d.prefill_rank, SECTION_NAMES[d.section], d.group, d.digest))
    return tuple(digests)


def _first_token(msg: pb.Manifest, source: ManifestSource) -> int | None:
    """The full-N boundary's first token: it follows the whole prompt, and is a token."""
    if not msg.HasField("first_token_id"):
        return None
    peer, token = source.engine_id, msg.first_token_id
    if msg.num_computed_tokens != msg.prompt_token_count:
        raise _bad(
            f"prefill {peer} sent a first token with {msg.num_computed_tokens} of {msg.prompt_token_count} prompt tokens "
            "computed (the full-N boundary computes them all)",
            "manifest.first_token_id",
        )
    if source.vocab_size and token >= source.vocab_size:
        raise _bad(f"prefill {peer} sent first token {token} >= the vocabulary's {source.vocab_size}", "manifest.first_token_id")
    return int(token)


def _fork_first_tokens(msg: pb.Manifest, first_token: int | None, source: ManifestSource) -> tuple[int, ...]:
    """The forks' first tokens come only with a first token, and are tokens."""
    tokens = tuple(int(t) for t in msg.fork_first_token_ids)
    if tokens and (first_token is None or (source.vocab_size and max(tokens) >= source.vocab_size)):
        raise _bad(
            f"prefill {source.engine_id} sent fork first tokens {list(tokens[:4])} with first token {first_token}",
            "manifest.fork_first_token_ids",
        )
    return tokens


def _first_logprobs(msg: pb.Manifest, first_token: int | None, source: ManifestSource) -> TokenLogprobs | None:
    """The first token's logprobs come only with that token."""
    if not msg.HasField("first_token_logprobs"):
        return None
    lp = msg.first_token_logprobs
    if first_token is None or lp.token_id != first_token:
        raise _bad(
            f"prefill {source.engine_id} sent logprobs of token {lp.token_id} with first token {first_token}",
            "manifest.first_token_logprobs",
        )
    return logprobs_of(lp)


def _layers(p: pb.ManifestPart, msg: pb.Manifest, source: ManifestSource) -> range | None:
    """A layer part's range lies inside the model's layers, and its tokens reach the end of the
    computed ones (layer parts split the last chunk only)."""
    if p.layers_from == p.layers_to == 0:
        return None
    peer = source.engine_id
    if not p.layers_from < p.layers_to <= source.num_layers:
        raise _bad(
            f"prefill {peer} sent a part of layers {p.layers_from}..{p.layers_to}; the model has {source.num_layers} layers",
            "manifest.part.layers_to",
        )
    if p.tokens_to != msg.num_computed_tokens:
        raise _bad(
            f"prefill {peer} sent a part of layers {p.layers_from}..{p.layers_to} ending at token {p.tokens_to}, "
            f"before the {msg.num_computed_tokens} computed (layer parts split the last chunk)",
            "manifest.part.layers_from",
        )
    return range(p.layers_from, p.layers_to)


def _part(msg: pb.Manifest, source: ManifestSource) -> ManifestPart | None:
    """A part's range must lie inside the computed tokens (a layer part's layers inside the
    model's), and only the last part carries the first token or reaches the end: of the tokens,
    and of the layers for a layer part."""
    if not msg.HasField("part"):
        return None
    peer, p = source.engine_id, msg.part
    layers = _layers(p, msg, source)
    part = ManifestPart(p.index, p.count, p.tokens_from, p.tokens_to, layers)
    if not 0 <= p.index < p.count:
        raise _bad(f"prefill {peer} sent part index {p.index} of {p.count} parts", "manifest.part.index")
    if not p.tokens_from < p.tokens_to <= msg.num_computed_tokens:
        raise _bad(
            f"prefill {peer} sent {part.describe()} of {msg.num_computed_tokens} computed tokens", "manifest.part.tokens_to"
        )
    if p.tokens_from < msg.skipped_prompt_tokens:
        raise _bad(
            f"prefill {peer} sent {part.describe()}, but skipped the first {msg.skipped_prompt_tokens} prompt tokens",
            "manifest.part.tokens_from",
        )
    ends = p.tokens_to == msg.num_computed_tokens and (layers is None or layers.stop == source.num_layers)
    if part.last != ends:
        raise _bad(
            f"prefill {peer} sent {part.describe()}: only the last part ends the computed tokens and layers", "manifest.part"
        )
    if not part.last and msg.HasField("first_token_id"):
        raise _bad(f"prefill {peer} sent a first token with {part.describe()}", "manifest.first_token_id")
    return part


def manifest_from_message(msg: pb.Manifest, source: ManifestSource) -> Manifest:
    """The domain manifest, or the error that names what does not fit `source`."""
    blocks = _block_ids(msg, source)
    if msg.num_computed_tokens > msg.prompt_token_count:
        raise _bad(
            f"prefill {source.engine_id}: num_computed_tokens {msg.num_computed_tokens} > prompt {msg.prompt_token_count}",
            "manifest.num_computed_tokens",
        )
    if msg.skipped_prompt_tokens > msg.num_computed_tokens:
        raise _bad(
            f"prefill {source.engine_id}: skipped_prompt_tokens {msg.skipped_prompt_tokens} > num_computed_tokens "
            f"{msg.num_computed_tokens}",
            "manifest.skipped_prompt_tokens",
        )
    first_token = _first_token(msg, source)
    return Manifest(
        request_id=msg.request_id,
        transfer_id=msg.transfer_id,
        block_ids=blocks,
        num_computed_tokens=msg.num_computed_tokens,
        prompt_token_count=msg.prompt_token_count,
        lease_ns=to_nanoseconds(msg.lease_duration),
        lease_expire_time_ns=msg.lease_expire_time.ToNanoseconds(),
        prefill_ns=to_nanoseconds(msg.prefill_duration),
        digests=_digests(msg, source),
        digest_algorithm=msg.digest_algorithm,
        digest_ns=to_nanoseconds(msg.digest_duration),
        first_token=first_token,
        part=_part(msg, source),
        skipped_tokens=msg.skipped_prompt_tokens,
        engine_ns=to_nanoseconds(msg.engine_duration),
        first_logprobs=_first_logprobs(msg, first_token, source),
        prompt_logprobs=tuple(logprobs_of(lp) for lp in msg.prompt_logprobs) if msg.prompt_logprobs else None,
        fork_first_tokens=_fork_first_tokens(msg, first_token, source),
        fork_first_logprobs=tuple(logprobs_of(lp) for lp in msg.fork_first_token_logprobs),
    )
