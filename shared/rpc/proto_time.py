"""google.protobuf.Duration <-> seconds and nanoseconds.

Built from and read as their two fields: protobuf's FromNanoseconds / ToNanoseconds are Python
functions, a few calls each, on every request's path. The arithmetic is theirs (a negative
duration carries negative nanos).
"""

from __future__ import annotations

from google.protobuf import duration_pb2

NANOS_PER_SECOND = 1_000_000_000


def duration(seconds: float) -> duration_pb2.Duration:
    """A Duration of `seconds` (negative values clamp to zero)."""
    whole, nanos = divmod(int(max(0.0, seconds) * 1e9), NANOS_PER_SECOND)
    return duration_pb2.Duration(seconds=whole, nanos=nanos)


def seconds(d: duration_pb2.Duration) -> float:
    return (d.seconds * NANOS_PER_SECOND + d.nanos) / 1e9


def nanoseconds(ns: int) -> duration_pb2.Duration:
    """A Duration of exactly `ns` nanoseconds."""
    d = duration_pb2.Duration()
    set_nanoseconds(d, ns)
    return d


def set_nanoseconds(d: duration_pb2.Duration, ns: int) -> None:
    """Set `d` (a message's Duration field) to exactly `ns` nanoseconds."""
    whole, nanos = divmod(ns, NANOS_PER_SECOND)
    if whole < 0 and nanos > 0:
        whole, nanos = whole + 1, nanos - NANOS_PER_SECOND
    d.seconds, d.nanos = whole, nanos


def to_nanoseconds(d: duration_pb2.Duration) -> int:
    return d.seconds * NANOS_PER_SECOND + d.nanos
