"""Domain errors -> HTTP status, OpenAI error object, Retry-After."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
from prometheus_client import CollectorRegistry

from shared.errors import Aborted, DataLoss, InvalidArgument, NotFound, ResourceExhausted, ServiceError, Unavailable
from shared.http.app import ServiceInfo, check_model
from shared.http.errors import http_error
from shared.http.sse import DONE, event


@pytest.mark.parametrize(
    ("error", "status", "retry_after"),
    [
        (InvalidArgument("must be >= 1", field="max_tokens"), 400, None),
        (NotFound("no such request", field="request_id"), 404, None),
        (Aborted("lease gone", field="kv_transfer_params.remote_block_ids", reason="LEASE_EXPIRED"), 410, None),
        (Aborted("peer restarted"), 409, None),
        (ResourceExhausted("cache full", reason="CACHE_FULL"), 429, "1"),
        (ResourceExhausted("cache full", retry_after_seconds=2.2), 429, "3"),
        (Unavailable("draining", reason="DRAINING"), 503, "1"),
        (DataLoss("bytes differ"), 500, None),
    ],
)
def test_status_and_retry_after(error: ServiceError, status: int, retry_after: str | None) -> None:
    out = http_error(error)
    assert out.status == status
    assert out.headers.get("Retry-After") == retry_after
    body = out.body["error"]
    assert body["message"] == error.message and body["code"] == error.reason.lower()
    assert body["param"] == (error.fields[0] if error.fields else None)
    assert set(body) == {"message", "type", "param", "code"}


INFO = ServiceInfo("decode", ("first", "second"), lambda: True, CollectorRegistry(), lambda: 8)


def check_error(call: Callable[[], object]) -> ServiceError:
    with pytest.raises(ServiceError) as raised:
        call()
    return raised.value


def test_every_served_name_is_accepted_and_answered_as_the_first() -> None:
    assert [check_model(INFO, m) for m in ("first", "second", None)] == ["first", "first", "first"]


def test_an_unknown_model_is_vllms_not_found_error() -> None:
    """vLLM's body for a model it does not serve: routers and clients written against it match on it."""
    body = http_error(check_error(lambda: check_model(INFO, "x"))).body
    assert body == {"error": {"message": "The model `x` does not exist.", "type": "NotFoundError", "param": "model", "code": 404}}


def test_field_is_the_param() -> None:
    body = http_error(InvalidArgument("must be >= 1", field="max_tokens")).body
    assert body == {
        "error": {
            "message": "max_tokens: must be >= 1",
            "type": "invalid_request_error",
            "param": "max_tokens",
            "code": "invalid_argument",
        }
    }


def test_sse_framing() -> None:
    assert event({"a": [1, "é"]}) == 'data: {"a":[1,"é"]}\n\n'.encode()
    assert json.loads(event({"x": None})[len(b"data: ") :]) == {"x": None}
    assert DONE == b"data: [DONE]\n\n"
