"""The scheduler core with a stub worker (tests/engine.py StubEngine): admission counted
in steps, aging, per-row worker errors, tenants' salts, the cache manager's reads.

No model runs, so every assertion is about what the core planned and what it holds:
which batch admitted which request, which pages are held by whom (the pool's
refcounts, checked against every holder by `check_integrity` after every step)."""
from __future__ import annotations

import time

import pytest

from engine import StubEngine
from ferroxmp.protocol import Stats, TokenOut, decode, encode, unpack_ids
from ferroxmp.scheduler.request import State

PREFIX = list(range(100, 164))  # 64 tokens: 16 pages of 4


@pytest.fixture
def stub():
    made: list[StubEngine] = []

    def make(**kw) -> StubEngine:
        eng = StubEngine(**kw)
        made.append(eng)
        return eng

    yield make
    for eng in made:
        eng.close()


def warm(eng: StubEngine, prompt: list[int], salt: str = "") -> None:
    eng.submit(prompt, 1, cache_salt=salt)
    eng.run_to_idle()


def cached(eng: StubEngine, rid: str) -> int:
    return eng.outs[rid][-1].cached_tokens


def test_a_warm_burst_is_admitted_in_one_step(stub):
    """32 requests share a prefix the tree holds: all are admitted by the first batch.
    The old rule deferred every request whose first pages equalled a prefilling row's,
    so a warm burst went in one request per step."""
    eng = stub(num_pages=512, max_batch_tokens=256, max_rows=40)
    warm(eng, PREFIX + [5])
    rids = [eng.submit(PREFIX + [200 + i, 300 + i, 400 + i], 4) for i in range(32)]
    batch = eng.build()
    assert len(batch.new_rows) == 32, f"only {len(batch.new_rows)} of a warm burst of 32 admitted at once"
    assert all(eng.request(r).cached_tokens == 64 for r in rids)
    eng.run_to_idle()
    assert all(eng.finish_reason(r) == "length" for r in rids)


def test_a_cold_burst_waits_for_the_shared_prefix_then_is_admitted_at_once(stub):
    """Nothing cached: the first request computes the shared prefix and the others wait
    for it (computing it beside it would do the work 8 times); once it is published,
    the seven are admitted in one step, each adopting all 64 tokens."""
    eng = stub(num_pages=512, max_batch_tokens=32, max_rows=16)
    first = eng.submit(PREFIX + [1, 2, 3], 4)
    rids = [eng.submit(PREFIX + [200 + i, 300 + i, 400 + i], 4) for i in range(7)]
    while not all(eng.request(r).state != State.WAITING for r in rids):
        assert eng.step()
    waits = [eng.request(r).admitted_at for r in rids]
    assert eng.request(first).computed >= 64
    assert all(eng.request(r).cached_tokens == 64 for r in rids), [eng.request(r).cached_tokens for r in rids]
    assert len(set(waits)) == 1, "the seven sharing a published prefix must be admitted in one step"
    eng.run_to_idle()
    assert eng.core.totals.prompt_tokens - eng.core.totals.cached_prompt_tokens == 67 + 7 * 3


def test_an_aged_request_waiting_for_a_prefix_is_not_passed_by_a_younger_one(stub):
    """An aged request whose prefix a row is prefilling waits for it; a younger request
    that fits must not be admitted past it meanwhile (the old `continue` let it)."""
    eng = stub(num_pages=512, max_batch_tokens=16, max_rows=8)
    eng.submit(PREFIX + [1], 2)
    eng.build()  # its first chunk: the prefix is being computed
    aged = eng.submit(PREFIX + [9, 9, 9], 2, age=10.0)
    young = eng.submit(list(range(500, 520)), 2)
    eng.build()
    assert eng.request(aged).state == State.WAITING, "the aged request must wait for the prefix"
    assert eng.request(young).state == State.WAITING, "a younger request passed an aged one"
    eng.run_to_idle()
    assert cached(eng, aged) == 64, "the aged request must adopt the prefix it waited for"
    assert eng.finish_reason(aged) == eng.finish_reason(young) == "length"


