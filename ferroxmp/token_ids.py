"""TokenIds: a row's token ids as one int32 buffer, grown in place.

Job: the one representation of a request's tokens between the wire and the model. The
scheduler's Request and the worker's row state each hold one; the wire carries the
same int32 bytes (`protocol.pack_ids`), so a prompt is converted once where it arrives
(`from_wire`) and a token appended is one store, not a copy of the row.

Invariants: `n` ids are known (read it, never write it: only this class does, and
`scheduler.request.decoded_many`, which writes `append`'s lines out because it runs
for every decoding row every step and the call costs as much as the store); `array`
is a view of them (no copy; valid until the next append that grows the buffer, so
callers do not keep it across appends); growth doubles the capacity, so appending n
tokens costs O(n) in all. `append` and `last` are on the scheduler's per-row,
per-step path: plain ints and struct, no numpy slicing.
"""
from __future__ import annotations

import struct
from typing import Iterable, Union

import numpy as np

IDS = np.dtype("<i4")  # the wire's dtype (protocol.pack_ids), so views pack without a cast
PACK1 = struct.Struct("<i").pack  # one id as wire bytes, without numpy (`last`)


class TokenIds:
    __slots__ = ("_buf", "_mv", "_cap", "n", "last")

    def __init__(self, ids: Union[np.ndarray, Iterable[int]] = ()) -> None:
        a = np.asarray(ids, dtype=IDS)  # a wire array is already int32: no cast here
        self._buf = np.empty(max(16, 2 * len(a)), dtype=IDS)
        self._cap = len(self._buf)  # len(_buf), kept as an int for append's check
        self._buf[:len(a)] = a
        self._mv = memoryview(self._buf)  # one id stored through it: a third cheaper than numpy's
        self.n = len(a)
        self.last = int(a[-1]) if len(a) else None  # the newest id as a Python int (the outbox packs it: PACK1)

    @classmethod
    def from_wire(cls, buf: bytes) -> "TokenIds":
        """From packed int32 bytes (`protocol.pack_ids`): the one copy at arrival."""
        return cls(np.frombuffer(buf, dtype=IDS))

    def __len__(self) -> int:
        return self.n

    @property
    def array(self) -> np.ndarray:
        """Every id, as a view of the buffer."""
        return self._buf[:self.n]

    def __getitem__(self, key):
        return self._buf[:self.n][key]

    def _reserve(self, extra: int) -> None:
        need = self.n + extra
        if need > len(self._buf):
            grown = np.empty(max(need, 2 * len(self._buf)), dtype=IDS)
            grown[:self.n] = self._buf[:self.n]
            self._buf, self._mv, self._cap = grown, memoryview(grown), len(grown)

    def append(self, token: int) -> None:
        n = self.n
        if n == self._cap:
            self._reserve(1)
        self._mv[n] = token
        self.n = n + 1
        self.last = token

    def extend(self, tokens) -> None:
        a = np.asarray(tokens, dtype=IDS)
        self._reserve(len(a))
        self._buf[self.n:self.n + len(a)] = a
        self.n += len(a)
        if len(a):
            self.last = int(a[-1])

    def truncate(self, n: int) -> None:
        """Keep the first n ids (0 <= n <= len)."""
        assert 0 <= n <= self.n, (n, self.n)
        self.n = n
        self.last = self._buf.item(n - 1) if n else None

    def packed(self, start: int = 0) -> bytes:
        """ids[start:] as wire bytes (the copy into a message)."""
        return self._buf[start:self.n].tobytes()

    def ends_with(self, mark) -> bool:
        n = len(mark)
        return 0 < n <= self.n and bool(np.array_equal(self._buf[self.n - n:self.n], mark))
