"""The cache manager with tiers below the pool, driven by hypothesis: every rule of
the plain cache machine (admit, decode, publish, release, evict, matches), plus the
tier moves — saves on eviction and publish, loads started for waiting requests, a
worker that answers them fully, partly or not at all, drops pages (disk bound) and
flushes.

The simulated worker keeps, per key, what the pool page held when it was saved (the
tenant's salt and the page's tokens), and writes it back into the page it loads. So
the plain machine's oracle extends across tiers: an adopted page, loaded or not,
must hold the adopter's own tokens under its own salt. After every rule:
`check_integrity` (a load is a holder; the tree's pages are exactly the named ones),
and the tree holds exactly the model's pages.
"""
from __future__ import annotations

from hypothesis import settings, strategies as st
from hypothesis.stateful import precondition, rule

from ferroxmp.protocol import KVFlush, KVLoad, KVLoaded, KVSave, KVTierReport, unpack_ids
from ferroxmp.scheduler.cache import CacheManager
from ferroxmp.scheduler.tier_index import TierIndex
from test_cache_manager import PS, POOL_PAGES, CacheMachine


class TieredCacheMachine(CacheMachine):
    def __init__(self) -> None:
        super().__init__()
        self.cache = CacheManager(self.pool, PS, tiers=TierIndex(has_host=True, has_disk=True))
        self.store: dict[bytes, tuple] = {}  # the worker's tiers: key -> (salt, page tokens)
        self.answers: list[KVLoad] = []  # loads the worker has not answered yet
        self.history: list[tuple] = []  # every (salt, prefix) the tree ever held
        evicted = self.cache.moves.evicted

        def on_evict(pages):  # the worker copies the pages before anything can reuse them
            evicted(pages)
            self._worker_takes_ops()
        self.cache.tree.on_evict = on_evict

    def _worker_takes_ops(self) -> None:
        report = KVTierReport()
        for op in self.cache.moves.take_ops():
            if isinstance(op, KVSave):  # copied out now: before any later batch reuses the page
                for page, key in zip(unpack_ids(op.pages).tolist(), op.keys):
                    self.store[key] = self.content[page]
                    report.stored.append(key)
                    report.stored_tiers += "d" if op.to_disk else "h"
            elif isinstance(op, KVLoad):
                self.answers.append(op)
            elif isinstance(op, KVFlush):
                report.dropped += list(self.store) * 2
                report.dropped_tiers += "h" * len(self.store) + "d" * len(self.store)
                self.store.clear()
        self.cache.tiers.apply(report)

    @rule(i=st.integers(0, 99), salt=st.sampled_from(["", "tenant-b"]))
    def queue_a_prompt_seen_before(self, i, salt):
        """Prefixes recur (under either salt), so saved pages get asked for again."""
        self.history += [k for k in self.published if k not in self.history]
        if self.history:
            ids = list(self.history[i % len(self.history)][1]) + [i % 3]
            self.waiting.append(self._request(salt, ids))

    def _sync_after_evict(self) -> None:
        self.history += [k for k in self.published if k not in self.history]
        super()._sync_after_evict()

    @rule(i=st.integers(0, 99), salt=st.sampled_from(["", "tenant-b"]), reserve=st.integers(0, 2))
    def a_prompt_comes_back_after_the_pool_dropped_it(self, i, salt, reserve):
        """The case tiers exist for: evict what the pool caches, ask for a prefix it held."""
        self.history += [k for k in self.published if k not in self.history]
        if not self.history:
            return
        while self.rows and i % 2:  # the rows finish too (else their pages fill the pool)
            self.release(0)
        self.evict(POOL_PAGES)
        ids = list(self.history[i % len(self.history)][1]) + [i % 3]
        req = self._request(salt, ids)
        self.waiting.append(req)
        self.cache.moves.start_load(req, reserve, 0.0)
        self._sync_after_evict()
        self._worker_takes_ops()

    @precondition(lambda self: self.waiting and len(self.rows) < 5)
    @rule(i=st.integers(0, 99), reserve=st.integers(0, 2))
    def admit_a_waiting_request(self, i, reserve):
        """Admission of a request not waiting for a load (a loaded prefix is adopted)."""
        ready = [r for r in self.waiting if r.kv_load is None]
        if ready:
            req = ready[i % len(ready)]
            self.waiting.remove(req)
            self._admit(req, reserve)

    @rule(n=st.integers(1, POOL_PAGES))
    def evict(self, n):
        super().evict(n)
        self._worker_takes_ops()

    @rule(i=st.integers(0, 99))
    def publish(self, i):
        if self.rows:
            super().publish(i)
        self._worker_takes_ops()

    @precondition(lambda self: self.waiting)
    @rule(i=st.integers(0, 99), reserve=st.integers(0, 2))
    def start_load(self, i, reserve):
        req = self.waiting[i % len(self.waiting)]
        self.cache.memo(req).probe = None
        self.cache.moves.start_load(req, reserve, 0.0)
        self._sync_after_evict()
        self._worker_takes_ops()

    @precondition(lambda self: self.answers)
    @rule(i=st.integers(0, 99), cut=st.sampled_from([0, 0, 0, 1, 2]))
    def worker_answers_a_load(self, i, cut):
        """The first `ok` pages arrive (a torn file stops the rest)."""
        op = self.answers.pop(i % len(self.answers))
        pages = unpack_ids(op.pages).tolist()
        ok = 0
        for page, key in zip(pages, op.keys):
            if key not in self.store or ok >= len(pages) - cut:
                break
            self.content[page] = self.store[key]
            ok += 1
        load = self.cache.moves.loads[op.load_id]
        salt, tokens, nb = load.salt, load.tokens.tolist(), len(load.base)
        rid = self.cache.moves.finish(KVLoaded(op.load_id, ok, "d" * ok))[0]
        assert rid == load.rid
        have = set(self.cache.tree.pages())
        for j in range(nb, nb + ok):  # the model learns what the tree now holds
            prefix = (salt, tuple(tokens[:(j + 1) * PS]))
            if prefix not in self.published and pages[j - nb] in have:
                self.published[prefix] = pages[j - nb]
        for req in self.waiting:
            if req.kv_load == op.load_id:
                req.kv_load = None

    @precondition(lambda self: self.store)
    @rule(i=st.integers(0, 99))
    def worker_drops_a_page(self, i):
        key = list(self.store)[i % len(self.store)]
        del self.store[key]
        self.cache.tiers.apply(KVTierReport(dropped=[key, key], dropped_tiers="hd"))

    @rule(x=st.integers(0, 19))
    def flush(self, x):
        if x or any(r.cache.lock is not None for r in self.rows) or self.answers:
            return  # the machine's model of locks held during a flush is the plain evict's
        self.cache.moves.flush()
        self._sync_after_evict()
        self._worker_takes_ops()

    def _loading(self) -> set:
        return {p for x in self.cache.moves.loads.values() for p in x.pages}


TieredCacheMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
test_tier_moves_keep_the_contracts_accounting_and_every_page_its_prefix = TieredCacheMachine.TestCase
