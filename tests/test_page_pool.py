"""PagePool: refcounts and the page table in shared memory, across processes."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from ferroxmp.page_pool import PageError, PagePool

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _shm_path(name: str) -> str:
    return os.path.join("/dev/shm", name.lstrip("/"))


@pytest.fixture
def make_pool():
    """PagePool factory; every pool is closed and unlinked at teardown, pass or fail."""
    pools: list[PagePool] = []

    def make(num_pages: int = 8, max_rows: int = 4, max_pages_per_row: int = 6) -> PagePool:
        pool = PagePool.create(num_pages, max_rows, max_pages_per_row)
        pools.append(pool)
        return pool

    yield make
    for pool in pools:
        pool.close()
        pool.unlink()
        assert not os.path.exists(_shm_path(pool.name)), f"{pool.name} left in /dev/shm"


def test_alloc_is_all_or_nothing(make_pool):
    """A partial grant would leave a row with too few pages and leak the ones it got:
    a refused alloc must move neither the free list nor any refcount."""
    pool = make_pool(num_pages=8)
    first = pool.alloc(5)
    assert first is not None and len(set(first)) == 5
    refs_before = pool.refs.copy()
    assert pool.alloc(4) is None
    assert pool.free_count == 3
    np.testing.assert_array_equal(pool.refs, refs_before)
    rest = pool.alloc(3)
    assert rest is not None and not set(rest) & set(first)
    assert pool.free_count == 0 and (pool.refs == 1).all()
    pool.check_integrity()


def test_a_double_free_raises_before_any_refcount_moves(make_pool):
    """A double free caught late is a page handed to two rows. It must raise at the
    release that does it, short and long lists alike, and leave the refcounts as
    they were so the accounting is still readable after the error."""
    pool = make_pool(num_pages=64)
    a, b = pool.alloc(2)
    pool.release([a])
    with pytest.raises(PageError, match="double free"):
        pool.release([b, a])
    assert pool.refs[b] == 1, "the valid half of a failed release moved a refcount"
    with pytest.raises(PageError, match="double free"):
        pool.release([b, b])  # one ref, two releases
    assert pool.refs[b] == 1
    many = pool.alloc(40)  # the vectorised path
    with pytest.raises(PageError, match="double free"):
        pool.release(many + [a])
    assert (pool.refs[many] == 1).all()
    pool.release(many + [b])
    assert pool.free_count == 64
    pool.check_integrity()


def test_retain_of_a_free_page_raises(make_pool):
    """Retaining a free page would resurrect it while alloc may hand it out again."""
    pool = make_pool(num_pages=64)
    held = pool.alloc(1)
    free_page = next(p for p in range(64) if p not in held)
    with pytest.raises(PageError, match="free page"):
        pool.retain(held + [free_page])
    assert pool.refs[held[0]] == 1 and pool.refs[free_page] == 0
    many = pool.alloc(40)
    with pytest.raises(PageError, match="free page"):
        pool.retain(many + [next(p for p in range(64) if pool.refs[p] == 0)])
    assert (pool.refs[many] == 1).all()
    pool.retain(many)
    assert (pool.refs[many] == 2).all()


def test_a_page_out_of_range_raises_instead_of_wrapping(make_pool):
    """numpy would read refs[-1] as the last page: a bad id must not touch another page."""
    pool = make_pool(num_pages=8)
    pool.alloc(8)
    for bad in (-1, 8):
        with pytest.raises(PageError, match="out of range"):
            pool.release([bad])
        with pytest.raises(PageError, match="out of range"):
            pool.retain([bad])
    assert (pool.refs == 1).all()


@pytest.mark.parametrize("corrupt", ["duplicate", "held_page_listed", "free_page_missing"])
def test_check_integrity_catches_a_corrupted_free_list(make_pool, corrupt):
    """The free list is the writer's private mirror of refs == 0; any drift between the
    two is a page handed out twice or lost forever."""
    pool = make_pool(num_pages=8)
    held = pool.alloc(3)
    pool.check_integrity()
    if corrupt == "duplicate":
        pool._free.append(pool._free[0])
    elif corrupt == "held_page_listed":
        pool._free.append(held[0])
    else:
        pool._free.pop()
    with pytest.raises(PageError):
        pool.check_integrity()


def test_check_integrity_compares_refcounts_with_their_holders(make_pool):
    """The contract's accounting: a page's refcount equals the tree plus every row
    holding it; a leaked ref shows up as one more ref than holders."""
    pool = make_pool(num_pages=8)
    a, b = pool.alloc(2)
    pool.retain([a])
    pool.check_integrity({a: 2, b: 1})
    with pytest.raises(PageError, match=f"page {a}"):
        pool.check_integrity({a: 1, b: 1})


def test_a_row_is_written_and_cleared_in_the_page_table(make_pool):
    """row_pages is what the worker attends over: exactly the pages set, in order, and
    a snapshot that a later write by the scheduler cannot change."""
    pool = make_pool(max_rows=2, max_pages_per_row=6)
    pages = pool.alloc(3)
    pool.set_row(1, pages, 10)
    got = pool.row_pages(1)
    assert got.tolist() == pages and pool.row_lens[1] == 10
    pool.set_row(1, pages[:1], 2)
    assert got.tolist() == pages, "row_pages returned a view, not a snapshot"
    assert pool.row_pages(1).tolist() == pages[:1]
    pool.clear_row(1)
    assert pool.row_pages(1).tolist() == [] and pool.row_lens[1] == 0
    full = pool.alloc(5) + pages[:1]
    pool.set_row(0, full, 6 * 4)
    assert pool.row_pages(0).tolist() == full


def test_a_writer_that_attaches_rebuilds_the_free_list_from_refcounts(make_pool):
    """A scheduler attaching to a pool the supervisor created must not hand out a held page."""
    pool = make_pool(num_pages=8)
    held = pool.alloc(3)
    other = PagePool.attach(pool.name, writer=True)
    try:
        assert other.free_count == 5
        assert not set(other.alloc(5)) & set(held)
        assert other.alloc(1) is None
    finally:
        other.close()


_READER = textwrap.dedent("""
    import json, sys
    from ferroxmp.page_pool import PagePool
    pool = PagePool.attach(sys.argv[1])
    print(json.dumps({"refs": pool.refs.tolist(), "row": pool.row_pages(2).tolist(),
                      "len": int(pool.row_lens[2]), "free": pool.free_count}))
    pool.close()
