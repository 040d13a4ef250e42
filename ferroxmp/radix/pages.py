"""PagePool: page refcounts and the page table, in shared memory.

One segment holds three int32 arrays: `refs[num_pages]`, `page_table[max_rows,
max_pages_per_row]` and `row_lens[max_rows]`. The scheduler (owner) is the only
writer; the worker and tests attach by name and read. A page is free iff its
refcount is 0; holders are the radix tree (one ref per page it stores) and each
live row that reads the page (one ref each).

The free list is private to the writer: `alloc` never hands out a partial grant,
and `release` below zero is a bug caught at once (a double free), not later.
"""
from __future__ import annotations

import os
import secrets
from dataclasses import dataclass, field
from multiprocessing import shared_memory
from typing import Iterable, Optional

import numpy as np

_HEADER = 4  # int32 words: num_pages, max_rows, max_pages_per_row, magic
_MAGIC = 0x46585050  # "FXPP"


class PageError(RuntimeError):
    """A page accounting bug: a double free, or a page out of range."""


def _attach_untracked(name: str) -> shared_memory.SharedMemory:
    # Python < 3.13 registers attached segments with the resource tracker, which then
    # unlinks them when the reader exits; only the owner may unlink.
    try:
        return shared_memory.SharedMemory(name=name, track=False)  # type: ignore[call-arg]
    except TypeError:
        from multiprocessing import resource_tracker
        shm = shared_memory.SharedMemory(name=name)
        try:
            resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
        except Exception:
            pass
        return shm


@dataclass
class PagePool:
    shm: shared_memory.SharedMemory
    num_pages: int
    max_rows: int
    max_pages_per_row: int
    owner: bool
    refs: np.ndarray = field(init=False, repr=False)
    page_table: np.ndarray = field(init=False, repr=False)
    row_lens: np.ndarray = field(init=False, repr=False)
    _free: list[int] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        buf = self.shm.buf
        off = _HEADER * 4
        self.refs = np.ndarray((self.num_pages,), np.int32, buf, off)
        off += self.num_pages * 4
        self.page_table = np.ndarray((self.max_rows, self.max_pages_per_row), np.int32, buf, off)
        off += self.max_rows * self.max_pages_per_row * 4
        self.row_lens = np.ndarray((self.max_rows,), np.int32, buf, off)

    @staticmethod
    def nbytes(num_pages: int, max_rows: int, max_pages_per_row: int) -> int:
        return 4 * (_HEADER + num_pages + max_rows * max_pages_per_row + max_rows)

    @classmethod
    def create(cls, num_pages: int, max_rows: int, max_pages_per_row: int,
               name: Optional[str] = None) -> "PagePool":
        name = name or f"fxmp_{os.getpid()}_{secrets.token_hex(4)}"
        shm = shared_memory.SharedMemory(name=name, create=True,
                                         size=cls.nbytes(num_pages, max_rows, max_pages_per_row))
        header = np.ndarray((_HEADER,), np.int32, shm.buf, 0)
        header[:] = (num_pages, max_rows, max_pages_per_row, _MAGIC)
        del header
        pool = cls(shm, num_pages, max_rows, max_pages_per_row, owner=True)
        pool.refs[:] = 0
        pool.page_table[:] = -1
        pool.row_lens[:] = 0
        pool._free = list(range(num_pages - 1, -1, -1))
        return pool

    @classmethod
    def attach(cls, name: str, writer: bool = False) -> "PagePool":
        """Attach to an existing pool. `writer=True` (the scheduler) rebuilds the free
        list from the refcounts; readers never touch it."""
        shm = _attach_untracked(name)
        header = np.ndarray((_HEADER,), np.int32, shm.buf, 0)
        num_pages, max_rows, mppr, magic = (int(x) for x in header)
        del header
        if magic != _MAGIC:
            shm.close()
            raise PageError(f"shared memory {name!r} is not a ferroxmp page pool")
        pool = cls(shm, num_pages, max_rows, mppr, owner=False)
        if writer:
            pool._free = [p for p in range(num_pages - 1, -1, -1) if pool.refs[p] == 0]
        return pool

    @property
    def name(self) -> str:
        return self.shm.name

    @property
    def free_count(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> Optional[list[int]]:
        """n fresh pages with refcount 1, or None (never a partial grant)."""
        if n > len(self._free):
            return None
        if n <= 0:
            return []
        pages = self._free[-n:]
        del self._free[-n:]
        self.refs[pages] = 1
        return pages

    def retain(self, pages: Iterable[int]) -> None:
        for p in pages:
            if self.refs[p] <= 0:
                raise PageError(f"retain of free page {p}")
            self.refs[p] += 1

    def release(self, pages: Iterable[int]) -> None:
        for p in pages:
            r = int(self.refs[p])
            if r <= 0:
                raise PageError(f"double free of page {p}")
            self.refs[p] = r - 1
            if r == 1:
                self._free.append(p)

    def set_row(self, row: int, pages: list[int], length: int) -> None:
        """Write a row's page list and length into the shared table."""
        self.page_table[row, :len(pages)] = pages
        self.page_table[row, len(pages):] = -1
        self.row_lens[row] = length

    def clear_row(self, row: int) -> None:
        self.page_table[row, :] = -1
        self.row_lens[row] = 0

    def row_pages(self, row: int) -> np.ndarray:
        t = self.page_table[row]
        n = int(np.argmax(t < 0)) if (t < 0).any() else len(t)
        return t[:n]

    def check_integrity(self, holders: Optional[dict[int, int]] = None) -> None:
        """Free list == {refs == 0}, no duplicates; with `holders` (page -> count of
        tree + rows holding it), every refcount equals its holders."""
        free = set(self._free)
        assert len(free) == len(self._free), "a page is on the free list twice"
        zero = set(np.flatnonzero(self.refs == 0).tolist())
        assert free == zero, f"free list {sorted(free ^ zero)[:8]} disagrees with refcounts"
        assert (self.refs >= 0).all(), "negative refcount"
        if holders is not None:
            for p in range(self.num_pages):
                want = holders.get(p, 0)
                assert self.refs[p] == want, f"page {p}: refcount {self.refs[p]} != {want} holders"

    def close(self) -> None:
        self.refs = self.page_table = self.row_lens = None  # type: ignore[assignment]
        try:
            self.shm.close()
        except BufferError:
            pass

    def unlink(self) -> None:
        try:
            self.shm.unlink()
        except FileNotFoundError:
            pass
