"""RadixCache over a PagePool: publish, adopt, lock, evict, and the page accounting.

The stateful test at the end drives the tree and the pool the way the scheduler
does (rows as plain page lists) and checks the contract's accounting after every
step against a model that knows which page holds which tokens.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Optional

import numpy as np
import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from ferroxmp.page_pool import PagePool
from ferroxmp.radix import RadixCache, RadixError
from ferroxmp.radix.tree import Node

PS = 4


@pytest.fixture
def pool():
    pool = PagePool.create(64, 4, 16)
    yield pool
    pool.close()
    pool.unlink()


@pytest.fixture
def tree(pool):
    return RadixCache(pool, PS)


def _row(pool: PagePool, n_tokens: int) -> list[int]:
    """A row's fresh pages for n_tokens (the row's own ref on each)."""
    pages = pool.alloc(math.ceil(n_tokens / PS))
    assert pages is not None
    return pages


def test_a_published_prefix_is_matched_page_for_page(pool, tree):
    """Adoption must hand back the very pages that were published, in order, and only
    whole pages: the partial last page holds KV the next row would not recompute."""
    ids = list(range(100, 114))  # 3 whole pages + 2 tokens
    pages = _row(pool, len(ids))
    assert tree.insert(ids, pages) == 0
    assert tree.total_size == 12 and tree.num_pages == 3
    assert [pool.refs[p] for p in pages] == [2, 2, 2, 1], "tree must retain the 3 whole pages only"
    m = tree.match_prefix(ids)
    assert (m.length, m.pages) == (12, pages[:3])
    m = tree.match_prefix(ids[:11])
    assert (m.length, m.pages) == (8, pages[:2]), "a match ends at the last whole page"
    assert tree.match_prefix([7] + ids[1:]).length == 0
    tree.check_integrity()


def test_token_ids_as_an_ndarray_match_the_same_as_a_list(pool, tree):
    """The scheduler may hold ids as int32 arrays (the wire format) or lists."""
    ids = list(range(9))
    pages = _row(pool, 9)
    tree.insert(np.array(ids, np.int32), pages)
    assert tree.match_prefix(ids).pages == pages[:2]
    assert tree.match_prefix(np.array(ids, np.int64)).pages == pages[:2]


def test_a_diverging_insert_splits_at_a_page_boundary(pool, tree):
    """Two sequences that differ inside page 2 share pages 0-1 and nothing of page 2:
    sharing part of a page would give one row the other's KV for its tokens."""
    a = list(range(16))
    b = a[:9] + [99] * 7  # differs at token 9, inside the third page
    pa, pb = _row(pool, 16), _row(pool, 16)
    tree.insert(a, pa)
    assert tree.insert(b, pb) == 8
    assert tree.num_pages == 4 + 2
    assert tree.match_prefix(a).pages == pa
    assert tree.match_prefix(b).pages == pa[:2] + pb[2:]
    assert [pool.refs[p] for p in pb] == [1, 1, 2, 2], "b's duplicate pages stay b's alone"
    assert {len(n.key) // 4 for n in tree.root.children.values()} == {8}
    tree.check_integrity()


def test_a_duplicate_insert_returns_the_existing_length_and_retains_nothing(pool, tree):
    """Two rows that computed the same prompt concurrently: the second publish must
    keep the first's pages, take no ref on its own copies (the row frees them), and
    say how much was already there."""
    ids = list(range(12))
    first, second = _row(pool, 12), _row(pool, 12)
    tree.insert(ids, first)
    refs_before = pool.refs.copy()
    assert tree.insert(ids, second) == 12
    assert tree.insert(ids[:8], second) == 8, "a stored prefix is already present"
    np.testing.assert_array_equal(pool.refs, refs_before)
    assert tree.num_pages == 3 and tree.match_prefix(ids).pages == first
    tree.check_integrity()


def test_insert_with_fewer_pages_than_whole_pages_of_tokens_raises(pool, tree):
    """Publishing tokens whose KV has no page is a caller bug, not a short insert."""
    with pytest.raises(ValueError):
        tree.insert(list(range(12)), _row(pool, 8))


def test_matching_part_of_a_node_splits_it_so_a_lock_covers_exactly_the_match(pool, tree):
    """A row adopting 2 of a node's 4 pages locks those 2; the other 2 stay evictable."""
    ids = list(range(16))
    row = _row(pool, 16)
    tree.insert(ids, row)
    pool.release(row)
    m = tree.match_prefix(ids[:9])
    assert m.length == 8 and m.node.pages == row[:2]
    pool.retain(m.pages)
    tree.lock(m.node)
    assert (tree.evictable_pages, tree.locked_pages) == (2, 2)
    assert tree.evict(10) == 2
    assert tree.match_prefix(ids).pages == row[:2], "a locked path was evicted"
    tree.check_integrity()
    tree.unlock(m.node)
    pool.release(m.pages)
    assert tree.evict(10) == 2 and pool.free_count == 64
    tree.check_integrity()


def test_a_lock_taken_before_a_later_split_still_unlocks_its_whole_path(pool, tree):
    """A split after lock() moves the node's head into a new parent; the handle the row
    kept must still release every page it pinned."""
    ids = list(range(16))
    row = _row(pool, 16)
    tree.insert(ids, row)
    pool.release(row)
    m = tree.match_prefix(ids)
    tree.lock(m.node)
    tree.match_prefix(ids[:4])  # splits the locked node
    tree.check_integrity()
    assert tree.evict(10) == 0
    tree.unlock(m.node)
    assert tree.evictable_pages == 4 and tree.evict(10) == 4
    tree.check_integrity()


def test_unlocking_a_node_that_is_not_locked_raises(pool, tree):
    row = _row(pool, 8)
    tree.insert(list(range(8)), row)
    with pytest.raises(RadixError):
        tree.unlock(tree.match_prefix(list(range(8))).node)


def test_eviction_takes_the_least_recently_used_leaf_first(pool, tree):
    """LRU by last access, not by insertion: a sequence matched recently survives one
    published earlier but never read since."""
    seqs = [[k] * 8 for k in (1, 2, 3)]
    pages = {}
    for s in seqs:
        pages[s[0]] = _row(pool, 8)
        tree.insert(s, pages[s[0]])
        pool.release(pages[s[0]])
    tree.match_prefix(seqs[0])  # 1 is now the most recent; 2 the least
    # tree.pages() reads without touching; a match would reorder the LRU
    assert tree.evict(2) == 2
    assert sorted(tree.pages()) == sorted(pages[1] + pages[3])
    assert tree.evict(2) == 2
    assert sorted(tree.pages()) == sorted(pages[1]), "3 was older than the re-read 1"
    tree.check_integrity()


def test_evict_frees_exactly_what_it_reports_and_drops_the_trees_refs(pool, tree):
    """The returned count is what admission adds to free_count: it must be the pages
    whose refcount reached 0, no more, trimming a leaf's tail rather than overshooting."""
    ids = list(range(20))
    row = _row(pool, 20)
    tree.insert(ids, row)
    pool.release(row)
    free_before = pool.free_count
    assert tree.evict(2) == 2
    assert pool.free_count == free_before + 2
    assert [pool.refs[p] for p in row] == [1, 1, 1, 0, 0]
    assert tree.match_prefix(ids).pages == row[:3], "the tail goes first, the prefix stays"
    assert tree.evict(100) == 3 and pool.free_count == 64 and tree.num_pages == 0
    tree.check_integrity()


def test_a_page_a_row_still_holds_is_not_counted_as_freed(pool, tree):
    """A row reading a page it never locked (it published it, refs == 2) must not lose
    it, and releasing the tree's ref would free nothing: evict skips that leaf."""
    ids = list(range(12))
    row = _row(pool, 12)
    tree.insert(ids, row)
    free_before = pool.free_count
    assert tree.evict(3) == 0
    assert pool.free_count == free_before and [pool.refs[p] for p in row] == [2, 2, 2]
    assert tree.match_prefix(ids).pages == row
    pool.release(row)
    assert tree.evict(3) == 3 and pool.free_count == free_before + 3
    tree.check_integrity()


def test_a_parent_left_without_children_is_evicted_in_turn(pool, tree):
    """Eviction is leaf by leaf; a shared prefix whose branches are gone must become a
    candidate itself, or the tree keeps it forever."""
    a, b = list(range(12)), list(range(8)) + [50] * 4
    for s in (a, b):
        row = _row(pool, 12)
        tree.insert(s, row)
        pool.release(row)
    assert tree.num_pages == 4
    assert tree.evict(4) == 4 and tree.num_pages == 0 and pool.free_count == 64
    tree.check_integrity()


def test_reset_returns_every_page_to_the_pool(pool, tree):
    """A flushed cache must give back exactly the tree's refs, and refuse while a row
    holds a lock (its node would vanish under it)."""
    rows = [_row(pool, 12), _row(pool, 12)]
    tree.insert(list(range(12)), rows[0])
    tree.insert(list(range(4)) + [9] * 8, rows[1])
    m = tree.match_prefix(list(range(12)))
    tree.lock(m.node)
    with pytest.raises(RadixError):
        tree.reset()
    tree.unlock(m.node)
    tree.reset()
    assert tree.num_pages == 0 and tree.total_size == 0 and tree.pages() == []
    assert all(pool.refs[p] == 1 for r in rows for p in r), "rows keep their own refs"
    for r in rows:
        pool.release(r)
    assert pool.free_count == 64
    tree.check_integrity()
    pool.check_integrity()


def test_a_salted_prefix_is_matched_only_under_its_salt_and_its_root_goes_with_it(pool, tree):
    """Tenants: the same tokens under another salt match nothing, at no page cost (the
    salt is a root, not a token). Salts are client-chosen, so a root left empty by
    eviction must go too, or every salt ever seen would stay in memory."""
    ids = list(range(100, 112))
    pages = _row(pool, 12)
    assert tree.insert(ids, pages, salt="tenant-a") == 0
    assert tree.peek(ids) == 0 and tree.match_prefix(ids).length == 0
    assert tree.peek(ids, "tenant-b") == 0
    assert tree.peek(ids, "tenant-a") == 12 and tree.match_prefix(ids, "tenant-a").pages == pages
    assert tree.num_pages == 3, "a salt must not cost a page"
    pool.release(pages)
    tree.check_integrity()
    assert tree.evict(3) == 3
    assert "tenant-a" not in tree.roots, "an empty salted root was left behind"
    tree.check_integrity()


def test_peek_is_a_pure_read_and_version_moves_only_with_pages(pool, tree):
    """Admission scores many requests it will not admit: peek must not split a node or
    touch LRU order. `version` lets callers remember a match; it must move when pages
    enter or leave the tree, and only then (a split changes no match)."""
    ids = list(range(100, 116))
    pages = _row(pool, 16)
    tree.insert(ids, pages)
    v, clock, nodes = tree.version, tree._clock, tree._num_nodes
    assert tree.peek(ids[:9]) == 8 and tree.peek([1] + ids[1:]) == 0
    assert (tree.version, tree._clock, tree._num_nodes) == (v, clock, nodes)
    tree.match_prefix(ids[:9])  # splits the node: same pages, same answers
    assert tree._num_nodes == nodes + 1 and tree.version == v
    tree.insert(ids, pages)  # nothing new
    assert tree.version == v
    more = _row(pool, 4)
    tree.insert(ids + [7, 7, 7, 7], pages + more)
    assert tree.version == v + 1
    pool.release(pages + more)
    tree.evict(1)
    assert tree.version == v + 2
    tree.check_integrity()


def test_publishing_does_not_starve_the_page_pool(pool):
    """The seed's pool-starvation case: 8 pages, each request needs 3 and leaves 2 in
    the tree, distinct first tokens so nothing is adopted. Without eviction the 4th
    request is refused; twelve must run."""
    small = PagePool.create(8, 1, 4)
    try:
        tree = RadixCache(small, PS)
        for cycle in range(12):
            prompt = [10 + cycle % 20, 1, 2, 3, 4, 5, 6, 7]
            need = math.ceil((len(prompt) + 4) / PS)
            pages = small.alloc(need)
            if pages is None:
                tree.evict(need - small.free_count)
                pages = small.alloc(need)
            assert pages is not None, f"cycle {cycle} refused: free={small.free_count}, tree={tree.num_pages}"
            tree.insert(prompt, pages)
            small.release(pages)
            tree.check_integrity()
        assert 0 < small.free_count < 8
    finally:
        small.close()
        small.unlink()


# ---- stateful: the tree and the pool driven like the scheduler does ------------------

SPS, POOL_PAGES = 2, 24


@dataclass
class Row:
    ids: list[int]
    pages: list[int]
    node: Optional[Node]  # the locked node of its adopted prefix


class TreeAndPool(RuleBasedStateMachine):
    """Model: `published` maps every page-aligned prefix the tree should hold to the
    page holding its last page's KV; `content` maps a page to the tokens written in
    it. A match must return exactly the model's pages, and each page's content must
    be the tokens it stands for: a hit that returned another prefix's page would pass
    every refcount check and still change the answer."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = PagePool.create(POOL_PAGES, 8, 8)
        self.tree = RadixCache(self.pool, SPS)
        self.rows: dict[int, Row] = {}
        self.next_row = 0
        self.published: dict[tuple, int] = {}
        self.content: dict[int, tuple] = {}

    def teardown(self) -> None:
        self.pool.close()
        self.pool.unlink()

    # -- helpers --

    def _expected_match(self, ids: list[int]) -> list[int]:
        pages = []
        for i in range(len(ids) // SPS):
            page = self.published.get(tuple(ids[:(i + 1) * SPS]))
            if page is None:
                break
            pages.append(page)
        return pages

    def _evict(self, n: int) -> int:
        held = {p for r in self.rows.values() for p in r.pages}
        before = set(self.tree.pages())
        free_before = self.pool.free_count
        freed = self.tree.evict(n)
        after = set(self.tree.pages())
        assert 0 <= freed <= n
        assert self.pool.free_count - free_before == freed == len(before - after)
        assert before & held <= after, "evicted a page a live row holds"
        assert all(self.pool.refs[p] == 0 for p in before - after)
        if freed < n:
            assert self.tree.evict(1) == 0, "evict stopped short while a leaf could go"
        self.published = {k: p for k, p in self.published.items() if p in after}
        for k in self.published:
            assert len(k) == SPS or k[:-SPS] in self.published, "evicted an inner node"
        return freed

    def _alloc(self, n: int) -> Optional[list[int]]:
        pages = self.pool.alloc(n)
        if pages is None:
            self._evict(n - self.pool.free_count)
            pages = self.pool.alloc(n)
        return pages

    def _admit(self, ids: list[int], adopt: bool) -> None:
        node, pages = None, []
        if adopt:
            capped = ids[:-1]  # prefill must run over at least one token
            m = self.tree.match_prefix(capped)
            assert m.pages == self._expected_match(capped) and m.length == len(m.pages) * SPS
            for i, p in enumerate(m.pages):
                assert self.content[p] == tuple(ids[i * SPS:(i + 1) * SPS]), "adopted foreign KV"
            self.pool.retain(m.pages)
            self.tree.lock(m.node)
            node, pages = m.node, list(m.pages)
        fresh = self._alloc(math.ceil(len(ids) / SPS) - len(pages))
        if fresh is None:  # refused: give back what was adopted
            self.pool.release(pages)
            if node is not None:
                self.tree.unlock(node)
            return
        for i, p in enumerate(fresh, start=len(pages)):
            self.content[p] = tuple(ids[i * SPS:(i + 1) * SPS])
        self.rows[self.next_row] = Row(list(ids), pages + fresh, node)
        self.next_row += 1

    def _publish(self, row: Row) -> None:
        have = len(self._expected_match(row.ids))
        assert self.tree.insert(row.ids, row.pages) == have * SPS
        for i in range(have, len(row.ids) // SPS):
            page = row.pages[i]
            assert self.content[page] == tuple(row.ids[i * SPS:(i + 1) * SPS])
            self.published[tuple(row.ids[:(i + 1) * SPS])] = page

    # -- rules --

    tokens = st.lists(st.integers(0, 2), min_size=1, max_size=9)

    @precondition(lambda self: len(self.rows) < 6)
    @rule(ids=tokens)
    def alloc_a_row(self, ids):
        self._admit(ids, adopt=False)

    @precondition(lambda self: len(self.rows) < 6)
    @rule(ids=tokens)
    def adopt(self, ids):
        self._admit(ids, adopt=True)

    @precondition(lambda self: self.rows)
    @rule(pick=st.integers(0, 10**6), token=st.integers(0, 2))
    def decode_a_token(self, pick, token):
        row = self.rows[sorted(self.rows)[pick % len(self.rows)]]
        row.ids.append(token)
        if len(row.ids) > len(row.pages) * SPS:
            page = self._alloc(1)
            if page is None:
                row.ids.pop()
                return
            row.pages += page
        last = len(row.pages) - 1
        self.content[row.pages[last]] = tuple(row.ids[last * SPS:])

    @precondition(lambda self: self.rows)
    @rule(pick=st.integers(0, 10**6))
    def publish(self, pick):
        self._publish(self.rows[sorted(self.rows)[pick % len(self.rows)]])

    @precondition(lambda self: self.rows)
    @rule(pick=st.integers(0, 10**6))
    def finish(self, pick):
        row = self.rows.pop(sorted(self.rows)[pick % len(self.rows)])
        self._publish(row)
        self.pool.release(row.pages)
        if row.node is not None:
            self.tree.unlock(row.node)

    @rule(n=st.integers(1, POOL_PAGES))
    def evict(self, n):
        self._evict(n)

    # -- the contract's accounting, after every step --

    @invariant()
    def every_refcount_equals_its_holders(self):
        tree_pages = self.tree.pages()
        holders = Counter(tree_pages)
        for r in self.rows.values():
            holders.update(r.pages)
        self.pool.check_integrity(dict(holders))
        self.tree.check_integrity()
        tree_set = set(tree_pages)
        row_held = {p for r in self.rows.values() for p in r.pages}
        free = set(np.flatnonzero(self.pool.refs == 0).tolist())
        assert len(free) == self.pool.free_count
        assert self.pool.free_count + len(tree_set - row_held) + len(row_held) == POOL_PAGES
        assert not free & (tree_set | row_held), "a page is both free and held"
        assert sorted(self.published.values()) == sorted(tree_pages), "tree and model disagree"
        assert self.tree.num_pages == len(tree_pages)
        locks = sum(1 for r in self.rows.values() if r.node is not None)
        assert self.tree.root.lock_ref == locks


TreeAndPool.TestCase.settings = settings(max_examples=150, stateful_step_count=40,
                                         deadline=None)
test_the_tree_and_the_pool_keep_the_contracts_accounting = TreeAndPool.TestCase