""")


def test_a_second_process_reads_what_the_first_writes_and_unlinks_nothing(make_pool):
    """The worker is another interpreter that attaches by name. It must see the
    scheduler's refcounts and page table, and its exit must not unlink the segment:
    on Python < 3.13 an attached segment is registered with the reader's resource
    tracker, which unlinks it when the reader exits and takes the pool from under
    the server."""
    pool = make_pool(num_pages=8, max_rows=4, max_pages_per_row=6)
    pages = pool.alloc(3)
    pool.retain(pages[:1])
    length = 11
    pool.set_row(2, pages, length)
    for round_ in range(2):
        out = subprocess.run([sys.executable, "-c", _READER, pool.name], cwd=REPO,
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        seen = json.loads(out.stdout)
        assert seen["refs"] == pool.refs.tolist()
        assert seen["row"] == pages and seen["len"] == length
        assert seen["free"] == 0, "a reader must not build a free list"
        assert os.path.exists(_shm_path(pool.name)), f"reader exit unlinked (round {round_})"
        assert "leaked shared_memory" not in out.stderr, out.stderr
        pool.release(pages[:1])  # the second round must see the change
        pages, length = pages[:2], 7
        pool.set_row(2, pages, length)
    again = PagePool.attach(pool.name)
    try:
        assert again.refs.tolist() == pool.refs.tolist()
    finally:
        again.close()


def test_the_segment_is_gone_after_unlink():
    """Nothing may be left in /dev/shm after the owner unlinks (and a second unlink is
    harmless, so teardown paths can run twice)."""
    pool = PagePool.create(4, 1, 4)
    name = pool.name
    try:
        assert os.path.exists(_shm_path(name))
    finally:
        pool.close()
        pool.unlink()
    assert not os.path.exists(_shm_path(name))
    pool.unlink()
    with pytest.raises(FileNotFoundError):
        PagePool.attach(name)


def test_a_segment_is_removed_by_name_from_another_process_and_only_once():
    """Pins: the supervisor's teardown removal (a worker killed with -9 leaves its pool)
    was a silent no-op — it imported shm_unlink from the wrong module and swallowed the
    ImportError. The segment's existence in /dev/shm is the oracle."""
    from ferroxmp.page_pool import remove_segment
    pool = PagePool.create(4, max_rows=2, max_pages_per_row=2)
    try:
        name = pool.name
        assert os.path.exists(f"/dev/shm/{name}")
        code = f"from ferroxmp.page_pool import remove_segment; print(remove_segment({name!r}))"
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        assert out.stdout.strip() == "True", out.stderr
        assert not os.path.exists(f"/dev/shm/{name}")
        assert remove_segment(name) is False  # already gone: said, not raised
    finally:
        pool.close()
        pool.unlink()