def test_an_aged_request_that_does_not_fit_blocks_younger_ones(stub):
    """While an aged request cannot get its pages, nothing younger is admitted, so
    running rows drain until it fits: it is never starved by small requests."""
    eng = stub(num_pages=40, max_batch_tokens=128, max_rows=8)
    hog = eng.submit(list(range(5, 105)), 20)  # 25 pages, 30 with its output
    while eng.request(hog).state != State.DECODING:
        eng.step()
    big = eng.submit(list(range(200, 260)), 4, age=10.0)  # 15 pages: not beside the hog
    small = eng.submit(list(range(300, 310)), 4)          # 3 pages: would fit
    while eng.request(big).state == State.WAITING:
        assert eng.request(small).state == State.WAITING, "a younger request passed an aged one"
        assert eng.step()
    eng.run_to_idle()
    assert [eng.finish_reason(r) for r in (hog, big, small)] == ["length"] * 3


def test_a_row_the_worker_could_not_compute_fails_alone_and_releases_once(stub):
    """Batch 0 reports row_errors for one row while batch 1, which also names it, is
    in flight. That request ends with finish_reason "error" and status 500; its pages
    stay held until batch 1 reports (the worker may still read them), then return
    once; the other rows run to their length."""
    eng = stub(num_pages=64, max_batch_tokens=64)
    a, b, c = (eng.submit(list(range(k, k + 10)), 6) for k in (10, 30, 50))
    b0, b1 = eng.build(), eng.build()
    row_b = eng.request(b).row
    pages_b = list(eng.request(b).cache.pages)
    assert any(s.row == row_b for s in b1.steps), "the test needs the failing row in both batches"
    eng.report(eng.answer(b0, row_errors={row_b: "injected failure"}))
    out = eng.outs[b][-1]
    assert (out.finish_reason, out.status) == ("error", 500) and "injected failure" in out.error
    assert unpack_ids(out.token_ids).size == 0
    assert row_b in eng.core.live and all(eng.pool.refs[p] >= 1 for p in pages_b), \
        "pages released while batch 1 may still read them"
    eng.report(eng.answer(b1, row_errors={row_b: "unknown row"}))
    assert row_b not in eng.core.live and all(eng.pool.refs[p] == 0 for p in pages_b)
    later = [eng.build()]
    assert all(s.row != row_b for s in later[0].steps), "a failed row was stepped again"
    eng.run_to_idle()
    assert [eng.finish_reason(r) for r in (a, c)] == ["length", "length"]
    assert [sum(unpack_ids(o.token_ids).size for o in eng.outs[r]) for r in (a, c)] == [6, 6]
    assert len(eng.outs[b]) == 1, "the failed request got more than its one final RowOut"


def test_a_batch_the_worker_refused_ends_only_its_own_rows(stub):
    """A whole-batch error ends the rows of that batch; a request admitted in the next
    batch (planned while the failed one was in flight) completes."""
    eng = stub(num_pages=64, max_batch_tokens=64)
    a = eng.submit(list(range(10, 20)), 6)
    b0 = eng.build()
    d = eng.submit(list(range(40, 50)), 6)
    b1 = eng.build()
    assert [nr.row for nr in b1.new_rows] == [eng.request(d).row]
    eng.report(eng.answer(b0, error="worker failed: injected"))
    assert eng.finish_reason(a) == "error" and eng.outs[a][-1].status == 500
    eng.report(eng.answer(b1))
    eng.run_to_idle()
    assert eng.finish_reason(d) == "length"
    assert sum(unpack_ids(o.token_ids).size for o in eng.outs[d]) == 6


