"""Python twins of ferrox-server 0.15.3's radix contract tests (shared/seed).

The thing under test is the CONTRACT between a finished row and the tree:
publish what you computed, adopt what someone else did, give pages back when
the pool runs dry. Every test drives the REAL path — `SchedulerCore` admission
(which consults the tree) → chunked prefill through the real `ModelRunner` →
the prefill-to-decode handover → finish — because the seed's bug lived in the
handover, where a test that built a row by hand would prove nothing.
"""
from __future__ import annotations

import pytest
import torch

from engine import LocalEngine
from ferroxmp.scheduler.request import State

BLOCK = 4
PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]


# The contract holds whatever sits below the pool (issue 28): each twin runs with the
# pool alone, with a host-memory tier, and with a disk tier under it.
TIERS = {"pool": {}, "host tier": {"kv_host_bytes": 1 << 20}, "disk tier": {"kv_dir": True}}


@pytest.fixture(params=list(TIERS))
def engine_factory(tiny_models, request, tmp_path):
    made: list[LocalEngine] = []
    tiers = dict(TIERS[request.param])
    if tiers.get("kv_dir"):
        tiers["kv_dir"] = str(tmp_path / "kv")

    def make(num_pages: int = 64, chunk: int = 1, **kw) -> LocalEngine:
        eng = LocalEngine(tiny_models["llama"], num_pages=num_pages, page_size=BLOCK,
                          max_batch_tokens=chunk, **tiers, **kw)
        made.append(eng)
        return eng

    yield make
    for eng in made:
        eng.close()


def admit_prefilled(eng: LocalEngine, prompt: list[int], max_tokens: int = 4) -> str:
    """Run one request through admission and every prefill chunk, up to the handover:
    its first token is sampled and it is decoding."""
    rid = eng.submit(prompt, max_tokens)
    eng.run_until(lambda: (r := eng.request(rid)) is not None and r.state == State.DECODING
                  and r.computed >= len(prompt) and len(r.output) >= 1)
    return rid


def finish_row(eng: LocalEngine, rid: str) -> None:
    """Finish through the one path every finished row takes (here: its length)."""
    eng.run_until(lambda: rid in eng.finish)
    eng.run_to_idle()


def published(eng: LocalEngine, prompt: list[int]) -> tuple[int, list[int]]:
    m = eng.core.cache.tree.match_prefix(prompt)
    return m.length, list(m.pages)


def test_a_finished_batched_row_publishes_its_prefix(engine_factory):
    """The tree must GROW by the whole page-aligned prefix. A test that only timed
    the second request would pass on a warm page cache."""
    eng = engine_factory()
    assert eng.core.cache.tree.total_size == 0, "the tree starts empty"
    rid = admit_prefilled(eng, PROMPT)
    finish_row(eng, rid)
    cached, pages = published(eng, PROMPT)
    assert cached == len(PROMPT), "a finished row must leave its whole prefix in the tree"
    assert len(pages) == len(PROMPT) // BLOCK


