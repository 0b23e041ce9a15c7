"""PeerLoad orders prefill peers (fewest jobs, then smallest pinned share; a peer that never
reported loses ties); what prefill reports of the other sessions' jobs; which failures before the manifest are retried elsewhere, and under which
label; the TEST-ONLY job failure hook."""

from __future__ import annotations

import pytest

from decode_svc.prefill_load import LoadReport, peer_load, report_from_message
from decode_svc.prefill_retry import retry_reason
from prefill_svc.load import LoadBoard
from shared.errors import DeadlineExceeded, Internal, InvalidArgument, ResourceExhausted, Unavailable
from shared.runtime.faults import FaultPlan


def test_jobs_first_then_the_pinned_share() -> None:
    idle = peer_load(0, LoadReport(pinned_blocks=0, other_jobs=0), 64)
    pinned = peer_load(0, LoadReport(pinned_blocks=48, other_jobs=0), 64)
    busy_elsewhere = peer_load(0, LoadReport(pinned_blocks=0, other_jobs=2), 64)
    assert idle < pinned < busy_elsewhere
    assert peer_load(2, LoadReport(0, 0), 64) == busy_elsewhere  # our requests and the others' count alike
    assert pinned.pinned_share == 0.75


def test_a_peer_without_report_is_ranked_by_our_requests_and_loses_ties() -> None:
    unknown = peer_load(0, None, 64)
    assert peer_load(0, LoadReport(64, 0), 64) < unknown  # even a fully pinned known peer wins the tie
    assert unknown < peer_load(1, LoadReport(0, 0), 64)  # but not against more jobs
    assert peer_load(0, None, 64) == peer_load(0, None, 8)  # an all-unknown pool ties: round-robin


@pytest.mark.parametrize(
    ("error", "label"),
    [
        (Unavailable("session lost", reason="PEER_UNAVAILABLE"), "PEER_UNAVAILABLE"),
        (Unavailable("draining", reason="DRAINING"), "DRAINING"),
        (ResourceExhausted("no credit", reason="NO_CREDIT"), "NO_CREDIT"),
        (ResourceExhausted("cache full", reason="CACHE_FULL"), "CACHE_FULL"),
        (Unavailable("some other reason", reason="ELSEWHERE"), "UNAVAILABLE"),
        (ResourceExhausted("plain"), "RESOURCE_EXHAUSTED"),
    ],
)
def test_retried_failures_and_their_labels(error: Exception, label: str) -> None:
    assert retry_reason(error) == label  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "error", [InvalidArgument("bad prompt", field="prompt_token_ids"), DeadlineExceeded("late"), Internal("bug")]
)
def test_failures_that_would_repeat_anywhere_are_not_retried(error: Exception) -> None:
    assert retry_reason(error) is None  # type: ignore[arg-type]


def test_the_fail_hook_fails_only_matching_jobs_with_the_status() -> None:
    error = FaultPlan(fail="RESOURCE_EXHAUSTED:victim-").failure("victim-1")
    assert isinstance(error, ResourceExhausted) and "TEST-ONLY" in error.message
    assert FaultPlan(fail="RESOURCE_EXHAUSTED:victim-").failure("other-1") is None
    assert isinstance(FaultPlan(fail="UNAVAILABLE").failure("any"), Unavailable)
    with pytest.raises(ValueError, match="HYBRID_PD_TEST_FAIL"):
        FaultPlan(fail="NOT_A_STATUS").failure("x")


class NoPins:
    """Stand-in for the pin table (no blocks pinned): only the jobs are under test here."""

    def blocks(self) -> int:
        return 0


def test_prefill_reports_the_other_sessions_jobs_and_their_prompt_tokens() -> None:
    board = LoadBoard(NoPins())
    board.job_started("decode-a", 2048)
    board.job_started("decode-a", 128)
    board.job_started("decode-b", 512)
    to_a, to_b = board.report("decode-a"), board.report("decode-b")
    assert (to_a.other_jobs, to_a.other_prompt_tokens) == (1, 512)
    assert (to_b.other_jobs, to_b.other_prompt_tokens) == (2, 2176)
    board.job_ended("decode-a", 2048)
    assert board.report("decode-b").other_prompt_tokens == 128
    board.job_ended("decode-a", 128)
    assert (board.jobs(), board.prompt_tokens()) == (1, 512)
    assert report_from_message(board.report("decode-a")) == LoadReport(pinned_blocks=0, other_jobs=1, other_prompt_tokens=512)
