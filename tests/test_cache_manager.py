"""The cache manager, driven by hypothesis the way the scheduler drives it: admit
(match, adopt, allocate), decode (allocate), compute, publish, release, evict, and
pure matches — under two tenants' salts.

A model knows which page holds which (salt, tokens) and what the tree should hold.
After every rule: `check_integrity` (every refcount equals its holders, the page
table lists each handle's pages), the tree holds exactly the model's pages, an
adopted page always holds the adopter's own tokens under its own salt (a hit that
returned another prefix's or another tenant's page would pass every refcount check
and still change the answer), a match moves nothing, and the incremental counters
(pages in use, pages cached) equal a count from scratch."""
from __future__ import annotations

import numpy as np
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from ferroxmp.protocol import SamplingParams
from ferroxmp.page_pool import PagePool
from ferroxmp.scheduler.cache import CacheManager
from ferroxmp.scheduler.request import Request

PS, POOL_PAGES, ROWS = 2, 24, 5
SALTS = st.sampled_from(["", "tenant-b"])
TOKENS = st.lists(st.integers(0, 2), min_size=1, max_size=9)


class CacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool = PagePool.create(POOL_PAGES, ROWS, 16)
        self.cache = CacheManager(self.pool, PS)
        self.rows: list[Request] = []
        self.waiting: list[Request] = []  # matched again and again, as admission does each step
        self.published: dict[tuple, int] = {}  # (salt, prefix tokens) -> page of its last page
        self.content: dict[int, tuple] = {}  # page -> (salt, tokens written in it)
        self.mirror: dict[int, int] = {}  # id(request) -> pages it published (publish skips fewer)
        self.n = 0

    def teardown(self) -> None:
        self.pool.close()
        self.pool.unlink()

    def _expected(self, salt: str, ids: list[int]) -> list[int]:
        pages = []
        for i in range(len(ids) // PS):
            page = self.published.get((salt, tuple(ids[:(i + 1) * PS])))
            if page is None:
                break
            pages.append(page)
        return pages

    def _request(self, salt: str, ids: list[int]) -> Request:
        self.n += 1
        return Request(f"r{self.n}", np.array(ids, np.int32), SamplingParams(), 0.0, salt=salt)

    def _pick(self, i: int) -> Request:
        return self.rows[i % len(self.rows)]

    def _write(self, req: Request) -> None:
        ids = req.tokens.tolist()
        for i, p in enumerate(req.cache.pages):
            if p >= 0 and i * PS < len(ids) and i >= req.cache.adopted // PS:
                self.content[p] = (req.salt, tuple(ids[i * PS:(i + 1) * PS]))

    def _publish_model(self, req: Request) -> None:
        n = min(req.computed, req.known_len) // PS
        if n <= self.mirror[id(req)]:
            return
        ids = req.tokens.tolist()
        have = len(self._expected(req.salt, ids[:n * PS]))
        for i in range(have, n):
            self.published[(req.salt, tuple(ids[:(i + 1) * PS]))] = req.cache.pages[i]
        self.mirror[id(req)] = n

    def _sync_after_evict(self) -> None:
        tree_pages = set(self.cache.tree.pages())
        self.published = {k: p for k, p in self.published.items() if p in tree_pages}

    @rule(salt=SALTS, ids=TOKENS)
    def match_is_a_pure_read(self, salt, ids):
        tree = self.cache.tree
        req = self._request(salt, ids)
        before = (tree._clock, tree._num_nodes, tree.version)
        want = len(self._expected(salt, ids[:-1])) * PS if len(ids) >= 2 else 0
        assert self.cache.match(req) == want
        assert (tree._clock, tree._num_nodes, tree.version) == before, "a match changed the tree"

    @rule(salt=SALTS, ids=TOKENS)
    def queue(self, salt, ids):
        self.waiting.append(self._request(salt, ids))

    @precondition(lambda self: self.waiting)
    @rule(i=st.integers(0, 99))
    def a_remembered_match_follows_the_tree(self, i):
        req = self.waiting[i % len(self.waiting)]
        ids = req.tokens.tolist()
        want = len(self._expected(req.salt, ids[:-1])) * PS if len(ids) >= 2 else 0
        assert self.cache.match(req) == want, "a remembered match outlived a change of the tree"

    @precondition(lambda self: len(self.rows) < ROWS)
    @rule(salt=SALTS, ids=TOKENS, reserve=st.integers(0, 2))
    def admit(self, salt, ids, reserve):
        self._admit(self._request(salt, ids), reserve)

    def _admit(self, req: Request, reserve: int) -> None:
        salt, ids = req.salt, req.tokens.tolist()
        want = self.cache.match(req)
        handle = self.cache.admit(req, reserve)
        self._sync_after_evict()
        if handle is None:
            return
        assert handle.adopted == want, "admission adopted other than its match said"
        for i, p in enumerate(handle.pages[:want // PS]):
            assert self.content[p] == (salt, tuple(ids[i * PS:(i + 1) * PS])), "adopted foreign KV"
        req.cache, req.computed = handle, handle.adopted
        self.mirror[id(req)] = want // PS
        self._write(req)
        self.rows.append(req)

    @precondition(lambda self: self.rows)
    @rule(i=st.integers(0, 99), token=st.integers(0, 2))
    def decode(self, i, token):
        req = self._pick(i)
        req.computed = req.known_len
        req.ids.append(token)
        ok = self.cache.allocate(req.cache, req.known_len)
        self._sync_after_evict()
        if not ok:
            req.ids.truncate(len(req.ids) - 1)
            return
        self._write(req)

    @precondition(lambda self: self.rows)
    @rule(token=st.integers(0, 2))
    def decode_in_bulk(self, token):
        """Every row whose next position starts a page asks for it in one `grow`: all
        get a page or none does (and then nothing but eviction happened)."""
        boundary = [r for r in self.rows if r.known_len >= len(r.cache.pages) * PS]
        if not boundary:
            return
        pages_before = [list(r.cache.pages) for r in boundary]
        free, tree_only = self.pool.free_count, self.cache.pages_cached  # eviction frees only tree-only pages
        ok = self.cache.grow([r.cache for r in boundary])
        self._sync_after_evict()
        if free >= len(boundary):
            assert ok, "grow refused though free pages were there"
        if free + tree_only < len(boundary):
            assert not ok, "grow succeeded with more pages than free + what eviction could free"
        if not ok:
            assert [r.cache.pages for r in boundary] == pages_before, "a refused grow changed a row"
            return
        for r, before in zip(boundary, pages_before):
            assert r.cache.pages[:-1] == before and len(r.cache.pages) == len(before) + 1
            r.computed = r.known_len
            r.ids.append(token)
            self._write(r)

    @precondition(lambda self: self.rows)
    @rule(i=st.integers(0, 99))
    def publish(self, i):
        req = self._pick(i)
        req.computed = req.known_len
        self._publish_model(req)
        self.cache.publish(req)

    @precondition(lambda self: self.rows)
    @rule(i=st.integers(0, 99))
    def release(self, i):
        req = self._pick(i)
        self.rows.remove(req)
        self._publish_model(req)
        self.cache.release(req)
        assert req.cache is None

    @rule(n=st.integers(1, POOL_PAGES))
    def evict(self, n):
        held = {p for r in self.rows for p in r.cache.pages}
        freed = self.cache.evict(n)
        assert 0 <= freed <= n
        before = set(self.published.values())
        self._sync_after_evict()
        assert not (before - set(self.published.values())) & held, "evicted a page a row holds"

    def _loading(self) -> set:
        """Pages held by loads from a tier below the pool (none here; test_tier_moves.py)."""
        return set()

    @invariant()
    def accounted(self):
        self.cache.check_integrity()
        tree_pages = self.cache.tree.pages()
        assert sorted(self.published.values()) == sorted(tree_pages), "tree and model disagree"
        rows = {p for r in self.rows for p in r.cache.pages if p >= 0}
        loading = self._loading()
        assert not loading & (rows | set(tree_pages)), "a page being loaded is also held elsewhere"
        assert self.cache.pages_in_use == len(rows)
        assert self.cache.pages_cached == len(set(tree_pages) - rows)
        assert self.pool.free_count + len(rows | set(tree_pages) | loading) == POOL_PAGES


CacheMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
test_the_cache_manager_keeps_the_contracts_accounting = CacheMachine.TestCase
