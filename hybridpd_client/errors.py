"""A failed Generate: the gRPC status, message, stable reason and the fields at fault."""

from __future__ import annotations

import grpc

from shared.rpc.status import describe

RETRYABLE = frozenset({"UNAVAILABLE", "RESOURCE_EXHAUSTED"})


class GenerateError(Exception):
    def __init__(self, status: str, message: str, reason: str = "", fields: tuple[str, ...] = ()) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status  # gRPC status name: INVALID_ARGUMENT, UNAVAILABLE, ...
        self.message = message
        self.reason = reason  # e.g. CACHE_FULL, DRAINING, LEASE_EXPIRED
        self.fields = fields  # request fields at fault, e.g. ("max_tokens",)

    @property
    def retryable(self) -> bool:
        return self.status in RETRYABLE

    @classmethod
    def from_rpc(cls, error: grpc.RpcError) -> GenerateError:
        failure = describe(error)
        return cls(failure.status, failure.message, failure.reason, failure.fields)
