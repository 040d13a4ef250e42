"""The scheduler as a process: real scheduler and worker over ZMQ, driven by a
client that speaks protocol.py (the frontend's side).

The oracle throughout is the same request run ALONE on the same server: batching,
chunking, retraction, overlap and aborts of others must never change a greedy
answer. Page accounting is read straight from the shared pool.
"""
from __future__ import annotations

import random

import numpy as np
import pytest

from procs import SchedulerClient


@pytest.fixture
def server(tiny_models):
    made: list[SchedulerClient] = []

    def start(shape: str = "llama", **flags) -> SchedulerClient:
        client = SchedulerClient(tiny_models[shape], **flags)
        made.append(client)
        return client

    yield start
    for c in made:
        c.close()


def prompts(n: int, seed: int = 0, lo: int = 1, hi: int = 120) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 900) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def assert_idle_accounting(client: SchedulerClient) -> None:
    stats = client.wait_idle_stats()
    assert stats.pages_free + stats.pages_cached == stats.pages_total, stats
    assert stats.pages_in_use == 0, stats
    pool = client.pool()
    try:
        assert (pool.row_lens == 0).all() and (pool.page_table == -1).all(), "a row slot is still held"
        assert int((pool.refs == 0).sum()) == stats.pages_free
    finally:
        pool.close()


def test_64_concurrent_requests_each_equal_their_solo_run(server):
    """Batching must not change anyone's answer: 64 mixed-length requests at once
    against each one alone. Identical prompts sent together must agree too."""
    client = server(max_batch_tokens=256)
    ps = prompts(60, seed=1)
    ps += [ps[0]] * 4  # identical prompts in the same burst
    solo = [client.generate(p, 8, ignore_eos=True) for p in ps[:60]]
    rids = [client.submit(p, 8, ignore_eos=True) for p in ps]
    client.wait(rids)
    for i, rid in enumerate(rids):
        want = solo[i if i < 60 else 0]
        assert client.outputs[rid] == want, f"request {i} changed when batched"
        assert client.finals[rid].finish_reason == "length"
    assert_idle_accounting(client)


