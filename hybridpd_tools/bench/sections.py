"""Bytes of one READ by section (FA, conv, SSM), from its local descriptor ids.

Same rule as the decode service's accounting: ids below the FA part are attention K/V; in the
Mamba part the piece index says conv section or SSM state (the SSM piece is last, when this
source provides SSM rows at all).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from shared.layout.plan import SourceRead
from shared.layout.read_lists import ReadLists

IntArray = npt.NDArray[np.int64]


@dataclass(frozen=True)
class SectionBytes:
    fa: int = 0
    conv: int = 0
    ssm: int = 0

    @property
    def total(self) -> int:
        return self.fa + self.conv + self.ssm

    def __add__(self, other: SectionBytes) -> SectionBytes:
        return SectionBytes(self.fa + other.fa, self.conv + other.conv, self.ssm + other.ssm)

    def as_dict(self) -> dict[str, int]:
        return {"fa": self.fa, "conv": self.conv, "ssm": self.ssm, "total": self.total}


def section_bytes(lists: ReadLists, read: SourceRead, local_idx: IntArray) -> SectionBytes:
    fa, conv, ssm = lists.bytes_by_section(local_idx, read.ssm is not None)
    return SectionBytes(fa=fa, conv=conv, ssm=ssm)
