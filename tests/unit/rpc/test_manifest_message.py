"""The domain manifest and its message: every field survives the trip both ways, and a manifest
that does not fit the prefill engine it came from is refused when it arrives, naming the field."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from shared.cache.digest import DIGEST_ALGORITHM, SectionDigest
from shared.cache.manifest import Manifest, ManifestPart
from shared.engine.logprobs import TokenLogprobs
from shared.errors import Internal, ServiceError
from shared.pb.hybridpd.v1 import prefill_service_pb2 as pb
from shared.rpc.manifest_message import ManifestSource, manifest_from_message, manifest_message

SOURCE = ManifestSource("p0", num_groups=3, num_logical_blocks=16, digests_required=True, vocab_size=300, num_layers=6)


def manifest() -> Manifest:
    """At the full-N boundary: every prompt token computed, and the first output token."""
    return Manifest(
        request_id="r1",
        transfer_id="t2a",
        block_ids=(np.array([3, 4, 9], dtype=np.int64), np.array([0], dtype=np.int64), np.array([15], dtype=np.int64)),
        num_computed_tokens=41,
        prompt_token_count=41,
        lease_ns=2_000_000_001,
        lease_expire_time_ns=1_760_000_000_123_456_789,
        prefill_ns=12_345_678,
        digests=(
            SectionDigest(0, "fa", 0, b"\x01" * 16),
            SectionDigest(1, "conv", 1, b"\x02" * 16),
            SectionDigest(1, "ssm", 2, b""),
        ),
        digest_algorithm=DIGEST_ALGORITHM,
        digest_ns=987,
        first_token=299,
        skipped_tokens=32,
        engine_ns=11_000_321,
        first_logprobs=TokenLogprobs(299, -1.25, ((7, -0.5), (299, -1.25))),
        prompt_logprobs=(TokenLogprobs(4, -3.0), TokenLogprobs(9, -0.25)),
        fork_first_tokens=(12, 299),
        fork_first_logprobs=(TokenLogprobs(12, -2.0), TokenLogprobs(299, -1.25)),
    )


def test_every_field_survives_domain_to_message_to_domain() -> None:
    m = manifest()
    back = manifest_from_message(manifest_message(m), SOURCE)
    assert back == m
    for f in dataclasses.fields(Manifest):  # the comparison covers every field: change one, it differs
        value = getattr(m, f.name)
        if f.name == "block_ids":
            changed: object = (value[0] + 1, *value[1:])
        elif f.name == "digests":
            changed = value[:-1]
        elif isinstance(value, str):
            changed = value + "x"
        elif f.name == "part":  # a whole-state manifest, and the same state as one part
            changed = ManifestPart(0, 1, 0, m.num_computed_tokens)
        elif f.name == "first_logprobs":
            changed = dataclasses.replace(value, logprob=-1.5)
        elif f.name in ("prompt_logprobs", "fork_first_tokens", "fork_first_logprobs"):
            changed = value[:1]
        else:
            changed = value + 1
        assert dataclasses.replace(m, **{f.name: changed}) != back, f.name
    assert back.block_ids[0].dtype == np.int64


def test_an_n_minus_1_manifest_has_no_first_token_both_ways() -> None:
    m = dataclasses.replace(
        manifest(), num_computed_tokens=40, first_token=None, first_logprobs=None, fork_first_tokens=(), fork_first_logprobs=()
    )
    msg = manifest_message(m)
    assert not msg.HasField("first_token_id")
    assert manifest_from_message(msg, SOURCE) == m
    token_zero = dataclasses.replace(
        manifest(), first_token=0, first_logprobs=None, fork_first_tokens=(), fork_first_logprobs=()
    )  # 0 is a token, not "unset"
    assert manifest_message(token_zero).HasField("first_token_id")
    assert manifest_from_message(manifest_message(token_zero), SOURCE).first_token == 0


def test_every_field_survives_message_to_domain_to_message() -> None:
    msg = manifest_message(dataclasses.replace(manifest(), part=ManifestPart(1, 2, 32, 41)))  # the last of two parts
    assert {f.name for f, _ in msg.ListFields()} == {f.name for f in pb.Manifest.DESCRIPTOR.fields}  # all set
    assert manifest_message(manifest_from_message(msg, SOURCE)) == msg


def refusal(msg: pb.Manifest, source: ManifestSource = SOURCE) -> ServiceError:
    with pytest.raises(ServiceError) as err:
        manifest_from_message(msg, source)
    return err.value


def test_a_manifest_that_does_not_fit_its_prefill_engine_is_refused() -> None:
    msg = manifest_message(manifest())
    del msg.groups[-1]
    e = refusal(msg)
    assert (e.status, e.fields, e.reason) == ("INTERNAL", ("manifest.groups",), "BAD_MANIFEST")
    assert "2 groups; its layout has 3" in e.message and "prefill p0" in e.message

    msg = manifest_message(manifest())
    msg.groups[1].block_ids[0] = 16
    e = refusal(msg)
    assert (e.status, e.fields, e.reason) == ("INTERNAL", ("manifest.groups.block_ids",), "BAD_MANIFEST")
    assert "block id 16 >= its 16 blocks" in e.message

    msg = manifest_message(manifest())
    msg.groups[2].block_ids[0] = 3
    e = refusal(msg)
    assert (e.fields, e.reason) == (("manifest.groups.block_ids",), "BAD_MANIFEST") and "duplicated" in e.message

    msg = manifest_message(manifest())
    msg.num_computed_tokens = 42
    assert refusal(msg).fields == ("manifest.num_computed_tokens",)

    msg = manifest_message(manifest())
    msg.digests[0].section = pb.STATE_SECTION_UNSPECIFIED
    assert refusal(msg).fields == ("manifest.digests",)

    msg = manifest_message(manifest())
    msg.num_computed_tokens = 40  # a first token needs the whole prompt computed
    e = refusal(msg)
    assert (e.status, e.fields, e.reason) == ("INTERNAL", ("manifest.first_token_id",), "BAD_MANIFEST")
    assert "40 of 41 prompt tokens" in e.message

    msg = manifest_message(manifest())
    msg.first_token_id = 300
    e = refusal(msg)
    assert e.fields == ("manifest.first_token_id",) and "300 >= the vocabulary's 300" in e.message


def test_missing_digests_are_refused_only_where_they_are_checked() -> None:
    bare = manifest_message(dataclasses.replace(manifest(), digests=(), digest_algorithm=""))
    e = refusal(bare)
    assert (e.status, e.fields, e.reason) == ("FAILED_PRECONDITION", ("manifest.digest_algorithm",), "NO_DIGESTS")
    assert "sent no digests" in e.message
    other = manifest_message(dataclasses.replace(manifest(), digest_algorithm="sha256"))
    assert "digests of kind 'sha256'" in refusal(other).message
    unchecked = dataclasses.replace(SOURCE, digests_required=False)
    assert manifest_from_message(bare, unchecked).digests == ()


def test_a_part_survives_both_ways_and_one_that_does_not_fit_is_refused() -> None:
    whole = dataclasses.replace(
        manifest(),
        first_token=None,
        first_logprobs=None,
        fork_first_tokens=(),
        fork_first_logprobs=(),
        num_computed_tokens=40,
        skipped_tokens=0,
    )
    first = dataclasses.replace(whole, part=ManifestPart(0, 3, 0, 16))
    last = dataclasses.replace(whole, part=ManifestPart(2, 3, 32, 40))
    for m in (first, last):
        back = manifest_from_message(manifest_message(m), SOURCE)
        assert back == m and back.part == m.part
    assert not first.last and last.last and whole.last and (first.tokens_from, first.tokens_to) == (0, 16)
    assert (whole.tokens_from, whole.tokens_to) == (0, 40)
    bad = {
        "manifest.part.index": ManifestPart(3, 3, 32, 40),
        "manifest.part.tokens_to": ManifestPart(0, 3, 16, 16),
        "manifest.part": ManifestPart(1, 3, 16, 40),  # ends the tokens, not the last
    }
    for field, part in bad.items():
        with pytest.raises(ServiceError) as refused:
            manifest_from_message(manifest_message(dataclasses.replace(whole, part=part)), SOURCE)
        assert refused.value.status == "INTERNAL" and refused.value.issues[0].field == field, field
    with pytest.raises(ServiceError) as early:
        manifest_from_message(manifest_message(dataclasses.replace(first, first_token=7, num_computed_tokens=41)), SOURCE)
    assert early.value.issues[0].field == "manifest.first_token_id"


def test_parts_after_a_cached_prefix_start_at_it() -> None:
    """Decode's prefix cache and parts: a whole manifest's K/V starts after the skipped tokens,
    and a part may not start inside them."""
    whole = dataclasses.replace(
        manifest(),
        first_token=None,
        first_logprobs=None,
        fork_first_tokens=(),
        fork_first_logprobs=(),
        num_computed_tokens=40,
        skipped_tokens=16,
    )
    assert (whole.tokens_from, whole.tokens_to) == (16, 40)
    first = dataclasses.replace(whole, part=ManifestPart(0, 2, 16, 32))
    back = manifest_from_message(manifest_message(first), SOURCE)
    assert back == first and (back.tokens_from, back.skipped_tokens) == (16, 16)
    with pytest.raises(ServiceError) as inside:
        manifest_from_message(manifest_message(dataclasses.replace(whole, part=ManifestPart(0, 2, 0, 32))), SOURCE)
    assert inside.value.status == "INTERNAL" and inside.value.issues[0].field == "manifest.part.tokens_from"


def test_a_layer_part_survives_both_ways_and_one_that_does_not_fit_is_refused() -> None:
    """Layer parts split the last chunk's tokens by model layers; the one reaching the last layer
    is the last part, and a range outside the model or before the last chunk is refused."""
    whole = dataclasses.replace(
        manifest(),
        first_token=None,
        first_logprobs=None,
        fork_first_tokens=(),
        fork_first_logprobs=(),
        num_computed_tokens=40,
        skipped_tokens=0,
    )
    middle = dataclasses.replace(whole, part=ManifestPart(1, 3, 32, 40, range(0, 4)))
    last = dataclasses.replace(whole, part=ManifestPart(2, 3, 32, 40, range(4, 6)))
    for m in (middle, last):
        msg = manifest_message(m)
        assert (msg.part.layers_from, msg.part.layers_to) == (m.part.layers.start, m.part.layers.stop)  # type: ignore[union-attr]
        back = manifest_from_message(msg, SOURCE)
        assert back == m and back.layers == m.layers
    assert not middle.last and last.last and middle.ends_prompt and last.ends_prompt
    assert whole.layers is None and manifest_message(whole).part.layers_to == 0
    token_part = dataclasses.replace(whole, part=ManifestPart(0, 3, 0, 32))
    assert not token_part.ends_prompt and token_part.layers is None
    assert dataclasses.replace(middle, part=ManifestPart(1, 3, 32, 40, range(0, 5))) != middle  # layers compare
    bad = {
        "manifest.part.layers_to": ManifestPart(2, 3, 32, 40, range(4, 7)),  # past the model's 6 layers
        "manifest.part.layers_from": ManifestPart(0, 3, 0, 32, range(0, 4)),  # before the last chunk
        "manifest.part": ManifestPart(2, 3, 32, 40, range(0, 4)),  # the last part, but not the last layer
    }
    for field, part in bad.items():
        with pytest.raises(ServiceError) as refused:
            manifest_from_message(manifest_message(dataclasses.replace(whole, part=part)), SOURCE)
        assert refused.value.status == "INTERNAL" and refused.value.issues[0].field == field, field
    msg = manifest_message(middle)
    msg.part.layers_from = 4  # an empty range
    msg.part.layers_to = 4
    with pytest.raises(ServiceError) as empty:
        manifest_from_message(msg, SOURCE)
    assert empty.value.issues[0].field == "manifest.part.layers_to"
    unknown = dataclasses.replace(SOURCE, num_layers=0)  # a source whose layer count decode does not know
    with pytest.raises(ServiceError):
        manifest_from_message(manifest_message(middle), unknown)


def test_first_token_logprobs_come_only_with_their_token() -> None:
    msg = manifest_message(manifest())
    msg.first_token_logprobs.token_id = 300
    with pytest.raises(Internal) as e:
        manifest_from_message(msg, SOURCE)
    assert e.value.fields == ("manifest.first_token_logprobs",)