def test_a_long_prompt_prefilled_in_chunks_never_stalls_decoding_rows(server):
    """While a 3,000-token prompt is prefilled in chunks of 256, each of 8 decoding
    rows must get a token in EVERY step. Each TokenOut is one step's news (or two
    with overlap), so all 8 rows must advance together in every message until the
    long prompt's first token, and by at least the number of chunks."""
    client = server(max_batch_tokens=256 + 8, max_model_len=4096, kv_pages=2048)
    decoders = [client.submit(p, 60, ignore_eos=True) for p in prompts(8, seed=2, lo=5, hi=20)]
    client.pump_until(lambda: all(client.outputs[r] for r in decoders))
    start = len(client.messages)
    long_rid = client.submit(list(np.random.default_rng(3).integers(5, 900, 3000)), 2, ignore_eos=True)
    client.pump_until(lambda: client.outputs.get(long_rid))
    assert not any(r in client.finals for r in decoders), "decoders too short for this test"
    window = client.messages[start:]
    got = {r: 0 for r in decoders}
    for msg in window:
        news = {o.rid: len(o.token_ids) // 4 for o in msg.outs if o.rid in got}
        if long_rid in {o.rid for o in msg.outs}:
            break
        if not news:
            continue  # a heartbeat; a stalled step sends nothing, caught by the count below
        assert set(news) == set(got) and len(set(news.values())) == 1, \
            f"a step left decoding rows out: {news}"
        for r, n in news.items():
            got[r] += n
    chunks = -(-3000 // 256)
    assert min(got.values()) >= chunks - 2, f"decoders advanced {got} during {chunks} chunks"
    client.wait(decoders + [long_rid])


def test_a_pool_too_small_for_all_rows_retracts_and_loses_nothing(server):
    """32 rows growing to ~100 tokens need ~800 pages of 4; the pool has 200. Rows
    must be retracted (counted), re-admitted from the cache, and every output must
    still equal its solo run."""
    client = server(kv_pages=200, max_batch_tokens=512)
    ps = prompts(32, seed=4, lo=20, hi=40)
    solo = [client.generate(p, 60, ignore_eos=True) for p in ps[:6]]
    rids = [client.submit(p, 60, ignore_eos=True) for p in ps]
    client.wait(rids, timeout=300)
    for i in range(6):
        assert client.outputs[rids[i]] == solo[i], f"request {i} changed by retraction"
    assert all(client.finals[r].finish_reason == "length" for r in rids), "a request was lost"
    assert all(len(client.outputs[r]) == 60 for r in rids)
    stats = client.wait_idle_stats()
    assert stats.retractions > 0, "the pool was never exhausted: this test proved nothing"
    assert_idle_accounting(client)


def test_requests_that_can_never_fit_or_wait_too_long_are_refused_without_blocking_others(server):
    """A prompt beyond the context is refused at once (400) while others run; a
    request that waits for a row past --queue-timeout gets 503; the running rows are
    served throughout, and the server serves after."""
    client = server(max_model_len=4096, queue_timeout=1.0, max_running_requests=2, kv_pages=2048)
    hogs = [client.submit(p, 3000, ignore_eos=True) for p in prompts(2, seed=5, lo=30, hi=30)]
    client.pump_until(lambda: all(client.outputs[h] for h in hogs))
    too_long = client.submit(list(range(5, 4000)), 200)
    late = client.submit(list(range(5, 60)), 4)
    client.wait([too_long])
    assert client.finals[too_long].status == 400 and "context length" in client.finals[too_long].error
    before = [len(client.outputs[h]) for h in hogs]
    client.wait([late], timeout=30)
    assert client.finals[late].status == 503 and "queue-timeout" in client.finals[late].error
    assert all(len(client.outputs[h]) > b for h, b in zip(hogs, before)), "running rows stalled"
    for h in hogs:
        client.abort(h)
    client.wait(hogs)
    assert client.generate(list(range(5, 20)), 4), "the server still serves"
    assert_idle_accounting(client)


@pytest.mark.parametrize("overlap", [True, False])
def test_aborts_at_every_stage_release_everything_exactly_once(server, overlap):
    """Abort while queued, mid-chunk, decoding and inside a batch in flight — each
    twice (aborts are idempotent). Afterwards, idle: free + cached == total and no
    row slot is held. A double free would kill the scheduler (PageError)."""
    client = server(max_batch_tokens=16, max_running_requests=2, disable_overlap=not overlap)
    long = list(range(5, 400))
    busy = [client.submit(long, 50, ignore_eos=True) for _ in range(2)]
    queued = client.submit(list(range(7, 50)), 5)          # no row free: queued
    client.pump(0.05)
    client.abort(queued); client.abort(queued)
    client.abort(busy[0]); client.abort(busy[0])           # mid-chunk (400 tokens at 16/step)
    client.wait([queued, busy[0]])
    client.pump_until(lambda: len(client.outputs[busy[1]]) >= 3)  # decoding
    client.abort(busy[1]); client.abort(busy[1])
    client.wait([busy[1]])
    inflight = client.submit(list(range(9, 30)), 50, ignore_eos=True)
    client.abort(inflight)                                 # likely still in the first batch
    client.abort(inflight)
    client.wait([inflight])
    for rid in (queued, busy[0], busy[1], inflight):
        assert client.finals[rid].finish_reason == "abort"
    assert_idle_accounting(client)
    assert client.generate(list(range(5, 30)), 4)


def test_overlap_on_and_off_give_the_same_outputs(server, tiny_models):
    ps = prompts(16, seed=6)
    outs = {}
    for overlap in (True, False):
        client = server(disable_overlap=not overlap, max_batch_tokens=128)
        rids = [client.submit(p, 12) for p in ps]
        client.wait(rids)
        outs[overlap] = [client.outputs[r] for r in rids]
        client.close()
    assert outs[True] == outs[False]