def test_a_second_batched_request_adopts_the_pages_the_first_published(engine_factory):
    """Page IDENTITY, not a hit count: while the second row lives, each adopted page
    has two holders — the tree and the row — which holds only if the row reads the
    first row's actual pages rather than fresh copies."""
    eng = engine_factory()
    finish_row(eng, admit_prefilled(eng, PROMPT))
    cached, pages = published(eng, PROMPT)
    assert cached == len(PROMPT), "the first row must have published"
    for p in pages:
        assert eng.pool.refs[p] == 1, "with no row alive, only the tree holds a published page"

    second = admit_prefilled(eng, PROMPT)
    req = eng.request(second)
    adopted = req.cached_tokens
    assert adopted > 0, f"the second request must adopt the first's prefix, got {adopted}"
    assert adopted < len(PROMPT), "never the whole prompt: one token must run for the logits"
    assert req.cache.pages[: adopted // BLOCK] == pages[: adopted // BLOCK]
    for p in pages[: adopted // BLOCK]:
        assert eng.pool.refs[p] == 2, "an adopted page is held by the tree AND the row"
    finish_row(eng, second)
    for p in pages:
        assert eng.pool.refs[p] == 1, "the row's hold goes back on finish; the tree's survives"


def test_a_batched_prefill_over_an_adopted_prefix_ends_exactly_at_the_prompt_length(engine_factory):
    """Issue #37: the warm prefill restarted at token 0 over the adopted prefix, so
    KV ended `prompt + cached` long with RoPE positions from 0. The row's length
    and the positions of its steps are where KV is written: they cannot be right by
    accident."""
    eng = engine_factory(chunk=3)
    finish_row(eng, admit_prefilled(eng, PROMPT))
    rid = eng.submit(PROMPT, 4)
    first = eng.build()
    req = eng.request(rid)
    step = first.steps[0]
    assert step.start == BLOCK, "the second request must start where the prefix it adopted ends"
    assert req.prefill_target - step.start == len(PROMPT) - BLOCK
    eng.run_until(lambda: len(req.output) >= 1)
    mine = [s for b in eng.batches[eng.batches.index(first):] for s in b.steps if s.row == req.row]
    starts, lengths = [s.start for s in mine], [s.length for s in mine]
    assert starts[:2] == [BLOCK, BLOCK + 3] and sum(lengths[:2]) == len(PROMPT) - BLOCK
    assert req.computed == len(PROMPT), f"a warm prefill left {req.computed} KV positions"
    assert int(eng.pool.row_lens[req.row]) >= len(PROMPT)
    eng.run_until(lambda: len(req.output) >= 2)
    decode_starts = [s.start for b in eng.batches[eng.batches.index(first):] for s in b.steps
                     if s.row == req.row and s.sample and s.start >= len(PROMPT)]
    assert decode_starts[0] == len(PROMPT), "the first generated token sits at the end of the prompt"
    finish_row(eng, rid)


@pytest.mark.parametrize("chunk", [4, 3])
def test_a_warm_batched_request_produces_the_same_logits_as_a_cold_one(engine_factory, chunk):
    """Issue #37's user-visible half: a cache hit changed the answer with a 200 OK.
    With chunk 4 the warm run's last chunk ([4, 8)) is the cold run's last chunk:
    the same kernel over the same page contents, so the bar is bit-identical. With
    chunk 3 the last chunks differ in length (2 vs 1 rows: CPU matmul picks another
    kernel at M=1), so the bar is float tolerance and the same greedy token."""
    eng = engine_factory(chunk=chunk)
    cold_rid = eng.submit(PROMPT, 1)
    eng.run_to_idle()
    assert eng.core.requests == {} and eng.finish[cold_rid] == "length"
    cold = eng.sample_logits[cold_rid][0]
    assert published(eng, PROMPT)[0] == len(PROMPT), "the cold run published its prefix"
    warm_rid = eng.submit(PROMPT, 1)
    warm_req = eng.request(warm_rid)
    eng.run_to_idle()
    assert warm_req.cached_tokens > 0, "this test proves nothing unless the warm request adopted"
    warm = eng.sample_logits[warm_rid][0]
    diff = (warm - cold).abs().max().item()
    if chunk == 4:
        assert torch.equal(warm, cold), f"a prefix-cache hit changed the logits (max |diff| {diff:g})"
    else:
        assert diff < 1e-5, f"a prefix-cache hit changed the logits by {diff:g}"
        assert warm.argmax() == cold.argmax()


def test_the_adopted_count_and_the_seeded_kv_positions_agree(engine_factory):
    """Two structures that must agree, walked against each other: the request's
    count of adopted tokens, the cursor the first step starts at, and the pages the
    row's page table lists for those positions (the tree's own pages)."""
    eng = engine_factory(chunk=8)
    finish_row(eng, admit_prefilled(eng, PROMPT))
    _, tree_pages = published(eng, PROMPT)
    rid = eng.submit(PROMPT, 4)
    batch = eng.build()
    req = eng.request(rid)
    claimed = req.cached_tokens
    assert claimed > 0, "the second request must adopt something"
    assert batch.steps[0].start == claimed, "the prefill cursor disagrees with the adopted count"
    listed = eng.pool.page_table[req.row, : claimed // BLOCK].tolist()
    assert listed == tree_pages[: claimed // BLOCK], "the page table does not list the adopted pages"
    finish_row(eng, rid)


def test_batched_publishing_does_not_starve_the_page_pool(engine_factory):
    """The pool holds 8 pages; each request needs 3 and leaves 2 in the tree, so a
    tree that is never evicted from starves the fourth request. Twelve run here."""
    eng = engine_factory(num_pages=8, chunk=8)
    assert eng.pool.free_count == 8
    for cycle in range(12):
        # Distinct at the first token: no cycle adopts another's prefix.
        prompt = [10 + cycle % 20, 1, 2, 3, 4, 5, 6, 7]
        rid = eng.submit(prompt, 4)
        assert rid not in eng.refusals, eng.refusals.get(rid)
        try:
            eng.run_until(lambda: rid in eng.finish, max_steps=50)
        except AssertionError:
            pytest.fail(f"cycle {cycle} was never admitted: the tree holds pages it will not give "
                        f"back (free = {eng.pool.free_count}, tree = {eng.core.cache.tree.num_pages})")
        eng.run_to_idle()
        assert eng.finish[rid] == "length"
    assert eng.pool.free_count > 0 or eng.core.cache.tree.evictable_pages > 0
    assert eng.core.cache.tree.num_pages > 0, "the tree keeps what it can: that is the point"
