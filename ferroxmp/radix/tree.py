"""RadixCache: a page-granular prefix tree over token ids, holding pool pages.

Its one job is the radix contract's tree side: `insert` publishes a row's computed
prefix, `peek` says how much a new row could adopt (a pure read), `match_prefix`
finds it for adoption (touches LRU, may split), `lock`/`unlock` pin a path while
rows read it, `evict` hands least-recently-used pages back to the pool.

Tenants: every operation takes a `salt`; each salt has its own root, so a prefix
is shared only between requests with the same salt and costs no KV page. A salt's
root goes away when its last node does. `version` counts changes of what a match
could return (pages added or removed, not splits): a caller may remember a match
until it moves.

Invariants (checked by `check_integrity`):
- every node but the root holds >= 1 page and a key of exactly len(pages) pages of
  tokens; nodes split only at page boundaries;
- a node is filed in its parent's `children` under its first page's tokens, so no
  two siblings share a first page and a lookup is one dict hit per node;
- the tree holds exactly one pool ref on each page it stores, and no page twice;
- a node's lock_ref counts the locks at or below it (root: all locks); locked
  nodes are never evicted, nor is a leaf whose pages a row still holds (refs > 1).

Keys are the tokens packed as native int32 bytes: comparing a page (or a whole
node) is one memcmp in C, and a 2,000-token key costs 8 KB instead of ~70 KB of
int objects in a tuple. LRU is a logical clock (one tick per call), so ties and
order are deterministic; evictable leaves sit in a lazy heap keyed by that clock.
"""
from __future__ import annotations

import heapq
import struct
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence, Union

import numpy as np

from ferroxmp.page_pool import PagePool

TokenIds = Union[Sequence[int], np.ndarray]
_BYTES_PER_TOKEN = 4


class RadixError(RuntimeError):
    """The tree's structure or its page accounting is broken (a bug, not a user error)."""


@dataclass(eq=False)
class Node:
    key: bytes  # tokens as int32 bytes, len == len(pages) * page_size * 4
    pages: list[int]
    parent: Optional["Node"] = field(repr=False)
    children: dict[bytes, "Node"] = field(default_factory=dict, repr=False)
    lock_ref: int = 0
    last_access: int = 0
    attached: bool = True  # False once evicted: stale heap entries and handles see it
    salt: str = ""  # which tenant's root this node hangs from (set on roots only)

    @property
    def is_leaf(self) -> bool:
        return not self.children


@dataclass
class MatchResult:
    length: int  # tokens matched, a multiple of page_size
    node: Node  # the deepest matched node (the root when nothing matched); lock this
    pages: list[int]  # one page per matched page_size tokens, in order


