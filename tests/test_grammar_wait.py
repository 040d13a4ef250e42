"""The scheduler's grammar-pending state, in process (SchedulerCore, no worker).

Oracle: the protocol's contract. A constrained request is never planned before its
GrammarReady; exactly one PrepareGrammar goes out per request; a failed or overdue
compile is one 400 naming why and leaves nothing behind (check_integrity); an abort
while pending ends the request once, and the late GrammarReady changes nothing.
"""
from __future__ import annotations

import pytest

from ferroxmp.protocol import GenerateReq, Grammar, GrammarReady, SamplingParams, pack_ids
from ferroxmp.page_pool import PagePool
from ferroxmp.scheduler.core import SchedulerConfig, SchedulerCore

G = Grammar("regex", "[ab]+")


@pytest.fixture
def core():
    pool = PagePool.create(32, 4, 16)
    c = SchedulerCore(pool, SchedulerConfig(page_size=4, max_batch_tokens=32, max_model_len=64, vocab_size=100,
                                            eos_token_ids=(1,), max_grammar_compile_seconds=2.0))
    yield c
    pool.close()
    pool.unlink()


def add(core, rid, grammar=G, now=0.0):
    params = SamplingParams(max_tokens=4, temperature=0.0, grammar=grammar)
    assert core.add_request(GenerateReq(rid, pack_ids([5, 6, 7]), params, now), now) is None


def planned(batch):
    return [] if batch is None else [s.row for s in batch.steps]


def test_a_constrained_request_is_planned_only_after_its_grammar_is_ready(core):
    """Planning it first would make the worker compile inside its batch loop."""
    add(core, "g")
    add(core, "plain", grammar=None)
    preps = core.grammars.take_prepares()
    assert [p.rid for p in preps] == ["g"] and preps[0].grammar == G
    first = core.build_batch(0.1)
    assert [nr.params.grammar for nr in first.new_rows] == [None]  # only the plain request
    assert core.stats().grammar_pending == 1
    core.grammar_ready(GrammarReady("g", compile_s=0.02))
    second = core.build_batch(0.2)
    assert [nr.params.grammar for nr in second.new_rows] == [G]
    assert core.grammars.take_prepares() == []
    s = core.stats()
    assert (s.grammar_pending, s.grammar_cache_misses, sum(s.grammar_compile_counts)) == (0, 1, 1)
    core.check_integrity()


def test_a_failed_or_overdue_compile_is_one_400_naming_why(core):
    add(core, "bad")
    add(core, "slow", now=0.5)
    core.grammar_ready(GrammarReady("bad", error="Unimplemented keys: [\"uniqueItems\"]", compile_s=0.001))
    core.expire(1.0)  # slow: not yet overdue
    core.expire(2.6)
    outs = {o.rid: o for o in core.take_outputs()}
    assert outs["bad"].status == 400 and "uniqueItems" in outs["bad"].error
    assert outs["slow"].status == 400 and "--max-grammar-compile-seconds" in outs["slow"].error
    assert core.build_batch(3.0) is None and core.idle
    core.grammar_ready(GrammarReady("slow", compile_s=2.9))  # late: counted, nothing else
    assert core.take_outputs() == [] and core.idle
    core.check_integrity()


def test_an_abort_while_pending_ends_the_request_once(core):
    add(core, "a")
    assert core.refusal(GenerateReq("a", pack_ids([5]), SamplingParams()), 1) is not None  # id in use
    core.abort("a")
    outs = core.take_outputs()
    assert [(o.rid, o.finish_reason) for o in outs] == [("a", "abort")]
    core.grammar_ready(GrammarReady("a", cached=True))
    assert core.take_outputs() == [] and core.build_batch(1.0) is None and core.idle
    assert core.stats().grammar_cache_hits == 1
    core.check_integrity()


def test_an_in_process_engine_compiles_and_serves_a_constrained_request(tiny_models):
    """tests/engine.py answers the core's PrepareGrammar inline (grammar_prep.prepare):
    without it a constrained request would stay pending forever in process."""
    import re

    from engine import LocalEngine
    from ferroxmp.frontend.text.tokenizer import TextCodec
    eng = LocalEngine(tiny_models["llama"])
    try:
        rid = eng.submit([5, 6, 7], max_tokens=20, temperature=1.0, seed=4, grammar=Grammar("regex", "(cat|dog)-[0-9]"))
        for _ in range(100):
            if not eng.step():
                break
        eos = set(eng.runner.config.eos_token_ids)
        text = TextCodec(tiny_models["llama"]).decode([t for t in eng.outputs[rid] if t not in eos])
        assert eng.finish[rid] == "stop" and re.fullmatch(r"(cat|dog)-[0-9]", text), (eng.finish, text)
    finally:
        eng.close()