def test_a_prefix_is_shared_only_between_requests_with_the_same_salt(stub):
    """Tenant isolation: the same prompt under another salt adopts nothing (0 cached
    tokens); under the same salt it hits."""
    eng = stub(num_pages=256)
    warm(eng, PREFIX + [5], salt="tenant-a")
    other = eng.submit(PREFIX + [6], 2, cache_salt="tenant-b")
    eng.run_to_idle()
    unsalted = eng.submit(PREFIX + [6], 2)
    eng.run_to_idle()
    same = eng.submit(PREFIX + [7], 2, cache_salt="tenant-a")
    eng.run_to_idle()
    assert cached(eng, other) == 0, "another tenant's prefix was matched"
    assert cached(eng, unsalted) == 0, "a salted prefix was matched without the salt"
    assert cached(eng, same) == 64, "the same tenant must hit its own prefix"


def test_matching_changes_nothing_and_is_remembered_until_the_tree_changes(stub):
    """Admission scores waiting requests every step: a match must not touch LRU order or
    split nodes (a read that writes), and must not walk the tree again while neither
    the tree nor the request changed."""
    eng = stub(num_pages=256, max_rows=1)
    warm(eng, PREFIX + [5])
    cache, tree = eng.core.cache, eng.core.cache.tree
    hog = eng.submit(list(range(600, 700)), 50)
    eng.step()
    rid = eng.submit(PREFIX[:30] + [1, 2, 3], 2)  # ends inside a node: a real match would split it
    req = eng.request(rid)
    walks = []
    peek = tree.peek
    tree.peek = lambda *a, **k: walks.append(1) or peek(*a, **k)
    before = (tree._clock, tree._num_nodes, tree.version, [n.last_access for n in tree._nodes()])
    assert cache.match(req) == 28 and cache.match(req) == 28
    assert (tree._clock, tree._num_nodes, tree.version, [n.last_access for n in tree._nodes()]) == before
    assert len(walks) == 1, "a remembered match walked the tree again"
    pages = eng.pool.alloc(2)
    tree.insert(list(range(900, 908)), pages)  # the tree changes: the memo is stale
    eng.pool.release(pages)
    assert cache.match(req) == 28 and len(walks) == 2
    del tree.peek
    eng.core.abort(hog)
    eng.run_to_idle()


def test_stats_are_plain_counters_that_cross_the_wire(stub):
    """The heartbeat's Stats must encode (a numpy integer in a counter killed the
    scheduler process) and add up: free + in use + cached only by the tree == total."""
    eng = stub(num_pages=128)
    warm(eng, PREFIX + [5])
    eng.submit(PREFIX + [6, 7], 8)
    eng.step()
    for _ in range(3):
        s = decode(encode(TokenOut([], eng.core.stats()))).stats
        assert isinstance(s, Stats) and s.running == 1
        assert s.pages_free + s.pages_in_use + s.pages_cached == s.pages_total == 128
        assert s.pages_in_use == len(eng.request("req-1").cache.pages)
        eng.step()


class _NoBulk(dict):
    """The core's in-flight map, with every batch's bulk pass refused."""

    def pop(self, *a):
        batch = super().pop(*a)
        if batch is not None:
            batch.decode_tokens = lambda res: None
        return batch


