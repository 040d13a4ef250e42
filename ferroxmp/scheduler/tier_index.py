"""TierIndex: the scheduler's view of which KV pages the worker's tiers hold.

Job: answer "is this page below the pool, and where?" without a round trip. Keys are
chain hashes (`chain_keys`): a page's key covers its salt and every token up to its
end, so one lookup per page says whether a whole prefix is stored.

One writer: the index changes only through the worker's `KVTierReport`s (`apply`);
saves sent but not yet reported are `pending`, so an evicted page is not sent twice.
The mirror may lag the worker (a page deleted to stay under the disk bound a moment
ago); a load of such a page fails and that part of the prompt is recomputed — a
stale index costs time, never a wrong answer.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from ferroxmp.protocol import KVTierReport, KVTierStats

HOST, DISK = 1, 2
_BIT = {"h": HOST, "d": DISK}
KEY_BYTES = 16
_KEY_VERSION = b"ferroxmp-kv-1\0"


def chain_keys(keys: list[bytes], salt: str, tokens: np.ndarray, page_size: int, n_pages: int) -> list[bytes]:
    """Extend `keys` (the keys of the first len(keys) pages) to the first n_pages pages
    of `tokens` under `salt`. key[i] = H(key[i-1] || tokens of page i); key[-1] = H(salt)."""
    if len(keys) >= n_pages:
        return keys
    prev = keys[-1] if keys else hashlib.blake2b(_KEY_VERSION + salt.encode("utf-8", "surrogatepass"),
                                                 digest_size=KEY_BYTES).digest()
    raw = np.ascontiguousarray(tokens[len(keys) * page_size:n_pages * page_size], dtype="<i4").tobytes()
    step = page_size * 4
    for off in range(0, len(raw), step):
        prev = hashlib.blake2b(prev + raw[off:off + step], digest_size=KEY_BYTES).digest()
        keys.append(prev)
    return keys


@dataclass
class TierIndex:
    has_host: bool = False
    has_disk: bool = False
    where: dict[bytes, int] = field(default_factory=dict)  # key -> HOST | DISK bits
    pending: dict[bytes, int] = field(default_factory=dict)  # saves sent, not yet reported: key -> tiers
    version: int = 0  # bumped when a key is added (a waiting request may find more)
    worker: Optional[KVTierStats] = None  # the worker's latest figures

    @property
    def enabled(self) -> bool:
        return self.has_host or self.has_disk

    def tier(self, key: bytes) -> int:
        return self.where.get(key, 0)

    def apply(self, report: KVTierReport) -> None:
        for key, t in zip(report.stored, report.stored_tiers):
            self.where[key] = self.where.get(key, 0) | _BIT[t]
            left = self.pending.pop(key, 0) & ~_BIT[t]
            if left:
                self.pending[key] = left
            self.version += 1
        for key, t in zip(report.dropped, report.dropped_tiers):
            bits = self.where.get(key, 0) & ~_BIT[t]
            if bits:
                self.where[key] = bits
            else:
                self.where.pop(key, None)
        if report.stats is not None:
            self.worker = report.stats
            if report.stats.store_queue == 0:
                # A dropped save (full queue, full disk) is never reported stored: once the
                # writer is idle, what is still pending was dropped and may be offered
                # again (a duplicate save is harmless: the tiers keep one copy per key).
                self.pending.clear()

    def clear(self) -> None:
        self.where.clear()
        self.pending.clear()
        self.version += 1
