"""KV tiers in one process: the real scheduler core, the real runner and the worker's
real tiers (host memory, disk files) driven by LocalEngine.

The oracle is the never-evicted run: a prompt whose pages went down a tier and came
back must give the same tokens (and, with --deterministic, the same logits bit for
bit) as the same prompt computed cold, and as it did the first time.
"""
from __future__ import annotations

import os
import zlib

import numpy as np
import pytest
import torch

from engine import LocalEngine
from ferroxmp.gpu_worker.kv.disk import HEADER, DiskTier, fingerprint

PAGE = 4


def prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(5, 200, length).tolist() for _ in range(n)]


@pytest.fixture
def make_engine(tiny_models, tmp_path):
    made: list[LocalEngine] = []

    def make(**kw) -> LocalEngine:
        kw.setdefault("num_pages", 24)
        kw.setdefault("max_batch_tokens", 64)
        kw.setdefault("page_size", PAGE)
        eng = LocalEngine(tiny_models["llama"], **kw)
        made.append(eng)
        return eng

    yield make
    for eng in made:
        eng.close()


def run(eng: LocalEngine, prompt: list[int], max_tokens: int = 6) -> tuple[list[int], list[torch.Tensor], int]:
    """(tokens, logits of each sampling step, prompt tokens adopted from the cache)."""
    rid = eng.submit(prompt, max_tokens)
    eng.run_until(lambda: rid in eng.finish)
    cached = eng.request(rid).cached_tokens if eng.request(rid) is not None else None
    eng.run_to_idle()
    return eng.outputs[rid], eng.sample_logits[rid], cached


def flood(eng: LocalEngine, n: int = 6, length: int = 40) -> None:
    """Other prompts, enough to evict every cached page of an earlier one."""
    for p in prompts(n, length, seed=99):
        run(eng, p, 2)


def tier_hits(eng: LocalEngine) -> tuple[int, int]:
    s = eng.core.stats()
    return s.kv_hit_tokens_host, s.kv_hit_tokens_disk


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_evicted_pages_loaded_back_give_the_never_evicted_answer(make_engine, tmp_path, tier):
    kw = {"kv_host_bytes": 1 << 26} if tier == "host" else {"kv_dir": str(tmp_path / "kv")}
    prompt = prompts(1, 41, seed=1)[0]
    cold = make_engine()
    want, want_logits, _ = run(cold, prompt)

    eng = make_engine(**kw)
    first, _, _ = run(eng, prompt)
    assert first == want
    flood(eng)
    assert eng.core.cache.tree.peek(prompt) == 0, "the flood must have evicted the prompt's pages"
    again, logits, _ = run(eng, prompt)
    host, disk = tier_hits(eng)
    loaded = host if tier == "host" else disk
    assert loaded >= 40, f"the prompt's pages must come back from the {tier} tier (loaded {host}/{disk} tokens)"
    assert again == want, "loaded pages must give the cold run's tokens"
    for a, b in zip(logits, want_logits):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    eng.core.check_integrity()


def test_deterministic_logits_are_bitwise_equal_after_a_round_trip_through_disk(make_engine, tmp_path):
    prompt = prompts(1, 45, seed=2)[0]
    cold = make_engine(deterministic=True)
    want, want_logits, _ = run(cold, prompt)
    eng = make_engine(deterministic=True, kv_dir=str(tmp_path / "kv"))
    run(eng, prompt)
    flood(eng)
    again, logits, _ = run(eng, prompt)
    assert tier_hits(eng)[1] >= 44
    assert again == want
    for a, b in zip(logits, want_logits):
        assert torch.equal(a, b), "a page loaded from disk must give the computed page's bits"


def test_a_restarted_engine_starts_warm_from_the_disk_tier(make_engine, tmp_path):
    prompt = prompts(1, 41, seed=3)[0]
    first = make_engine(kv_dir=str(tmp_path / "kv"))
    want, _, _ = run(first, prompt)
    first.tiers.drain()
    second = make_engine(kv_dir=str(tmp_path / "kv"))  # a new pool, tree and index: only the files remain
    got, _, _ = run(second, prompt)
    assert got == want
    assert tier_hits(second)[1] == 40, "every whole page below the last token comes from disk"


def test_loads_slower_than_recompute_are_skipped_but_probed_and_answers_stay_cold_equal(make_engine, tmp_path):
    """A slow disk must not make a request wait longer than recomputing would: once the
    measured load rate is below the prefill rate, prompts found on disk are recomputed
    (the same tokens as cold, no tier hits), and one load in PROBE_EVERY still runs, as
    a probe nobody waits for, so a disk that recovers is noticed."""
    from ferroxmp.scheduler import tier_moves
    ps = prompts(tier_moves.PROBE_EVERY, 41, seed=5)
    first = make_engine(kv_dir=str(tmp_path / "kv"), num_pages=128)
    want = [run(first, p)[0] for p in ps]
    first.tiers.drain()
    eng = make_engine(kv_dir=str(tmp_path / "kv"), num_pages=128)
    moves = eng.core.cache.moves
    eng.core.step_budget.observe(64, 0.01)  # prefill: 6,400 tokens/s
    moves.load_tokens_per_s = 100.0  # the disk: 100 tokens/s
    got = [run(eng, p)[0] for p in ps]
    assert got == want, "skipped loads must recompute to the cold answer"
    assert tier_hits(eng) == (0, 0), "no request waited for a load"
    assert sum(eng.core.tiers.worker.load_counts) == 1, "exactly one probe load ran"
    assert moves.load_tokens_per_s > 100.0, "the probe's measured rate must update the estimate"
    eng.core.check_integrity()