def _drive(reverse: bool, seed: int) -> dict:
    """The real core and a stub worker that answers each sampling step with a token
    derived from (row, position); with `reverse`, the result lists the sampled rows in
    reverse step order and the bulk pass is off (a result of one row is in order
    either way), so the core applies every row one by one. Requests mix stop ids,
    an EOS (one ignores it), max_tokens, overlap, an abort mid-flight and a pool small
    enough to retract. Returns every rid's RowOuts as (tokens, finish_reason, status)."""
    import random

    import numpy as np

    from ferroxmp.protocol import BatchResult, GenerateReq, SamplingParams, pack_ids
    from ferroxmp.page_pool import PagePool
    from ferroxmp.scheduler import core as core_module
    from ferroxmp.scheduler.core import SchedulerConfig, SchedulerCore
    from ferroxmp.scheduler.results import apply_decode

    rng = random.Random(seed)
    pool = PagePool.create(26, 6, 32)
    core = SchedulerCore(pool, SchedulerConfig(page_size=4, max_batch_tokens=24, max_model_len=128,
                                               vocab_size=1000, eos_token_ids=(9,)))
    try:
        for i in range(10):
            params = SamplingParams(max_tokens=rng.randint(1, 60), temperature=0.0,
                                    stop_token_ids=rng.sample(range(5, 60), rng.randint(0, 2)),
                                    ignore_eos=i % 3 == 0)
            prompt = [rng.randint(5, 900) for _ in range(rng.randint(1, 20))]
            assert core.add_request(GenerateReq(f"r{i}", pack_ids(prompt), params, float(i)), float(i)) is None
        outs: dict[str, list] = {}
        queue: list = []
        bulk_passes = []
        core_module.apply_decode = lambda *a: bulk_passes.append(1) or apply_decode(*a)
        if reverse:
            core.inflight = _NoBulk()
        for turn in range(400):
            while len(queue) < 2 and (batch := core.build_batch(100.0)) is not None:
                queue.append(batch)
            if not queue:
                break
            batch = queue.pop(0)
            sampled = [(s.row, (s.row * 31 + s.start * 7) % 60 + 5) for s in batch.steps if s.sample]
            if reverse:
                sampled.reverse()
            core.process_result(BatchResult(batch.batch_id, rows=pack_ids([r for r, _ in sampled]),
                                            tokens=pack_ids([t for _, t in sampled])), 100.0)
            if turn == 7:
                core.abort(max(core.requests.values(), key=lambda r: r.params.max_tokens).rid)
            for o in core.take_outputs():
                outs.setdefault(o.rid, []).append((np.frombuffer(o.token_ids, "<i4").tolist(),
                                                   o.finish_reason, o.status))
            core.check_integrity()
        assert core.idle, "the stub run did not drain"
        return {"outs": outs, "retractions": core.totals.retractions, "bulk": len(bulk_passes)}
    finally:
        core_module.apply_decode = apply_decode
        pool.close()
        pool.unlink()


@pytest.mark.parametrize("seed", range(6))
def test_decode_rows_applied_in_bulk_end_exactly_as_when_applied_one_by_one(seed):
    """A result normally lists its decode rows first and in step order, and the core
    applies them in one pass; a result in any other order goes row by row. Both must
    give every request the same tokens, stops (stop ids, EOS unless ignored, length),
    abort and retractions: a bulk pass that misassigned a token, missed a stop or a
    release would differ here (and check_integrity runs after every result)."""
    bulk, one_by_one = _drive(False, seed), _drive(True, seed)
    assert bulk.pop("bulk") > 0 and one_by_one.pop("bulk") == 0, "the two runs did not take the two paths"
    assert bulk == one_by_one
    reasons = {o[-1][1] for o in bulk["outs"].values()}
    assert {"length", "stop", "abort"} <= reasons and len(bulk["outs"]) == 10


def test_a_waiting_request_expires_at_the_first_check_past_its_timeout_and_not_before(stub):
    """`expire` runs every loop turn and skips its scan until the oldest waiting request
    can have expired: each request must still get its 503 at the first check after
    arrival + --queue-timeout (a stale bound would skip it), and not one check earlier."""
    import time

    eng = stub(num_pages=256, max_rows=1)
    eng.core.cfg.queue_timeout = 10.0
    hog = eng.submit(list(range(10, 20)), 200)
    eng.step()
    t0 = time.time()
    young = eng.submit(list(range(30, 40)), 2)
    old = eng.submit(list(range(50, 60)), 2, age=5.0)  # arrived 5 s before young
    for at, refused in ((t0 + 4.0, set()), (t0 + 5.5, {old}), (t0 + 9.0, {old}), (t0 + 10.5, {old, young})):
        eng.core.expire(at)
        eng.collect()
        got = {r for r in (old, young) if r in eng.outs}
        assert got == refused, f"at +{at - t0:.1f}s refused {got}, expected {refused}"
    assert all(eng.outs[r][-1].status == 503 for r in (old, young))
    late = eng.submit(list(range(70, 80)), 2, age=20.0)  # already past its timeout on arrival
    eng.core.expire(t0 + 10.6)
    eng.collect()
    assert eng.outs[late][-1].status == 503, "a request added after a scan was not checked"
    eng.core.abort(hog)
    eng.run_to_idle()


