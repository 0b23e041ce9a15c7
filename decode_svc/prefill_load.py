"""How loaded a prefill engine is, as this decode engine sees it: what the prefill reported on
the Session stream (prefill_svc/load.py) plus this engine's own requests there.

`PeerLoad` orders peers for `PrefillPeers.pick()`: fewest jobs first (this engine's requests
waiting for a manifest or holding one, plus the other decode engines' jobs as last reported),
then the smallest share of the cache held by pins (blocks new jobs cannot use yet). A peer that
never reported (an older prefill, or none arrived yet) is ranked by this engine's requests
alone and, on a tie, after the peers whose pins are known.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.pb.hybridpd.v1 import prefill_service_pb2 as pb

UNKNOWN_PINNED_SHARE = 2.0  # above any real share (at most 1.0): a peer that never reported loses ties


@dataclass(frozen=True)
class LoadReport:
    pinned_blocks: int
    other_jobs: int
    other_prompt_tokens: int = 0  # the prompt tokens those jobs compute (0 from an older prefill)


def report_from_message(msg: pb.PrefillLoad) -> LoadReport:
    return LoadReport(pinned_blocks=msg.pinned_blocks, other_jobs=msg.other_jobs, other_prompt_tokens=msg.other_prompt_tokens)


@dataclass(frozen=True, order=True)
class PeerLoad:
    jobs: int
    pinned_share: float  # of the prefill engine's cache; UNKNOWN_PINNED_SHARE without a report


def peer_load(own_requests: int, report: LoadReport | None, num_blocks: int) -> PeerLoad:
    if report is None:
        return PeerLoad(own_requests, UNKNOWN_PINNED_SHARE)
    return PeerLoad(own_requests + report.other_jobs, report.pinned_blocks / max(1, num_blocks))
