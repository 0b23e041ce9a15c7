"""The raw NIXL baseline's target serves READs under every pumping strategy: a real target
process, a real reader, each READ finding the bytes the target has just rewritten."""

from __future__ import annotations

import numpy as np
import pytest

from hybridpd_tools.bench.raw_nixl import RawReader, RawTarget
from hybridpd_tools.bench.raw_pumping import ACROSS_HOSTS, PAUSES, pause

REGION = 1 << 20


def test_every_strategy_is_run_across_hosts_and_an_unknown_one_is_refused() -> None:
    assert set(ACROSS_HOSTS) == set(PAUSES)
    with pytest.raises(ValueError, match="'spin-fast'"):
        pause("spin-fast")


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_each_pumping_reads_what_the_target_just_wrote() -> None:
    target = RawTarget(1, 1, REGION, name="test-pumping-target", huge_pages=False)
    reader: RawReader | None = None
    try:
        reader = RawReader(target, 1, 1, REGION, name="test-pumping-reader", huge_pages=False)
        descs = np.array([[reader.bases(0)[0], REGION]], dtype=np.int64)
        remote = np.array([[target.ranks[0].bases[0], REGION]], dtype=np.int64)
        ids = np.zeros(1, dtype=np.int32)
        read = reader.prepare(0, 0, descs, remote, ids, ids)
        local = reader.tensors[0][0]
        assert int(local.max()) == 0  # negative control: nothing there before the first READ
        with pytest.raises(ValueError, match="unknown raw NIXL pumping"):
            target.serve("spin-fast", b"never", 1)
        for k, pumping in enumerate(PAUSES):
            notif = f"test-{pumping}".encode()
            target.serve(pumping, notif, 1)  # rewrites every region with value k + 2, then pumps
            assert reader.run([read], notif, pumping) > 0
            assert int(local.min()) == int(local.max()) == k + 2, pumping
        target.rewrite()  # still answering after the last serve ended
    finally:
        if reader is not None:
            reader.close()
        target.close()
    assert target.proc.returncode == 0