def test_a_request_counts_travel_with_its_first_tokens_and_its_last_row_out(stub):
    """Decode RowOuts carry only the new token; the frontend takes usage and queue time
    from the first RowOut with tokens and the last one, so those must carry them."""
    eng = stub(num_pages=256)
    warm(eng, PREFIX + [5])
    rid = eng.submit(PREFIX + [6, 7, 8], 6)
    eng.run_to_idle()
    outs = [o for o in eng.outs[rid] if o.token_ids or o.finish_reason]
    assert sum(unpack_ids(o.token_ids).size for o in outs) == 6 and len(outs) >= 3
    for o in (outs[0], outs[-1]):
        assert (o.prompt_tokens, o.cached_tokens) == (67, 64) and o.queue_time > 0
    assert outs[-1].finish_reason == "length"
    assert all((o.prompt_tokens, o.cached_tokens, o.queue_time) == (0, 0, 0.0) for o in outs[1:-1])


def test_a_request_that_cannot_fit_walks_no_tree_leaves_step_after_step(stub):
    """The tree counts the pages a prefilling row has published as evictable, but the
    row still holds them: eviction can free none. Admission must see that from the
    counters and not walk the tree's leaves for every waiting request each step (the
    walk cost ~1 ms per candidate with a long queue); the request is admitted once
    the hog is done, and nothing is lost."""
    eng = stub(num_pages=64, max_batch_tokens=8, max_rows=4)
    hog = eng.submit(list(range(10, 170)), 4)  # 160 tokens: 40 pages, published 2 per step
    for _ in range(6):
        eng.step()
    tree = eng.core.cache.tree
    assert tree.evictable_pages > 0 and eng.core.cache.pages_cached == 0, "the test needs row-held tree pages"
    big = eng.submit(list(range(300, 420)), 2)  # 30 pages: more than free, unless eviction could help
    assert eng.pool.free_count < 30 <= eng.pool.free_count + tree.evictable_pages
    walks = []
    evict = tree.evict
    tree.evict = lambda n: walks.append(n) or evict(n)
    while eng.request(hog) is not None and eng.request(hog).state != State.FINISHED:
        eng.step()
        assert eng.request(big).state == State.WAITING
    assert walks == [], f"eviction walked the tree {len(walks)} times though it could free nothing"
    eng.run_to_idle()
    assert eng.finish_reason(hog) == eng.finish_reason(big) == "length"


def test_with_no_page_to_spare_the_queue_is_not_scored(stub):
    """Every admission needs a fresh page beyond the decode rows' reserve; while the
    pool has none, admission must not match waiting requests against the tree at all
    (rows are free, so only the pages can tell). Once the hog ends, the queue goes in."""
    eng = stub(num_pages=16, max_rows=4, max_batch_tokens=64)
    hog = eng.submit(list(range(10, 70)), 4)  # 60 + 4 tokens: all 16 pages by its end
    eng.step()
    waiting = [eng.submit(list(range(100 + 20 * i, 110 + 20 * i)), 2) for i in range(3)]
    cache = eng.core.cache
    matches = []
    match = cache.match
    cache.match = lambda req: matches.append(req.rid) or match(req)
    while eng.request(hog) is not None and eng.request(hog).state != State.FINISHED:
        assert cache.available_pages <= 1, "the test needs a pool with nothing to spare"
        eng.step()
        assert all(eng.request(r).state == State.WAITING for r in waiting)
    assert matches == [], f"the queue was scored {len(matches)} times with no page to spare"
    del cache.match
    eng.run_to_idle()
    assert all(eng.finish_reason(r) == "length" for r in [hog] + waiting)


