"""A prefill job's failure reaches decode with the same status, reason and fields as any other
error (google.rpc.Status in JobFailure), and a peer sending only code and message still works."""

from __future__ import annotations

from decode_svc.session_client import job_error
from prefill_svc.session import _failure
from shared.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from shared.pb.hybridpd.v1 import prefill_service_pb2 as pb
from shared.rpc.status import code_number


def test_reason_and_fields_survive_the_session_stream() -> None:
    sent = InvalidArgument("token id 9999 is outside the vocabulary", field="job.prompt_token_ids")
    wire = pb.SessionResponse.FromString(_failure("r1", sent).SerializeToString())
    got = job_error("prefill-a", wire.failure)
    assert isinstance(got, InvalidArgument)
    assert got.fields == ("job.prompt_token_ids",) and got.reason == sent.reason
    assert got.message.startswith("prefill prefill-a: ") and "outside the vocabulary" in got.message
    assert wire.failure.status_code == code_number("INVALID_ARGUMENT") == wire.failure.status.code


def test_a_custom_reason_is_kept() -> None:
    wire = _failure("r2", ResourceExhausted("too many pinned requests", reason="TOO_MANY_PINNED")).failure
    got = job_error("p", wire)
    assert isinstance(got, ResourceExhausted) and got.reason == "TOO_MANY_PINNED"


def test_a_peer_sending_only_code_and_message() -> None:
    old = pb.JobFailure(request_id="r3", status_code=code_number("FAILED_PRECONDITION"), message="no")
    got = job_error("p", old)
    assert isinstance(got, FailedPrecondition) and got.message == "prefill p: no" and got.fields == ()
