"""RowRefs: how many live rows hold each page, and how many pages some row holds.

The cache manager moves these with the refs it takes and gives back for rows (never
for the tree), so pages in use (held by a row) and pages cached (held by the tree
alone) are known at any time without a walk over the tree or the pool: they feed
`stats()` every heartbeat and bound what eviction could free every admission.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

_VECTOR_MIN = 32  # page lists this long go through numpy; a decode row's one new page does not


@dataclass
class RowRefs:
    num_pages: int
    counts: np.ndarray = field(init=False, repr=False)  # page -> live rows holding it
    in_use: int = 0  # pages with counts > 0

    def __post_init__(self) -> None:
        self.counts = np.zeros(self.num_pages, np.int32)

    def hold(self, pages: list[int]) -> None:
        """One more row holds each of `pages` (distinct)."""
        counts = self.counts
        if len(pages) < _VECTOR_MIN:
            for p in pages:
                self.in_use += int(counts[p] == 0)
                counts[p] += 1
            return
        idx = np.asarray(pages, np.int64)
        self.in_use += int(np.count_nonzero(counts[idx] == 0))
        counts[idx] += 1

    def unhold(self, pages: list[int]) -> None:
        """One row fewer holds each of `pages` (distinct)."""
        counts = self.counts
        if len(pages) < _VECTOR_MIN:
            for p in pages:
                counts[p] -= 1
                self.in_use -= int(counts[p] == 0)
            return
        idx = np.asarray(pages, np.int64)
        counts[idx] -= 1
        self.in_use -= int(np.count_nonzero(counts[idx] == 0))
