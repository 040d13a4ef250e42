"""Admission policy through the real scheduler core: cache-aware order, aging, and a
head of the queue that cannot fit yet does not block requests that can."""
from __future__ import annotations

import pytest

from engine import LocalEngine
from ferroxmp.scheduler.request import State


@pytest.fixture
def engine(tiny_models):
    made = []

    def make(**kw) -> LocalEngine:
        eng = LocalEngine(tiny_models["llama"], page_size=4, **kw)
        made.append(eng)
        return eng

    yield make
    for e in made:
        e.close()


def test_a_head_that_cannot_fit_yet_does_not_block_smaller_requests(engine):
    """A hog holds most of the pool; the next request needs more than is left and
    waits; a small one behind it must be admitted and finish meanwhile. When the
    hog finishes, the big one runs too: nobody is lost."""
    eng = engine(num_pages=40, max_batch_tokens=64, max_rows=4)
    hog = eng.submit(list(range(5, 105)), 30, ignore_eos=True)            # 26+ pages
    eng.run_until(lambda: eng.request(hog).state == State.DECODING)
    big = eng.submit(list(range(200, 260)), 10, ignore_eos=True)         # 15+ pages: must wait
    small = eng.submit(list(range(300, 310)), 4, ignore_eos=True)        # 4 pages: fits now
    eng.run_until(lambda: small in eng.finish)
    assert hog not in eng.finish, "the test needs the hog still running when the small one finishes"
    assert eng.request(big).state == State.WAITING, "big should not have fit beside the hog"
    eng.run_to_idle()
    assert [eng.finish[r] for r in (hog, big, small)] == ["length"] * 3


def test_admission_prefers_the_longest_cached_prefix(engine):
    """Two waiting requests, admitted one at a time (one row free): the one whose
    prefix is in the tree goes first even though it arrived second."""
    eng = engine(num_pages=128, max_batch_tokens=256, max_rows=1)
    shared = list(range(5, 69))
    eng.generate(shared + [1], 2)                       # publishes 64 tokens
    cold = eng.submit(list(range(400, 470)), 2)
    warm = eng.submit(shared + [7, 8], 2)
    eng.build()
    admitted = [r for r in eng.core.live.values()]
    assert [r.rid for r in admitted] == [warm], "the cache hit should be admitted first"
    eng.run_to_idle()
    assert cold in eng.finish and warm in eng.finish


def test_an_aged_request_is_admitted_before_newer_cache_hits(engine):
    """Aging bounds what cache-awareness costs: past the bound, arrival order wins."""
    eng = engine(num_pages=128, max_batch_tokens=256, max_rows=1)
    shared = list(range(5, 69))
    eng.generate(shared + [1], 2)
    cold = eng.submit(list(range(400, 470)), 2)
    warm = eng.submit(shared + [7, 8], 2)
    eng.request(cold).arrival -= eng.core.cfg.aging_s + 1
    eng.build()
    assert [r.rid for r in eng.core.live.values()] == [cold]
    eng.run_to_idle()
    assert cold in eng.finish and warm in eng.finish


def test_requests_arriving_together_with_one_prefix_compute_it_once(engine):
    """A burst sharing a system prompt: the first computes the prefix; the others
    wait for it to be published and adopt it, rather than all prefilling it side by
    side (where nothing is in the tree yet for anyone to adopt)."""
    eng = engine(num_pages=256, max_batch_tokens=32, max_rows=8)
    system = list(range(5, 105))
    rids = [eng.submit(system + [200 + i, 300 + i], 4, ignore_eos=True) for i in range(4)]
    reqs = [eng.request(r) for r in rids]
    eng.run_to_idle()
    cached = sorted(r.cached_tokens for r in reqs)
    assert cached[0] == 0 and all(c >= 100 // 4 * 4 for c in cached[1:]), cached
    assert eng.core.totals.prompt_tokens - eng.core.totals.cached_prompt_tokens <= 102 + 3 * 4


def test_a_warm_burst_is_admitted_in_one_step_and_answers_as_each_alone(engine):
    """Six requests share a 64-token prefix the tree holds: one batch admits all six
    (counted in steps: the old rule took one per step), each adopts the prefix, and
    each answers exactly what it answers alone on a server without a prefix cache."""
    eng = engine(num_pages=256, max_batch_tokens=128, max_rows=8)
    shared = list(range(5, 69))
    eng.generate(shared + [1], 2)  # publishes the prefix
    tails = [[200 + i, 300 + i] for i in range(6)]
    rids = [eng.submit(shared + t, 4, ignore_eos=True) for t in tails]
    batch = eng.build()
    assert len(batch.new_rows) == 6, f"{len(batch.new_rows)} of a warm burst of 6 admitted in one step"
    assert all(eng.request(r).cached_tokens == 64 for r in rids)
    eng.run_to_idle()
    cold = engine(num_pages=256, max_batch_tokens=128, max_rows=8, radix=False)
    for rid, tail in zip(rids, tails):
        assert eng.outputs[rid] == cold.generate(shared + tail, 4, ignore_eos=True), rid
