"""CacheManager: the one writer of the KV cache's bookkeeping — page refcounts, the
shared page table (and row lengths), the radix tree and the row slots.

Its interface is the radix contract (DESIGN.md):
- `match`   tokens an admission would adopt now. No side effects (no LRU touch, no
            split); remembered on the request until the tree's version or the
            request's tokens change, so scoring a queue every step costs nothing new.
- `admit`   adopt (match, lock the path, one ref per adopted page) + allocate the
            rest + a row slot, all or nothing; returns the request's handle.
- `allocate` pages for more positions (evicting least-recently-used leaves first).
- `publish` the computed, page-aligned prefix into the tree (the tree takes its refs).
- `release` publish, then give back every ref, the lock and the row slot. Once.
- `evict`, `release_window` (sliding window), `check_integrity`.

A request holds a `CacheHandle` (opaque outside this module). Invariants:
- a live handle holds exactly one ref on every page in `pages` (-1: released by
  the window), and its page-table row lists those pages;
- `row_refs` counts the live handles holding each page (`rowrefs.py`);
- the tree holds one ref per page it stores; an adopted path stays locked.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from ferroxmp.page_pool import PagePool
from ferroxmp.radix.tree import RadixCache
from ferroxmp.scheduler.rowrefs import RowRefs
from ferroxmp.scheduler.tier_index import TierIndex
from ferroxmp.scheduler.tier_moves import TierMoves


def pages_for(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


@dataclass(eq=False)
class CacheHandle:
    row: int
    pages: list[int]  # one ref held on each, position order; -1 where the window released it
    adopted: int  # tokens adopted from the tree at admission
    lock: Any = None  # the locked tree node of the adopted prefix
    published: int = 0  # pages of this row known to be in the tree (publish skips them)
    windowed: bool = False  # the window released early pages: the prefix can't be published
    keys: list[bytes] = field(default_factory=list)  # chain keys of the first pages (KV tiers only)


@dataclass(eq=False, slots=True)
class Memo:
    """What the cache manager remembers of a request between steps, kept here rather than
    on the request (one writer): its last match and the (tree version, known length) it
    was made at, its last tier probe (tier_moves.py), the chain keys of its pages."""
    match: tuple[int, int, int] = (-1, -1, 0)
    probe: Optional[tuple] = None
    keys: list = field(default_factory=list)


@dataclass
class CacheManager:
    pool: PagePool
    page_size: int
    radix: bool = True
    tiers: Optional[TierIndex] = None  # host/disk tiers below the pool (--kv-host-gb, --kv-cache-dir)

    def __post_init__(self) -> None:
        self.tree: Optional[RadixCache] = RadixCache(self.pool, self.page_size) if self.radix else None
        self.moves: Optional[TierMoves] = None
        if self.tree is not None and self.tiers is not None and self.tiers.enabled:
            self.moves = TierMoves(self, self.tiers)
            self.tree.on_evict = self.moves.evicted
        self.free_rows = list(range(self.pool.max_rows - 1, -1, -1))
        self.handles: dict[int, CacheHandle] = {}  # row -> handle
        self.row_refs = RowRefs(self.pool.num_pages)  # live rows holding each page
        self.memos: dict[Any, Memo] = {}  # request (by identity) -> Memo, until `forget`

    def memo(self, req) -> Memo:
        m = self.memos.get(req)
        if m is None:
            m = self.memos[req] = Memo()
        return m

    def forget(self, req) -> None:
        """The core dropped `req` (finished, aborted, expired): its memo goes too."""
        self.memos.pop(req, None)

    # -- reads ---------------------------------------------------------------------

    @property
    def available_pages(self) -> int:
        """At most the pages an allocation could get now: free, plus what eviction may
        free. Eviction frees only pages held by the tree alone (`pages_cached`) in
        unlocked leaves (`evictable_pages` also counts pages a prefilling row published
        and still holds), so the smaller of the two bounds it."""
        if self.tree is None:
            return self.pool.free_count
        return self.pool.free_count + min(self.tree.evictable_pages, self.pages_cached)

    @property
    def pages_in_use(self) -> int:
        """Pages held by at least one row."""
        return self.row_refs.in_use

    @property
    def pages_cached(self) -> int:
        """Pages held only by the tree (every held page is the tree's, a row's or a load's)."""
        loading = self.moves.loading_pages if self.moves is not None else 0
        return self.pool.num_pages - self.pool.free_count - self.pages_in_use - loading

    def match(self, req) -> int:
        """Tokens an admission of `req` would adopt now: the longest cached page-aligned
        prefix of its known tokens under its salt, capped at len - 1 (the last known
        token must run to produce the next one's logits)."""
        n = req.known_len
        # A request asking for prompt logprobs adopts nothing: the worker must compute
        # every prompt position to report its logprob (a cached page holds KV, not logits).
        # Mean/CLS pooling (embeddings) likewise needs hidden states of every position.
        if (self.tree is None or n < 2 or req.params.prompt_logprobs is not None
                or req.params.pooling in ("mean", "cls")):
            return 0
        memo = self.memo(req)
        version, known, tokens = memo.match
        if version == self.tree.version and known == n:
            return tokens
        tokens = self.tree.peek(req.tokens[:n - 1], req.salt)
        memo.match = (self.tree.version, n, tokens)
        return tokens

    def pages_needed(self, req) -> int:
        """Fresh pages an admission of `req` would allocate now (its known tokens, less
        the pages it would adopt)."""
        return pages_for(req.known_len, self.page_size) - self.match(req) // self.page_size

    # -- writes --------------------------------------------------------------------

    def _alloc(self, n: int) -> Optional[list[int]]:
        """n fresh pages, evicting least-recently-used tree leaves first if needed. Not
        even tried beyond `available_pages`: a walk over the tree's leaves that cannot
        free enough would run for every candidate and decode row, every step."""
        if n > self.available_pages:
            return None
        if n > self.pool.free_count and self.tree is not None:
            self.tree.evict(n - self.pool.free_count)
        return self.pool.alloc(n)

    def admit(self, req, reserve: int = 0) -> Optional[CacheHandle]:
        """A row slot, the adopted prefix and pages for the rest of the known tokens,
        leaving `reserve` pages for others; None (and nothing changed) if lacking."""
        if not self.free_rows:
            return None
        matched = self.match(req)
        # Pages first, from the remembered match: a request that cannot fit touches
        # nothing in the tree (no LRU touch, no split, no lock), however often it is tried.
        if self.available_pages - self.pages_needed(req) < reserve:
            return None
        node, adopted = None, []
        if matched > 0:
            m = self.tree.match_prefix(req.tokens[:req.known_len - 1], req.salt)
            if m.pages:
                node, adopted = m.node, list(m.pages)
                self.tree.lock(node)  # before evicting: our own prefix must survive
        need = pages_for(req.known_len, self.page_size) - len(adopted)
        fresh = self._alloc(need) if self.available_pages - need >= reserve else None
        if fresh is None:
            if node is not None:
                self.tree.unlock(node)
            return None
        self.pool.retain(adopted)
        pages = adopted + fresh
        self.row_refs.hold(pages)
        row = self.free_rows.pop()
        handle = CacheHandle(row, pages, len(adopted) * self.page_size, node, published=len(adopted))
        self.pool.set_row(row, pages, handle.adopted)
        self.handles[row] = handle
        return handle

    def allocate(self, handle: CacheHandle, positions: int) -> bool:
        """Make sure the row has pages for `positions` positions."""
        if positions <= len(handle.pages) * self.page_size:
            return True
        need = pages_for(positions, self.page_size) - len(handle.pages)
        fresh = self._alloc(need)
        if fresh is None:
            return False
        start = len(handle.pages)
        handle.pages.extend(fresh)
        self.row_refs.hold(fresh)
        self.pool.page_table[handle.row, start:start + need] = fresh
        return True

    def grow(self, handles: list[CacheHandle]) -> bool:
        """One more page for each of these rows, all or nothing: the decode rows that
        reached a page boundary this step, in one allocation and one table write."""
        fresh = self._alloc(len(handles))
        if fresh is None:
            return False
        rows, cols = [], []
        for h, page in zip(handles, fresh):
            rows.append(h.row)
            cols.append(len(h.pages))
            h.pages.append(page)
        self.row_refs.hold(fresh)
        self.pool.page_table[rows, cols] = fresh
        return True

    def set_lengths(self, rows: list[int], positions: list[int]) -> None:
        """Row lengths (positions scheduled) of the rows a step names, in one write."""
        self.pool.row_lens[rows] = positions

    def publish(self, req) -> None:
        """Insert the page-aligned prefix whose KV is computed into the tree (contract 1).
        The tree takes its own ref on pages it did not hold; the row keeps its refs."""
        h: CacheHandle = req.cache
        if self.tree is None or h.windowed:
            return
        n = min(req.computed, req.known_len) // self.page_size
        if n <= h.published:
            return
        already = self.tree.insert(req.tokens[:n * self.page_size], h.pages[:n], req.salt)
        if self.moves is not None:
            self.moves.published(req, h, max(already, h.published * self.page_size), n)
        h.published = n

    def release(self, req) -> None:
        """Publish, then give back every page ref, the lock and the row slot, and take
        the handle off the request. The caller guarantees no batch in flight reads it."""
        h: CacheHandle = req.cache
        self.publish(req)
        held = [p for p in h.pages if p >= 0]
        self.row_refs.unhold(held)
        self.pool.release(held)
        if h.lock is not None:
            self.tree.unlock(h.lock)
        self.pool.clear_row(h.row)
        del self.handles[h.row]
        self.free_rows.append(h.row)
        req.released()

    def release_window(self, req, window: int) -> int:
        """Drop the row's refs on pages wholly before every position it can still read.
        Uses `computed` (not `scheduled`): a batch in flight may read one window back."""
        h: CacheHandle = req.cache
        n = max(0, req.computed - window - self.page_size) // self.page_size
        dropped = [p for p in h.pages[:n] if p >= 0]
        if not dropped:
            return 0
        self.row_refs.unhold(dropped)
        self.pool.release(dropped)
        h.pages[:n] = [-1] * n
        self.pool.page_table[h.row, :n] = -1
        h.windowed = True
        return len(dropped)

    def evict(self, n: int) -> int:
        """Free up to n pages the tree alone holds, least recently used first."""
        return self.tree.evict(n) if self.tree is not None else 0

    # -- accounting ----------------------------------------------------------------

    def check_integrity(self) -> None:
        """Every refcount equals its holders; the page table and row_refs agree with the
        handles; every row slot is free or held by exactly one handle."""
        holders: dict[int, int] = {}
        rows = np.zeros(self.pool.num_pages, np.int32)
        for p in (self.tree.pages() if self.tree else []) + (self.moves.holders() if self.moves else []):
            holders[p] = holders.get(p, 0) + 1
        for row, h in self.handles.items():
            assert h.row == row, (row, h.row)
            held = [p for p in h.pages if p >= 0]
            for p in held:
                holders[p] = holders.get(p, 0) + 1
            rows[held] += 1
            listed = self.pool.page_table[row, :len(h.pages)].tolist()
            assert listed == h.pages, f"row {row}: page table {listed} != {h.pages}"
            assert (self.pool.page_table[row, len(h.pages):] == -1).all(), f"row {row}: stale table tail"
        self.pool.check_integrity(holders)
        if self.tree is not None:
            self.tree.check_integrity()
        if self.moves is not None:
            self.moves.check_integrity()
        assert (rows == self.row_refs.counts).all(), "row_refs disagree with the handles"
        assert self.pages_in_use == int(np.count_nonzero(rows)), "pages_in_use drifted"
        assert len(self.free_rows) + len(self.handles) == self.pool.max_rows, "row slot leaked"
        assert len(set(self.free_rows)) == len(self.free_rows), "row slot freed twice"
        assert not set(self.free_rows) & set(self.handles), "a row slot is both free and held"