@dataclass(eq=False)
class RadixCache:
    pool: PagePool
    page_size: int
    roots: dict[str, Node] = field(init=False)  # salt -> root
    version: int = field(init=False, default=0)  # bumped when a match's result may change
    num_pages: int = field(init=False, default=0)  # pages the tree holds
    # Pages in unlocked nodes: an upper bound on what evict() can free, since a leaf
    # whose pages a row holds without a lock (it published them) frees nothing yet.
    evictable_pages: int = field(init=False, default=0)
    _clock: int = field(init=False, default=0)
    _seq: int = field(init=False, default=0)
    _num_nodes: int = field(init=False, default=0)
    _heap: list = field(init=False, default_factory=list)  # (last_access, seq, leaf)
    # Called with the pages evict() is about to free, while their KV is still intact
    # (the scheduler's tiers save them first: scheduler/tier_moves.py).
    on_evict: Optional[Callable[[list[int]], None]] = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        self._page_bytes = self.page_size * _BYTES_PER_TOKEN
        self.roots = {"": Node(b"", [], None)}

    @property
    def root(self) -> Node:
        """The root of the unsalted tree."""
        return self.roots[""]

    def _root(self, salt: str, create: bool) -> Optional[Node]:
        node = self.roots.get(salt)
        if node is None and create:
            node = self.roots[salt] = Node(b"", [], None, salt=salt)
        return node

    def _drop_root_if_empty(self, root: Node) -> None:
        # Salts are client-chosen: an empty tenant root must not outlive its last node.
        if root.salt and not root.children and root.lock_ref == 0:
            self.roots.pop(root.salt, None)
            root.attached = False

    @property
    def total_size(self) -> int:
        """Tokens stored in the tree."""
        return self.num_pages * self.page_size

    @property
    def locked_pages(self) -> int:
        return self.num_pages - self.evictable_pages

    # ---- keys -------------------------------------------------------------------

    def _key(self, ids: TokenIds) -> bytes:
        """The page-aligned prefix of ids as int32 bytes."""
        n = len(ids) // self.page_size * self.page_size
        if isinstance(ids, np.ndarray):
            return np.ascontiguousarray(ids[:n], dtype=np.int32).tobytes()
        if isinstance(ids, (bytes, bytearray, memoryview)):
            raise TypeError("pass token ids as a sequence of ints or an ndarray, not bytes")
        # struct.pack: ~2x faster than array.array or numpy on a list of ints
        return struct.pack(f"{n}i", *ids[:n])

    def _common_pages(self, key: bytes, b: bytes, pos: int) -> int:
        """Whole pages `key` and b[pos:] share; the caller knows the first matches."""
        pb = self._page_bytes
        n = min(len(key), len(b) - pos) // pb
        i = 1
        while i < n and key[i * pb:(i + 1) * pb] == b[pos + i * pb:pos + (i + 1) * pb]:
            i += 1
        return i

    # ---- LRU --------------------------------------------------------------------

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _touch(self, node: Node, stamp: int) -> None:
        # A leaf's heap entry is valid only while its stamp is current: re-file it.
        node.last_access = stamp
        if node.is_leaf:
            self._push_leaf(node)

    def _push_leaf(self, node: Node) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (node.last_access, self._seq, node))
        if len(self._heap) > 2 * self._num_nodes + 1024:
            self._rebuild_heap()

    def _rebuild_heap(self) -> None:
        # Stale entries (touched or evicted leaves) pile up; keep the heap O(nodes).
        self._heap = []
        for node in self._nodes():
            if node.is_leaf:
                self._seq += 1
                self._heap.append((node.last_access, self._seq, node))
        heapq.heapify(self._heap)

    def _nodes(self):
        stack = [c for r in self.roots.values() for c in r.children.values()]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    # ---- structure --------------------------------------------------------------

    def _split(self, node: Node, n_pages: int) -> Node:
        """Cut `node` after n_pages pages; returns the new upper node (same path)."""
        cut = n_pages * self._page_bytes
        upper = Node(node.key[:cut], node.pages[:n_pages], node.parent,
                     lock_ref=node.lock_ref, last_access=node.last_access)
        node.parent.children[node.key[:self._page_bytes]] = upper
        node.key = node.key[cut:]
        node.pages = node.pages[n_pages:]
        node.parent = upper
        upper.children[node.key[:self._page_bytes]] = node
        self._num_nodes += 1
        return upper

    def peek(self, ids: TokenIds, salt: str = "") -> int:
        """Tokens of ids' longest page-aligned prefix in the tree. A pure read: no LRU
        touch, no split, so admission can score candidates it will not admit."""
        node = self.roots.get(salt)
        if node is None:
            return 0
        b = self._key(ids)
        pb = self._page_bytes
        pos = 0
        while pos < len(b):
            child = node.children.get(b[pos:pos + pb])
            if child is None:
                break
            if not b.startswith(child.key, pos):
                pos += self._common_pages(child.key, b, pos) * pb
                break
            pos += len(child.key)
            node = child
        return pos // _BYTES_PER_TOKEN

    def match_prefix(self, ids: TokenIds, salt: str = "") -> MatchResult:
        """Longest page-aligned prefix of ids in the tree (uncapped: admission caps ids
        at len(prompt) - 1 first). Touches the path for LRU; splits the last node so
        that the returned node covers exactly the match. An int32 ndarray (e.g.
        np.frombuffer of the wire bytes) converts ~7x faster than a list of ints."""
        root = self.roots.get(salt)
        if root is None:  # a tenant with nothing cached: nothing to lock either
            return MatchResult(0, Node(b"", [], None, salt=salt), [])
        b = self._key(ids)
        pb = self._page_bytes
        stamp = self._tick()
        node, pos, pages = root, 0, []
        while pos < len(b):
            child = node.children.get(b[pos:pos + pb])
            if child is None:
                break
            if not b.startswith(child.key, pos):
                child = self._split(child, self._common_pages(child.key, b, pos))
            self._touch(child, stamp)
            pages.extend(child.pages)
            pos += len(child.key)
            node = child
        return MatchResult(pos // _BYTES_PER_TOKEN, node, pages)

    def insert(self, ids: TokenIds, pages: Sequence[int], salt: str = "") -> int:
        """Publish the page-aligned prefix of ids, whose KV sits in `pages` (one per
        page; a trailing partial page is ignored). Returns how many tokens the tree
        already held. The tree retains every page it newly stores; the caller keeps
        its own ref on all of its pages (duplicates included) and releases them."""
        n_pages = len(ids) // self.page_size
        if len(pages) < n_pages:
            raise ValueError(f"{len(ids)} tokens fill {n_pages} pages but only "
                             f"{len(pages)} pages were given")
        b = self._key(ids)
        pb = self._page_bytes
        stamp = self._tick()
        node, pos = self._root(salt, create=bool(b)), 0
        while pos < len(b):
            child = node.children.get(b[pos:pos + pb])
            if child is None:
                first = pos // pb
                new_pages = [int(p) for p in pages[first:n_pages]]
                self.pool.retain(new_pages)
                leaf = Node(b[pos:], new_pages, node, last_access=stamp)
                node.children[b[pos:pos + pb]] = leaf
                self._num_nodes += 1
                self.num_pages += len(new_pages)
                self.evictable_pages += len(new_pages)  # a new leaf is never locked
                self.version += 1
                self._push_leaf(leaf)
                return pos // _BYTES_PER_TOKEN
            if not b.startswith(child.key, pos):
                common = self._common_pages(child.key, b, pos)
                if pos + common * pb == len(b):
                    self._touch(child, stamp)
                    return len(b) // _BYTES_PER_TOKEN  # ids end inside child: all present
                child = self._split(child, common)
            self._touch(child, stamp)
            pos += len(child.key)
            node = child
        return pos // _BYTES_PER_TOKEN

    # ---- locks ------------------------------------------------------------------

    def lock(self, node: Node) -> None:
        """Pin node's path (a row reads its pages); the root only counts the lock."""
        if not node.attached:
            raise RadixError("lock of an evicted node")
        while node.parent is not None:
            if node.lock_ref == 0:
                self.evictable_pages -= len(node.pages)
            node.lock_ref += 1
            node = node.parent
        node.lock_ref += 1

    def unlock(self, node: Node) -> None:
        if not node.attached:
            raise RadixError("unlock of an evicted node")
        while node.parent is not None:
            if node.lock_ref <= 0:
                raise RadixError("unlock of a node that is not locked")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.evictable_pages += len(node.pages)
            node = node.parent
        node.lock_ref -= 1
        self._drop_root_if_empty(node)

    # ---- eviction ---------------------------------------------------------------

    def _held_by_a_row(self, node: Node) -> bool:
        refs = self.pool.refs
        return any(refs[p] > 1 for p in node.pages)

    def evict(self, n_pages: int) -> int:
        """Free up to n_pages pages (refcount reaching 0), least-recently-used unlocked
        leaves first, trimming a leaf's tail when it holds more than is needed.
        Returns the pages freed; fewer than asked only when no leaf can give more."""
        freed = 0
        skipped = []
        while freed < n_pages and self._heap:
            entry = heapq.heappop(self._heap)
            stamp, _, node = entry
            if not node.attached or node.children or stamp != node.last_access:
                continue  # stale: evicted, grew children, or touched since
            if node.lock_ref > 0 or self._held_by_a_row(node):
                skipped.append(entry)  # evicting it would free nothing now
                continue
            take = min(n_pages - freed, len(node.pages))
            if take < len(node.pages):
                keep = len(node.pages) - take
                gone = node.pages[keep:]
                node.pages = node.pages[:keep]
                node.key = node.key[:keep * self._page_bytes]
                heapq.heappush(self._heap, entry)  # still the same leaf, same age
            else:
                gone = node.pages
                self._detach(node)
            if self.on_evict is not None:
                self.on_evict(gone)
            self.pool.release(gone)
            self.version += 1
            self.num_pages -= len(gone)
            self.evictable_pages -= len(gone)
            freed += len(gone)
        for entry in skipped:
            heapq.heappush(self._heap, entry)
        return freed

    def _detach(self, node: Node) -> None:
        parent = node.parent
        del parent.children[node.key[:self._page_bytes]]
        node.attached = False
        node.parent = None
        self._num_nodes -= 1
        if parent.parent is None:
            self._drop_root_if_empty(parent)
        elif parent.is_leaf:
            self._push_leaf(parent)

    # ---- accounting -------------------------------------------------------------

    def pages(self) -> list[int]:
        """Every page the tree holds (one tree ref each)."""
        out: list[int] = []
        for node in self._nodes():
            out.extend(node.pages)
        return out

    def reset(self) -> None:
        """Release every page the tree holds. Refused while a row holds a lock: its
        node would vanish under it."""
        locks = sum(r.lock_ref for r in self.roots.values())
        if locks:
            raise RadixError(f"reset with {locks} locks held")
        held = self.pages()
        for node in self._nodes():
            node.attached = False
        self.pool.release(held)
        self.version += 1
        self.roots = {"": Node(b"", [], None)}
        self.num_pages = self.evictable_pages = self._num_nodes = 0
        self._heap = []

    def check_integrity(self) -> None:
        pb = self._page_bytes
        seen: set[int] = set()
        n_pages = evictable = n_nodes = 0
        live_entries = {id(n) for stamp, _, n in self._heap
                        if n.attached and stamp == n.last_access}
        for salt, root in self.roots.items():
            if root.parent is not None or root.salt != salt or not root.attached:
                raise RadixError(f"root of salt {salt!r} is not a filed root")
            if salt and not root.children and not root.lock_ref:
                raise RadixError(f"empty root of salt {salt!r} left behind")
        stack = list(self.roots.values())
        while stack:
            node = stack.pop()
            if node.parent is not None:
                n_nodes += 1
                if not node.pages or len(node.key) != len(node.pages) * pb:
                    raise RadixError(f"node key of {len(node.key) // 4} tokens holds "
                                     f"{len(node.pages)} pages of {self.page_size}")
                if node.parent.children.get(node.key[:pb]) is not node or not node.attached:
                    raise RadixError("node not filed under its first page in its parent")
                n_pages += len(node.pages)
                evictable += len(node.pages) if node.lock_ref == 0 else 0
                if node.is_leaf and id(node) not in live_entries:
                    raise RadixError("a leaf is missing from the eviction heap")
                for p in node.pages:
                    if p in seen:
                        raise RadixError(f"page {p} is in the tree twice")
                    seen.add(p)
                    if not 0 <= p < self.pool.num_pages or self.pool.refs[p] < 1:
                        raise RadixError(f"tree page {p} has no ref in the pool")
            below = 0
            for k, child in node.children.items():
                if child.parent is not node or child.key[:pb] != k:
                    raise RadixError("child filed under the wrong key or parent")
                below += child.lock_ref
                stack.append(child)
            if node.lock_ref < below or node.lock_ref < 0:
                raise RadixError(f"lock_ref {node.lock_ref} < {below} locks below it")
        if (n_pages, evictable, n_nodes) != (self.num_pages, self.evictable_pages, self._num_nodes):
            raise RadixError(f"counters (pages, evictable, nodes) = {(self.num_pages, self.evictable_pages, self._num_nodes)} "
                             f"but the tree has {(n_pages, evictable, n_nodes)}")