def _snapshot(eng: StubEngine) -> tuple:
    """Everything planning could change: the pool's three arrays, the tree, row slots and
    handles, and every field of every request (its ids by value)."""
    import dataclasses
    core, cache = eng.core, eng.core.cache
    reqs = []
    for r in sorted(core.requests.values(), key=lambda r: r.rid):
        fields = tuple((f.name, getattr(r, f.name)) for f in dataclasses.fields(r)
                       if f.name not in ("ids", "prompt", "pending_logprobs", "pending_prompt_logprobs"))
        reqs.append((fields, r.tokens.tobytes(), len(r.pending_logprobs)))
    handles = {row: (list(h.pages), h.adopted, h.published, id(h.lock)) for row, h in cache.handles.items()}
    tree = (cache.tree.version, cache.tree.num_pages, cache.tree.evictable_pages)
    return (eng.pool.refs.tobytes(), eng.pool.page_table.tobytes(), eng.pool.row_lens.tobytes(), tree,
            list(cache.free_rows), handles, [r.rid for r in core.waiting], reqs)


def test_planning_is_pure_and_the_plan_is_what_commit_applies(stub):
    """Pins: a planner that admits, allocates, evicts or writes a request while planning
    (issue 27). Under pressure — a pool too small for the load, so plans retract,
    evict cached prefixes and defer admissions — planning twice from the same state must
    change nothing and give the same plan; committing it is what moves the state. The
    pressure is checked too, or the test would prove purity of an idle planner only."""
    from ferroxmp.scheduler.batch import plan_batch
    eng = stub(num_pages=40, page_size=4, max_batch_tokens=24, max_rows=6)
    for i in range(4):
        warm(eng, PREFIX[:24] + [i])  # cached prefixes that admissions evict
    for i in range(10):
        eng.submit(PREFIX[:20] + [200 + i] * (i % 4), max_tokens=40 + i)
    core, seen = eng.core, {"retract": 0, "admit": 0, "grow": 0}
    for _ in range(2000):
        if core.idle and not eng.queue:
            break
        while len(eng.queue) < 2:
            now = time.time()
            before = _snapshot(eng)
            args = (core.waiting, core.live.values(), core.cache, core.cfg.max_batch_tokens, now,
                    core.cfg.aging_s, core.step_budget.prefill_allowance)
            plan = plan_batch(*args)
            assert _snapshot(eng) == before, "planning changed the scheduler's state"
            again = plan_batch(*args)
            key = lambda p: ([r.rid for r in p.decode], [r.rid for r in p.grow], [(r.rid, n, s) for r, n, s in p.steps],
                             [(a.req.rid, a.chunk, a.blocking) for a in p.admit], [r.rid for r in p.retract])
            assert key(again) == key(plan), "the same state planned twice gave two plans"
            seen["retract"] += len(plan.retract)
            seen["admit"] += len(plan.admit)
            seen["grow"] += len(plan.grow)
            batch = core.commit(plan, now)
            core.check_integrity()
            if batch is None:
                break
            eng.queue.append(batch)
        if eng.queue:
            eng.report(eng.answer(eng.queue[0]))
    assert core.idle, "the load did not drain"
    assert seen["retract"] and seen["admit"] >= 10 and seen["grow"], seen


@pytest.mark.parametrize("rows,cap,want", [(1, 16, 8), (2, 16, 7), (4, 16, 3), (8, 16, 1), (9, 16, 0),
                                           (16, 16, 0), (16, None, 8)])
def test_drafts_share_the_workers_step_cap_evenly(stub, rows, cap, want):
    """--num-speculative-tokens 8: each decode row may draft up to 8, but where the worker
    caps a step's verified tokens (CPU: 16, past which a draft costs what a decoded token
    does) the rows share what the cap leaves above their own token: 16 rows draft
    nothing there; without a cap every row keeps its 8."""
    eng = stub(num_pages=512, max_rows=16, spec_tokens=8, spec_step_tokens=cap)
    rids = [eng.submit([1, 2, 3, 10 + i], 40) for i in range(rows)]
    while any(eng.request(r).state is not State.DECODING for r in rids):
        assert eng.step()
    batch = eng.build()
    assert sorted(s.row for s in batch.steps) == sorted(eng.request(r).cache.row for r in rids)
    assert batch.spec == ({eng.request(r).cache.row: want for r in rids} if want else {}), batch.spec
    eng.core.check_integrity()
