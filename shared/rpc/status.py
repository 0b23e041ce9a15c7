"""Domain errors <-> gRPC statuses, with google.rpc rich details (AIP-193).

Server side: `to_grpc_status(error)` builds the status a handler aborts with: the message,
an ErrorInfo{reason, domain}, BadRequest field violations (INVALID_ARGUMENT) or
PreconditionFailure violations (FAILED_PRECONDITION) naming every field, and RetryInfo for
retryable errors. Client side: `describe(rpc_error)` reads them back.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from shared.errors import FieldIssue, ServiceError, error_for_status

ERROR_DOMAIN = "hybridpd"


def status_code(name: str) -> grpc.StatusCode:
    return grpc.StatusCode[name]


def code_number(name: str) -> int:
    """The google.rpc.Code value of a status name (what JobFailure.status_code carries)."""
    value: int = grpc.StatusCode[name].value[0]
    return value


def code_name(number: int) -> str:
    for code in grpc.StatusCode:
        if code.value[0] == number:
            return str(code.name)
    return "UNKNOWN"


def _pack(message: object) -> any_pb2.Any:
    detail = any_pb2.Any()
    detail.Pack(message)  # type: ignore[arg-type]
    return detail


def to_grpc_status(error: ServiceError) -> grpc.Status:
    status: grpc.Status = rpc_status.to_status(to_rpc_status(error))
    return status


def to_rpc_status(error: ServiceError) -> status_pb2.Status:
    """The google.rpc.Status of `error`: what a handler aborts with, and what a JobFailure carries."""
    details = [
        _pack(error_details_pb2.ErrorInfo(reason=error.reason, domain=ERROR_DOMAIN, metadata={"fields": ",".join(error.fields)}))
    ]
    if error.issues and error.status == "INVALID_ARGUMENT":
        details.append(
            _pack(
                error_details_pb2.BadRequest(
                    field_violations=[
                        error_details_pb2.BadRequest.FieldViolation(field=i.field, description=i.description)
                        for i in error.issues
                    ]
                )
            )
        )
    elif error.issues and error.status == "FAILED_PRECONDITION":
        details.append(
            _pack(
                error_details_pb2.PreconditionFailure(
                    violations=[
                        error_details_pb2.PreconditionFailure.Violation(
                            type=error.reason, subject=i.field, description=i.description
                        )
                        for i in error.issues
                    ]
                )
            )
        )
    if error.retryable:
        delay = duration_pb2.Duration()
        delay.FromMilliseconds(int(1000 * (error.retry_after_seconds or 0.1)))
        details.append(_pack(error_details_pb2.RetryInfo(retry_delay=delay)))
    return status_pb2.Status(code=getattr(code_pb2, error.status), message=error.message, details=details)


@dataclass(frozen=True)
class RpcFailure:
    """What a client learns from a failed call: status name, message, reason and named fields."""

    status: str
    message: str
    reason: str = ""
    issues: tuple[FieldIssue, ...] = ()

    @property
    def fields(self) -> tuple[str, ...]:
        return tuple(i.field for i in self.issues)

    def to_error(self) -> ServiceError:
        error = error_for_status(self.status, self.message)
        error.issues = self.issues
        if self.reason:
            error.reason = self.reason
        return error


def describe(error: grpc.aio.AioRpcError | grpc.RpcError) -> RpcFailure:
    code = error.code()
    name = code.name if code is not None else "UNKNOWN"
    try:
        rich = rpc_status.from_call(error)  # type: ignore[arg-type]
    except ValueError:  # trailers disagree with the status: keep the plain status
        rich = None
    return from_rpc_status(rich, status=name, message=error.details() or "")


def from_rpc_status(rich: status_pb2.Status | None, *, status: str | None = None, message: str | None = None) -> RpcFailure:
    """Read a google.rpc.Status back: its code (unless `status` names it), message, reason and fields."""
    name = status if status is not None else code_name(rich.code if rich is not None else 2)
    text = message if message is not None else (rich.message if rich is not None else "")
    reason = ""
    issues: list[FieldIssue] = []
    for detail in rich.details if rich is not None else ():
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            reason = info.reason
        elif detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            issues += [FieldIssue(v.field, v.description) for v in bad.field_violations]
        elif detail.Is(error_details_pb2.PreconditionFailure.DESCRIPTOR):
            pre = error_details_pb2.PreconditionFailure()
            detail.Unpack(pre)
            issues += [FieldIssue(v.subject, v.description) for v in pre.violations]
    return RpcFailure(status=name, message=text, reason=reason, issues=tuple(issues))
