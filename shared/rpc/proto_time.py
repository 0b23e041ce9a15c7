"""google.protobuf.Duration <-> seconds."""

from __future__ import annotations

from google.protobuf import duration_pb2


def duration(seconds: float) -> duration_pb2.Duration:
    """A Duration of `seconds` (negative values clamp to zero)."""
    d = duration_pb2.Duration()
    d.FromNanoseconds(int(max(0.0, seconds) * 1e9))
    return d


def seconds(d: duration_pb2.Duration) -> float:
    return d.ToNanoseconds() / 1e9


def nanoseconds(ns: int) -> duration_pb2.Duration:
    """A Duration of exactly `ns` nanoseconds."""
    d = duration_pb2.Duration()
    d.FromNanoseconds(ns)
    return d
