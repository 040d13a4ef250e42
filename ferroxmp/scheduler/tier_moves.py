"""TierMoves: the cache manager's traffic with the tiers below the pool.

Job, for the cache manager (cache.py, still the one writer of pages, refcounts and the
tree; this object is its part that speaks to the tiers):
- name every page the tree holds by its chain key (`page_key`), set at publish;
- on eviction, send the pages not yet below the pool down a tier (a `KVSave`, queued
  in `ops` and sent before any batch that could reuse the pages); with a disk tier,
  also write each newly published page through to disk, so a restart finds it;
- `start_load`: for a waiting request whose prompt continues below the pool, allocate
  pool pages, lock the pool-matched prefix and send a `KVLoad`; the request is not
  admitted until `finish` (the KVLoaded) puts what arrived into the tree — or until
  the load is overdue (`overdue`), then it is admitted and recomputes that part. A
  load may wait about as long as recomputing its tokens would take (WAIT_OVER_RECOMPUTE
  times the step's measured token rate, within [MIN_WAIT_S, LOAD_TIMEOUT_S]); when the
  loads' measured token rate is below the recompute rate (a slow disk), loads are not
  started at all, except one in PROBE_EVERY, a probe that nobody waits for (overdue at
  once), so a disk that recovers is seen without costing any request a wait;
- `flush` (POST /cache/flush).

A load's pages have one ref, the load's own, until `finish` hands them to the tree
(which retains what it stores) and releases it: a load is a holder in the accounting.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from ferroxmp.protocol import KVFlush, KVLoad, KVLoaded, KVSave, pack_ids
from ferroxmp.scheduler.tier_index import DISK, HOST, TierIndex, chain_keys

LOAD_TIMEOUT_S = 5.0  # a load not back by then: the request is admitted and recomputes
MIN_WAIT_S = 0.25  # never give up on a load sooner (the recompute estimate is rough)
WAIT_OVER_RECOMPUTE = 1.0  # a load may take this many times the estimated recompute time
PROBE_EVERY = 8  # while loads are slower than recompute: one load in this many still runs
ALPHA = 0.3  # weight of the newest load in the measured load rate


@dataclass(eq=False)
class Load:
    load_id: int
    rid: str
    salt: str
    tokens: np.ndarray  # the prefix through the last loaded page
    lock: Any  # the locked tree node of the pool-matched prefix (None: nothing matched)
    base: list[int]  # that prefix's pages
    pages: list[int]  # pool pages being filled (one ref each: the load's)
    keys: list[bytes]
    deadline: float  # when the request stops waiting for it
    overdue: bool = False


@dataclass
class TierMoves:
    cache: Any  # the CacheManager that owns this
    index: TierIndex
    page_key: dict[int, bytes] = field(default_factory=dict)  # tree page -> its chain key
    loads: dict[int, Load] = field(default_factory=dict)
    ops: list = field(default_factory=list)  # KVSave / KVLoad / KVFlush to send, in order
    saving: bool = True
    loading_pages: int = 0
    load_tokens_per_s: float = 0.0  # measured from the KVLoaded answers (EWMA)
    skipped: int = 0  # loads not started because the tiers were slower than recompute
    _next_id: int = 0

    # -- saves ---------------------------------------------------------------------

    def published(self, req, handle, already: int, n: int) -> None:
        """The tree stored pages [already // page_size, n) of `handle` (a publish)."""
        ps = self.cache.page_size
        keys = chain_keys(handle.keys, req.salt, req.tokens, ps, n)
        new = range(min(already // ps, n), n)
        for i in new:
            self.page_key[handle.pages[i]] = keys[i]
        if self.index.has_disk:  # written through: a restart finds every published page
            self._save([(handle.pages[i], keys[i]) for i in new], DISK)

    def evicted(self, pages: list[int]) -> None:
        """The tree is about to free these pages (RadixCache.on_evict)."""
        keys = [self.page_key.pop(p) for p in pages]
        if self.saving:
            self._save(list(zip(pages, keys)), HOST if self.index.has_host else DISK)

    def _save(self, pairs: list[tuple[int, bytes]], tier: int) -> None:
        idx = self.index
        todo = [(p, k) for p, k in pairs if not (idx.where.get(k, 0) | idx.pending.get(k, 0)) & tier]
        if not todo:
            return
        for _, k in todo:
            idx.pending[k] = idx.pending.get(k, 0) | tier
        self.ops.append(KVSave(pack_ids([p for p, _ in todo]), [k for _, k in todo], to_disk=tier == DISK))

    # -- loads ---------------------------------------------------------------------

    def start_load(self, req, reserve: int, now: float, recompute_tps: float = 0.0) -> bool:
        """Start loading the part of `req`'s prompt that continues its pool match below
        the pool, if any, if the request would fit once loaded and if loading is not
        slower than recomputing (`recompute_tps`: prefill tokens per second, 0 unknown).
        True if started."""
        cache, idx = self.cache, self.index
        n = req.known_len
        if (req.kv_load is not None or not idx.where or n < 2 or req.params.prompt_logprobs is not None
                or req.params.pooling in ("mean", "cls")):
            return False
        memo, probed = cache.memo(req), (cache.tree.version, idx.version, n)
        if memo.probe == probed:
            return False
        memo.probe = probed
        ps = cache.page_size
        base, limit = cache.match(req) // ps, (n - 1) // ps  # adoption stops before the last token
        if base >= limit:
            return False
        keys = chain_keys(memo.keys, req.salt, req.tokens, ps, limit)
        k = 0
        while base + k < limit and keys[base + k] in idx.where:
            k += 1
        probe = k > 0 and self._slower_than_recompute(recompute_tps)
        if k == 0 or (probe and self.skipped % PROBE_EVERY != 0):
            return False
        if cache.available_pages - cache.pages_needed(req) < reserve:
            memo.probe = None  # no room now: try again next step
            return False
        node, base_pages = None, []
        if base:
            m = cache.tree.match_prefix(req.tokens[:base * ps], req.salt)
            node, base_pages = m.node, list(m.pages)
            cache.tree.lock(node)  # our prefix must outlive the evictions the allocation may cause
        pages = cache._alloc(k)
        if pages is None:
            if node is not None:
                cache.tree.unlock(node)
            memo.probe = None
            return False
        load = Load(self._next_id, req.rid, req.salt, np.array(req.tokens[:(base + k) * ps]), node,
                    base_pages, pages, keys[base:base + k],
                    now if probe else now + self._wait_s(k * ps, recompute_tps))
        self._next_id += 1
        self.loads[load.load_id] = load
        self.loading_pages += len(pages)
        if not probe:  # a probe's request does not wait for it
            req.wait_for_load(load.load_id)
        self.ops.append(KVLoad(load.load_id, pack_ids(pages), load.keys))
        return True

    def _slower_than_recompute(self, recompute_tps: float) -> bool:
        if not (self.load_tokens_per_s and recompute_tps) or self.load_tokens_per_s >= recompute_tps:
            return False
        self.skipped += 1
        return True

    def _wait_s(self, tokens: int, recompute_tps: float) -> float:
        if not recompute_tps:
            return LOAD_TIMEOUT_S
        return min(LOAD_TIMEOUT_S, max(MIN_WAIT_S, WAIT_OVER_RECOMPUTE * tokens / recompute_tps))

    def finish(self, msg: KVLoaded) -> Optional[tuple[str, int, int]]:
        """Put the pages that arrived into the tree; release the load's refs and lock.
        Returns (rid, tokens from host, tokens from disk), or None for an unknown load."""
        load = self.loads.pop(msg.load_id, None)
        if load is None:
            return None
        cache, ps = self.cache, self.cache.page_size
        ok = max(0, min(msg.ok, len(load.pages)))
        if ok and msg.seconds > 0:
            rate = ok * ps / msg.seconds
            self.load_tokens_per_s = rate if not self.load_tokens_per_s else (
                self.load_tokens_per_s + ALPHA * (rate - self.load_tokens_per_s))
        nb = len(load.base)
        if ok:
            pages = load.base + load.pages[:ok]
            already = cache.tree.insert(load.tokens[:(nb + ok) * ps], pages, load.salt)
            for i in range(max(nb, already // ps), nb + ok):
                self.page_key[pages[i]] = load.keys[i - nb]
        cache.pool.release(load.pages)  # the tree retained what it stored; the rest is free
        self.loading_pages -= len(load.pages)
        if load.lock is not None:
            cache.tree.unlock(load.lock)
        tiers = msg.tiers[:ok]
        return load.rid, tiers.count("h") * ps, tiers.count("d") * ps

    def overdue(self, now: float) -> list[str]:
        """Requests whose load is past its deadline: they stop waiting for it (their
        load's pages stay reserved until it reports)."""
        late = []
        for load in self.loads.values():
            if not load.overdue and now > load.deadline:
                load.overdue = True
                late.append(load.rid)
        return late

    def flush(self) -> None:
        """Drop the pool's cached pages without saving them, and empty every tier."""
        self.saving = False
        try:
            self.cache.tree.evict(self.cache.tree.num_pages)
        finally:
            self.saving = True
        self.index.clear()
        self.ops.append(KVFlush())

    def take_ops(self) -> list:
        ops, self.ops = self.ops, []
        return ops

    # -- accounting ----------------------------------------------------------------

    def holders(self) -> list[int]:
        return [p for load in self.loads.values() for p in load.pages]

    def check_integrity(self) -> None:
        tree_pages = set(self.cache.tree.pages())
        assert set(self.page_key) == tree_pages, "page keys differ from the tree's pages"
        assert self.loading_pages == sum(len(x.pages) for x in self.loads.values()), "loading pages drifted"
