"""Domain errors: what went wrong, which field, and the gRPC status a client should see.

Services raise these; `shared.rpc.interceptors` turns them into statuses with the message and
field details intact. Anything else that escapes a handler is a bug and reaches the client as
INTERNAL with a generic message (the details go to the log). No gRPC import here: the status is
named by its canonical string, so the layout and engine code can raise these too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True)
class FieldIssue:
    """One problem with one field: `field` is a dotted path (`layout.model.kv_dtype`)."""

    field: str
    description: str

    def __str__(self) -> str:
        return f"{self.field}: {self.description}"


class ServiceError(Exception):
    """Base of every error that maps to a specific gRPC status."""

    status: ClassVar[str] = "INTERNAL"
    # Stable UPPER_SNAKE reason for clients to switch on (google.rpc.ErrorInfo.reason).
    default_reason: ClassVar[str] = "INTERNAL"
    retryable: ClassVar[bool] = False

    def __init__(
        self,
        message: str,
        *,
        field: str | None = None,
        issues: tuple[FieldIssue, ...] | list[FieldIssue] = (),
        reason: str | None = None,
        retry_after_seconds: float | None = None,
    ) -> None:
        issue_list = list(issues)
        if field is not None:
            issue_list.insert(0, FieldIssue(field, message))
            if not message.startswith(field):
                message = f"{field}: {message}"
        super().__init__(message)
        self.message = message
        self.issues: tuple[FieldIssue, ...] = tuple(issue_list)
        self.reason = reason or self.default_reason
        self.retry_after_seconds = retry_after_seconds

    @property
    def fields(self) -> tuple[str, ...]:
        return tuple(i.field for i in self.issues)


class InvalidArgument(ServiceError):
    """The request itself is wrong (bad value, out of range, malformed); retrying cannot help."""

    status = "INVALID_ARGUMENT"
    default_reason = "INVALID_ARGUMENT"


class NotFound(ServiceError):
    status = "NOT_FOUND"
    default_reason = "NOT_FOUND"


class AlreadyExists(ServiceError):
    """Something with this name is already there (a request id already in flight)."""

    status = "ALREADY_EXISTS"
    default_reason = "ALREADY_EXISTS"


class FailedPrecondition(ServiceError):
    """The system is not in a state where this can work (incompatible peer, no handshake yet)."""

    status = "FAILED_PRECONDITION"
    default_reason = "FAILED_PRECONDITION"


class IncompatibleLayout(FailedPrecondition):
    """A prefill/decode pair that cannot exchange state; `issues` names every differing field."""

    default_reason = "INCOMPATIBLE_LAYOUT"


class Aborted(ServiceError):
    """The work was lost midway (lease expired, peer restarted); retry from the start."""

    status = "ABORTED"
    default_reason = "ABORTED"


class ResourceExhausted(ServiceError):
    """Out of cache blocks or capacity; may succeed later."""

    status = "RESOURCE_EXHAUSTED"
    default_reason = "RESOURCE_EXHAUSTED"
    retryable = True


class Unavailable(ServiceError):
    """Draining, not ready, or a peer is unreachable; retry with backoff."""

    status = "UNAVAILABLE"
    default_reason = "UNAVAILABLE"
    retryable = True


class DeadlineExceeded(ServiceError):
    status = "DEADLINE_EXCEEDED"
    default_reason = "DEADLINE_EXCEEDED"


class Cancelled(ServiceError):
    status = "CANCELLED"
    default_reason = "CANCELLED"


class DataLoss(ServiceError):
    """Transferred state differs from what the sender wrote (a verification failed)."""

    status = "DATA_LOSS"
    default_reason = "STATE_MISMATCH"


class Internal(ServiceError):
    """A broken invariant, reported with a message that is safe to show."""

    status = "INTERNAL"


ERRORS_BY_STATUS: dict[str, type[ServiceError]] = {
    cls.status: cls
    for cls in (
        InvalidArgument,
        NotFound,
        AlreadyExists,
        FailedPrecondition,
        Aborted,
        ResourceExhausted,
        Unavailable,
        DeadlineExceeded,
        Cancelled,
        DataLoss,
        Internal,
    )
}


def error_for_status(status: str, message: str) -> ServiceError:
    """The domain error for a status name received from a peer (unknown names -> Internal)."""
    return ERRORS_BY_STATUS.get(status, Internal)(message)
