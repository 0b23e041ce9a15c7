"""proto_time builds and reads Durations field by field: the same fields as protobuf's own helpers."""

from __future__ import annotations

from google.protobuf import duration_pb2

from shared.rpc import proto_time

VALUES_NS = [0, 1, 999_999_999, 1_000_000_000, 1_234_567_890_123, -1, -999_999_999, -1_000_000_000, -1_500_000_000]


def _protobuf(ns: int) -> duration_pb2.Duration:
    d = duration_pb2.Duration()
    d.FromNanoseconds(ns)
    return d


def test_nanoseconds_set_the_fields_protobuf_sets_and_read_back_exactly() -> None:
    for ns in VALUES_NS:
        ours = proto_time.nanoseconds(ns)
        assert (ours.seconds, ours.nanos) == (_protobuf(ns).seconds, _protobuf(ns).nanos), ns
        assert proto_time.to_nanoseconds(ours) == _protobuf(ns).ToNanoseconds() == ns
    # Negative control: plain floor division gives other fields for a negative duration
    # (seconds -1, nanos 999999999 for -1 ns), which the sign rule above must correct.
    assert divmod(-1, proto_time.NANOS_PER_SECOND) != (_protobuf(-1).seconds, _protobuf(-1).nanos)


def test_seconds_round_trip_and_clamp_like_before() -> None:
    for s in (0.0, 1e-9, 0.5, 2.25, 12345.678901234):
        expected = _protobuf(int(s * 1e9))
        assert proto_time.duration(s) == expected
        assert proto_time.seconds(proto_time.duration(s)) == expected.ToNanoseconds() / 1e9
    assert proto_time.duration(-3.0) == duration_pb2.Duration()  # negative clamps to zero
