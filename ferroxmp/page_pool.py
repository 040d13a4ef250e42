"""PagePool: page refcounts and the page table, in shared memory.

One segment holds three int32 arrays: `refs[num_pages]`, `page_table[max_rows,
max_pages_per_row]` and `row_lens[max_rows]`. The scheduler (owner) is the only
writer; the worker and tests attach by name and read. A page is free iff its
refcount is 0; holders are the radix tree (one ref per page it stores) and each
live row that reads the page (one ref each).

The free list is private to the writer: `alloc` never hands out a partial grant,
and `release` below zero is a bug caught at once (a double free), not later.

The segment's life is this module's: `PagePool.create` makes it, `attach` opens it
without taking a share of its life, and `PagePool.unlink` / `remove_segment` are the
only code that removes one. Who calls them, and why each is needed: the worker creates
the server's pool (its size is known only once the model is loaded) and removes it on
every exit path; the supervisor removes it again once its children are gone (a worker
killed with -9 could not); a later `ferroxmp serve` removes the pool of a server whose
every process was killed with -9 (`shm_names.remove_dead_segments`).
"""
from __future__ import annotations

import os
import secrets
import threading
from dataclasses import dataclass, field
from multiprocessing import shared_memory
from types import SimpleNamespace
from typing import Iterable, Optional

import numpy as np

_HEADER = 4  # int32 words: num_pages, max_rows, max_pages_per_row, magic
_MAGIC = 0x46585050  # "FXPP"
_ATTACH_LOCK = threading.Lock()
_VECTOR_MIN = 32  # page lists this long go through numpy; shorter, a loop is cheaper


class PageError(RuntimeError):
    """A page accounting bug: a double free, or a page out of range."""


def _attach_untracked(name: str) -> shared_memory.SharedMemory:
    """Attach without registering with the resource tracker: only the owner unlinks.

    Python < 3.13 registers every attached segment, and the tracker unlinks it when
    the reader exits. Unregistering afterwards is no cure: processes started by
    multiprocessing share their parent's tracker, so the unregister would drop the
    owner's own registration (and its cleanup if the owner dies). So the register
    call is skipped, for shared_memory only and only for this constructor call.
    """
    try:
        return shared_memory.SharedMemory(name=name, track=False)  # type: ignore[call-arg]
    except TypeError:
        pass
    tracker = shared_memory.resource_tracker
    with _ATTACH_LOCK:
        shared_memory.resource_tracker = SimpleNamespace(  # type: ignore[assignment]
            register=lambda name, rtype: None, unregister=tracker.unregister)
        try:
            return shared_memory.SharedMemory(name=name)
        finally:
            shared_memory.resource_tracker = tracker


@dataclass
class PagePool:
    shm: shared_memory.SharedMemory
    num_pages: int
    max_rows: int
    max_pages_per_row: int
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
        pool = cls(shm, num_pages, max_rows, max_pages_per_row)
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
        pool = cls(shm, num_pages, max_rows, mppr)
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

    def _checked(self, pages: Iterable[int]) -> list[int]:
        pages = [int(p) for p in pages]
        # A negative index would silently wrap around to the last pages.
        if pages and not (0 <= min(pages) and max(pages) < self.num_pages):
            raise PageError(f"page out of range 0..{self.num_pages - 1}: "
                            f"{[p for p in pages if not 0 <= p < self.num_pages][:4]}")
        return pages

    def retain(self, pages: Iterable[int]) -> None:
        """One more ref on each (already held) page; all or nothing."""
        pages = self._checked(pages)
        refs = self.refs
        if len(pages) >= _VECTOR_MIN:
            arr = np.array(pages, np.int64)
            bad = arr[refs[arr] <= 0]
            if bad.size:
                raise PageError(f"retain of free page {int(bad[0])}")
            np.add.at(refs, arr, 1)
            return
        for p in pages:
            if refs[p] <= 0:
                raise PageError(f"retain of free page {p}")
        for p in pages:
            refs[p] += 1

    def release(self, pages: Iterable[int]) -> None:
        """One ref less on each page; a page reaching 0 is free. All or nothing: a
        double free raises before any refcount moves."""
        pages = self._checked(pages)
        refs = self.refs
        if len(pages) >= _VECTOR_MIN or len(set(pages)) != len(pages):
            uniq, count = np.unique(np.array(pages, np.int64), return_counts=True)
            have = refs[uniq]
            bad = uniq[have < count]
            if bad.size:
                p = int(bad[0])
                raise PageError(f"double free of page {p} ({int(count[uniq == p][0])} "
                                f"releases, {int(refs[p])} refs)")
            refs[uniq] = have - count
            self._free.extend(uniq[have == count].tolist())
            return
        for p in pages:
            if refs[p] <= 0:
                raise PageError(f"double free of page {p}")
        for p in pages:
            r = int(refs[p]) - 1
            refs[p] = r
            if r == 0:
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
        """A copy of the row's page list: a snapshot the writer cannot change under
        the reader, and no view left behind to keep the segment mapped at close."""
        t = self.page_table[row]
        n = int(np.argmax(t < 0)) if (t < 0).any() else len(t)
        return t[:n].copy()

    def check_integrity(self, holders: Optional[dict[int, int]] = None) -> None:
        """Free list == {refs == 0}, no duplicates; with `holders` (page -> count of
        tree + rows holding it), every refcount equals its holders. Raises PageError."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise PageError("a page is on the free list twice")
        if (self.refs < 0).any():
            raise PageError(f"negative refcount on pages {np.flatnonzero(self.refs < 0)[:8].tolist()}")
        zero = set(np.flatnonzero(self.refs == 0).tolist())
        if free != zero:
            raise PageError(f"free list disagrees with refcounts on pages {sorted(free ^ zero)[:8]}")
        if holders is not None:
            want = np.zeros(self.num_pages, np.int64)
            for p, n in holders.items():
                want[p] = n
            bad = np.flatnonzero(self.refs != want)
            if bad.size:
                p = int(bad[0])
                raise PageError(f"page {p}: refcount {self.refs[p]} != {want[p]} holders "
                                f"({bad.size} pages disagree)")

    def close(self) -> None:
        self.refs = self.page_table = self.row_lens = None  # type: ignore[assignment]
        try:
            self.shm.close()
        except BufferError:
            pass

    def unlink(self) -> None:
        """Remove the segment (its creator: `shm.unlink` also drops the resource tracker's
        registration, which `remove_segment` by name cannot)."""
        try:
            self.shm.unlink()
        except FileNotFoundError:
            pass


def remove_segment(name: str) -> bool:
    """Remove the segment `name`, made by another process; False if it was not there."""
    import _posixshmem  # CPython's shm_unlink, what SharedMemory.unlink calls (POSIX only)
    try:
        _posixshmem.shm_unlink("/" + name)
    except FileNotFoundError:
        return False
    return True