def test_a_load_waits_about_as_long_as_recomputing_would_take():
    from ferroxmp.scheduler.tier_moves import LOAD_TIMEOUT_S, MIN_WAIT_S, WAIT_OVER_RECOMPUTE, TierMoves
    wait = TierMoves(cache=None, index=None)._wait_s
    assert wait(1000, 0.0) == LOAD_TIMEOUT_S  # no rate measured yet
    assert wait(1000, 1e6) == MIN_WAIT_S
    assert wait(1000, 1000.0) == pytest.approx(min(LOAD_TIMEOUT_S, WAIT_OVER_RECOMPUTE))
    assert wait(10**6, 1000.0) == LOAD_TIMEOUT_S


@pytest.mark.parametrize("deterministic", [False, True])
def test_a_corrupted_page_file_is_dropped_and_its_part_recomputed(make_engine, tmp_path, deterministic):
    """The page is recomputed and written again: the same bytes under --deterministic;
    by default the same values to float32 rounding, since the recompute's steps have other
    row counts (a step may sum in another order at another row count)."""
    prompt = prompts(1, 41, seed=4)[0]
    first = make_engine(kv_dir=str(tmp_path / "kv"), deterministic=deterministic)
    want, _, _ = run(first, prompt)
    first.tiers.drain()
    files = sorted(os.path.join(first.tiers.disk.dir, f) for f in os.listdir(first.tiers.disk.dir))
    assert len(files) == 10
    victim = files[3]
    with open(victim, "rb") as f:
        original = f.read()
    with open(victim, "r+b") as f:  # flip one payload byte: same size, bad checksum
        f.seek(HEADER.size + 100)
        b = f.read(1)
        f.seek(HEADER.size + 100)
        f.write(bytes([b[0] ^ 0xFF]))
    second = make_engine(kv_dir=str(tmp_path / "kv"), deterministic=deterministic)
    got, _, _ = run(second, prompt)
    assert got == want, "a corrupted page must be recomputed, never used"
    second.tiers.drain()
    with open(victim, "rb") as f:  # deleted, then written again from the recomputed page
        again = f.read()
    if deterministic:
        assert again == original, "the recomputed page must be the page that was computed first"
    else:
        head, (magic, version, crc, key, length) = HEADER.size, HEADER.unpack(again[:HEADER.size])
        assert (magic, version, key, length) == HEADER.unpack(original[:head])[:2] + HEADER.unpack(original[:head])[3:]
        assert crc == zlib.crc32(again[head:]), "the page written again must carry its own checksum"
        a = np.frombuffer(again[head:], dtype=np.float32)
        b = np.frombuffer(original[head:], dtype=np.float32)
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    assert second.tiers.stats.load_failures >= 1
    second.core.check_integrity()


def test_torn_and_foreign_files_are_removed_at_start(tmp_path):
    fp = fingerprint({"x": 1})
    d = tmp_path / "kv" / fp
    tier = DiskTier(str(tmp_path / "kv"), fp, 1 << 30, 64)
    assert tier.write(b"k" * 16, memoryview(bytes(64))) == []
    (d / ("ab" * 16 + ".kv.123.tmp")).write_bytes(b"torn")  # a writer killed before its rename
    (d / ("cd" * 16 + ".kv")).write_bytes(bytes(HEADER.size + 10))  # truncated
    (d / "notes.txt").write_bytes(b"?")
    again = DiskTier(str(tmp_path / "kv"), fp, 1 << 30, 64)
    assert again.keys() == [b"k" * 16]
    assert sorted(os.listdir(d)) == [(b"k" * 16).hex() + ".kv"]
    assert oct(os.stat(d).st_mode & 0o777) == "0o700"
    assert oct(os.stat(d / ((b"k" * 16).hex() + ".kv")).st_mode & 0o777) == "0o600"
    out = bytearray(64)
    assert again.read_into(b"k" * 16, memoryview(out))
    assert not again.read_into(b"z" * 16, memoryview(out)), "a missing page is a failed load"


def test_the_disk_bound_deletes_least_recently_used_pages(tmp_path):
    page = 1000
    tier = DiskTier(str(tmp_path), "fp", 3 * (HEADER.size + page), page)
    gone = []
    for i in range(5):
        gone += tier.write(bytes([i]) * 16, memoryview(bytes(page)))
    assert gone == [bytes([0]) * 16, bytes([1]) * 16]
    assert len(os.listdir(tier.dir)) == 3


def test_a_foreign_fingerprint_is_never_read(make_engine, tmp_path):
    """Another page size writes another directory: a server never reads KV computed
    under a different fingerprint."""
    prompt = prompts(1, 41, seed=5)[0]
    first = make_engine(kv_dir=str(tmp_path / "kv"))
    run(first, prompt)
    first.tiers.drain()
    other = make_engine(kv_dir=str(tmp_path / "kv"), page_size=8)
    assert other.tiers.disk.dir != first.tiers.disk.dir
    assert other.core.tiers.where == {}
    run(other, prompt)
    assert tier_hits(other) == (0, 0)
