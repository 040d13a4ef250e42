"""Random admit / chunk / finish / abort / evict / row-failure sequences, under two
tenants' salts, through the REAL scheduler core (and its cache manager) and model
runner, with the page-accounting invariant checked after every step.

Hypothesis drives the interleaving (overlap on, so aborts land on rows with a
batch in flight); `LocalEngine.step` runs `check_integrity` after each batch: every
page's refcount equals its holders (tree + rows), the free list is exactly the
pages with refcount 0, every row slot is free or held by one live request. At the
end, idle, `free + held_only_by_tree == total`.
"""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from engine import LocalEngine
from ferroxmp.scheduler.request import State

PREFIXES = [[11, 12, 13, 14, 15, 16, 17, 18], [21, 22, 23, 24], []]


@pytest.fixture(scope="module")
def model(tiny_models):
    return tiny_models["llama"]


def test_random_lifecycles_keep_every_page_accounted_for(model):
    class Lifecycle(RuleBasedStateMachine):
        @initialize(overlap=st.booleans(), pages=st.sampled_from([12, 24, 64]))
        def start(self, overlap, pages):
            self.eng = LocalEngine(model, num_pages=pages, page_size=4, max_batch_tokens=6,
                                   max_rows=4, overlap=overlap, max_model_len=48)
            self.rids: list[str] = []

        @rule(prefix=st.sampled_from(PREFIXES), tail=st.lists(st.integers(5, 900), min_size=1, max_size=12),
              max_tokens=st.integers(1, 8), salt=st.sampled_from(["", "tenant-b"]))
        def submit(self, prefix, tail, max_tokens, salt):
            self.rids.append(self.eng.submit(prefix + tail, max_tokens, cache_salt=salt))

        @rule()
        def a_row_fails_in_the_worker(self):
            self.eng.fail_next_row = True  # its request ends with an error; the rest go on

        @precondition(lambda self: self.rids)
        @rule(i=st.integers(0, 1000), twice=st.booleans())
        def abort(self, i, twice):
            rid = self.rids[i % len(self.rids)]
            for _ in range(2 if twice else 1):
                self.eng.core.abort(rid)
            self.eng.core.take_outputs()  # the engine records finals on the next step
            self.eng.core.check_integrity()

        @rule(n=st.integers(1, 4))
        def step(self, n):
            for _ in range(n):
                self.eng.step()

        @rule(n=st.integers(1, 8))
        def evict(self, n):
            self.eng.core.cache.evict(n)
            self.eng.core.check_integrity()

        @invariant()
        def accounted(self):
            if hasattr(self, "eng"):
                self.eng.core.check_integrity()

        def teardown(self):
            if not hasattr(self, "eng"):
                return
            try:
                for rid in list(self.eng.core.requests):
                    self.eng.core.abort(rid)
                self.eng.run_to_idle(max_steps=200)
                core = self.eng.core
                assert core.idle and not core.live
                assert self.eng.pool.free_count + core.cache.tree.num_pages == self.eng.pool.num_pages
                assert all(r.state == State.FINISHED for r in core.requests.values())
            finally:
                self.eng.close()

    Lifecycle.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None,
                                           suppress_health_check=list(HealthCheck))
    Lifecycle.TestCase().runTest()
