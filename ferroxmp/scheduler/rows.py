"""The row lifecycle: admit (match, adopt, allocate), grow, publish, release.

The scheduler's only writer of the page pool and the radix tree. Invariants:
- a live row holds exactly one ref on every page in `req.pages`, and its page
  table row lists those pages (-1 where a sliding window released them);
- the tree holds one ref per page it stores; a row that adopted a prefix has
  the tree path locked until release;
- `release` runs once per admission, only when no batch in flight references
  the row, and publishes the computed, page-aligned prefix first (contract 1).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ferroxmp.radix.pages import PagePool
from ferroxmp.radix.tree import RadixCache
from ferroxmp.scheduler.request import Request, State


def pages_for(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


@dataclass
class RowManager:
    pool: PagePool
    tree: Optional[RadixCache]
    page_size: int
    free_rows: list[int] = field(default_factory=list)
    live: dict[int, Request] = field(default_factory=dict)  # row -> request holding it

    def __post_init__(self) -> None:
        self.free_rows = list(range(self.pool.max_rows - 1, -1, -1))

    # -- pages ---------------------------------------------------------------------

    @property
    def available_pages(self) -> int:
        """Pages an allocation could get now: free, plus what eviction would free."""
        return self.pool.free_count + (self.tree.evictable_pages if self.tree else 0)

    def alloc(self, n: int) -> Optional[list[int]]:
        """n pages, evicting least-recently-used tree leaves first if needed (contract 3)."""
        if n > self.pool.free_count and self.tree is not None:
            self.tree.evict(n - self.pool.free_count)
        return self.pool.alloc(n)

    # -- lifecycle -----------------------------------------------------------------

    def _match(self, req: Request):
        """The tree's match for an admission now, capped at len - 1: the last known token
        must run through the model to produce the logits for the next. None: no tree."""
        if self.tree is None or req.known_len < 2:
            return None
        return self.tree.match_prefix(req.tokens[: req.known_len - 1])

    def match(self, req: Request) -> int:
        """Tokens an admission now would adopt."""
        m = self._match(req)
        return m.length if m is not None else 0

    def admit(self, req: Request, now: float, reserve: int = 0) -> bool:
        """Give `req` a row: adopt the cached prefix and allocate pages for the rest of
        its known tokens. False (and nothing changed) when a row or pages are lacking."""
        if not self.free_rows:
            return False
        m = self._match(req)
        adopted_pages, node = (list(m.pages), m.node) if m is not None else ([], None)
        need = pages_for(req.known_len, self.page_size) - len(adopted_pages)
        if node is not None and adopted_pages:
            self.tree.lock(node)  # before evicting: our own prefix must survive
        if self.available_pages - need < reserve:
            if node is not None and adopted_pages:
                self.tree.unlock(node)
            return False
        fresh = self.alloc(need)
        if fresh is None:
            if node is not None and adopted_pages:
                self.tree.unlock(node)
            return False
        self.pool.retain(adopted_pages)
        row = self.free_rows.pop()
        req.pages = adopted_pages + fresh
        req.lock_node = node if adopted_pages else None
        req.admit(row, len(adopted_pages) * self.page_size, now)
        self.pool.set_row(row, req.pages, req.scheduled)
        self.live[row] = req
        return True

    def grow(self, req: Request, positions: int) -> bool:
        """Make sure the row has pages for `positions` positions."""
        need = pages_for(positions, self.page_size) - len(req.pages)
        if need <= 0:
            return True
        fresh = self.alloc(need)
        if fresh is None:
            return False
        start = len(req.pages)
        req.pages.extend(fresh)
        self.pool.page_table[req.row, start:start + need] = fresh
        return True

    def publish(self, req: Request) -> None:
        """Insert the page-aligned prefix whose KV is computed into the tree. The tree
        takes its own ref on pages it did not hold; the row keeps its refs."""
        if self.tree is None or req.released_window_pages:
            return
        n = min(req.computed, req.known_len) // self.page_size
        if n == 0:
            return
        self.tree.insert(req.tokens[: n * self.page_size], req.pages[:n])

    def release(self, req: Request) -> None:
        """Publish, then give back every page ref, the lock and the row slot. Once."""
        assert req.inflight == 0 and req.row is not None, (req.rid, req.inflight, req.row)
        self.publish(req)
        self.pool.release(p for p in req.pages if p >= 0)
        if req.lock_node is not None:
            self.tree.unlock(req.lock_node)
        self.pool.clear_row(req.row)
        del self.live[req.row]
        self.free_rows.append(req.row)
        req.pages = []
        req.lock_node = None
        req.row = None

    def release_window_pages(self, req: Request, window: int) -> int:
        """Drop the row's refs on pages wholly before every position it can still read.
        Uses `computed` (not `scheduled`): a batch in flight may read one window back."""
        first_needed = max(0, req.computed - window - self.page_size)
        n = first_needed // self.page_size
        dropped = [p for p in req.pages[:n] if p >= 0]
        if not dropped:
            return 0
        self.pool.release(dropped)
        for i in range(n):
            req.pages[i] = -1
        self.pool.page_table[req.row, :n] = -1
        req.released_window_pages = True
        return len(dropped)

    # -- accounting ----------------------------------------------------------------

    def holders(self) -> dict[int, int]:
        counts: dict[int, int] = {}
        for p in (self.tree.pages() if self.tree else []):
            counts[p] = counts.get(p, 0) + 1
        for req in self.live.values():
            for p in req.pages:
                if p >= 0:
                    counts[p] = counts.get(p, 0) + 1
        return counts

    def cached_pages(self) -> int:
        """Pages held only by the tree."""
        if self.tree is None:
            return 0
        pages = self.tree.pages()
        return int((self.pool.refs[list(pages)] == 1).sum()) if pages else 0

    def check_integrity(self) -> None:
        self.pool.check_integrity(self.holders())
        if self.tree is not None:
            self.tree.check_integrity()
        assert len(self.free_rows) + len(self.live) == self.pool.max_rows, "row slot leaked"
        assert len(set(self.free_rows)) == len(self.free_rows), "row slot freed twice"
        for row, req in self.live.items():
            assert req.row == row and req.state != State.WAITING, (row, req.rid, req.state)
            listed = self.pool.page_table[row, : len(req.pages)].tolist()
            assert listed == req.pages, f"row {row}: page table {listed} != {req.pages}"
