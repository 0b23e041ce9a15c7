"""Domain errors -> OpenAI-style error objects and HTTP statuses.

Body: `{"error": {"message", "type", "param", "code"}}` as OpenAI sends it; `param` names the
request field at fault. Retryable errors (cache full -> 429, draining / no prefill -> 503)
carry `Retry-After` in whole seconds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from shared.errors import FieldIssue, ServiceError

# gRPC status name -> (HTTP status, OpenAI error type)
_BY_STATUS: dict[str, tuple[int, str]] = {
    "INVALID_ARGUMENT": (400, "invalid_request_error"),
    "NOT_FOUND": (404, "invalid_request_error"),
    "ALREADY_EXISTS": (409, "conflict_error"),
    "FAILED_PRECONDITION": (409, "invalid_request_error"),
    "ABORTED": (409, "conflict_error"),
    "RESOURCE_EXHAUSTED": (429, "rate_limit_error"),
    "UNAVAILABLE": (503, "service_unavailable_error"),
    "DEADLINE_EXCEEDED": (504, "timeout_error"),
    "CANCELLED": (499, "cancelled_error"),
    "DATA_LOSS": (500, "server_error"),
    "INTERNAL": (500, "server_error"),
    "UNIMPLEMENTED": (501, "not_implemented_error"),
}
# Reasons with a more specific HTTP status than their gRPC status gives.
_BY_REASON: dict[str, int] = {"LEASE_EXPIRED": 410, "PREFILL_RESTARTED": 410}
# A request naming a model that is not served: the body vLLM sends (type NotFoundError, code 404),
# which routers and clients written against vLLM recognise.
MODEL_NOT_FOUND = "MODEL_NOT_FOUND"
DEFAULT_RETRY_AFTER_SECONDS = 1


@dataclass(frozen=True)
class HttpError:
    status: int
    body: dict[str, Any]
    headers: dict[str, str]


def http_error(error: ServiceError) -> HttpError:
    status, kind = _BY_STATUS.get(error.status, (500, "server_error"))
    status = _BY_REASON.get(error.reason, status)
    param = error.fields[0] if error.fields else None
    headers: dict[str, str] = {}
    if error.retryable:
        wait = error.retry_after_seconds
        headers["Retry-After"] = str(max(1, math.ceil(wait)) if wait is not None else DEFAULT_RETRY_AFTER_SECONDS)
    if error.reason == MODEL_NOT_FOUND:
        return HttpError(404, error_body(error.message, "NotFoundError", param, 404), headers)
    return HttpError(status, error_body(error.message, kind, param, error.reason.lower()), headers)


def error_body(message: str, kind: str, param: str | None, code: str | int | None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def internal_error() -> HttpError:
    """For anything that is not a ServiceError: a bug; details go to the log, not the client."""
    return HttpError(500, error_body("internal error (see the service log)", "server_error", None, "internal"), {})


def renamed(error: ServiceError, names: dict[str, str]) -> ServiceError:
    """The same error with gRPC field names replaced by the HTTP body's (`prompt_token_ids` -> `prompt`)."""
    if not error.issues or error.issues[0].field not in names:
        return error
    issues = tuple(FieldIssue(names.get(i.field, i.field), i.description) for i in error.issues)
    old, new = error.issues[0].field, issues[0].field
    message = new + error.message[len(old) :] if error.message.startswith(old) else error.message
    return type(error)(message, issues=issues, reason=error.reason, retry_after_seconds=error.retry_after_seconds)
