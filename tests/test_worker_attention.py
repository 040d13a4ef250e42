"""Attention backends (plan once per step, forward per layer) against the reference.

The oracle is `reference_attention`: one query at a time in float64, straight from the
definition (causal, window W means key k > q - W), reading slots through the page table.
Random pools, shuffled page tables, shared (adopted) pages, GQA, decode rows mixed with
prefill chunks: any indexing, padding or mask error changes the output. `run_backend`
is shared with tests/test_triton_attention.py, so every backend meets the same cases.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from ferroxmp.gpu_worker.attention import PlanError, make_backend, plan_step, reference_attention
from ferroxmp.gpu_worker.kv.pool import KVPool

PS, KVH, H, D = 4, 2, 6, 8
CPU = torch.device("cpu")


def run_backend(name, steps, window, seed=0, num_pages=80, pages_per_row=10, shared=(), dtype=torch.float32, shuffle=True,
                page_size=PS, heads=H, kv_heads=KVH, dim=D, layout=None, native=False, kv_dtype=None):
    """Random prior KV everywhere, a shuffled page table per row; rows in `shared` reuse
    row 0's first pages (adoption). `native`: the torch backend's decode rows through
    PageDecode; `kv_dtype`: a pool narrower than `dtype`. Returns (backend output in step
    order, reference)."""
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    layout = layout or ("hnd" if name == "torch" else "nhd")
    kv = KVPool(num_pages, page_size, 1, kv_heads, dim, kv_dtype or dtype, CPU, layout)
    kv.slots_view(0, "k").copy_(torch.randn(num_pages * page_size, kv_heads, dim, generator=g))
    kv.slots_view(0, "v").copy_(torch.randn(num_pages * page_size, kv_heads, dim, generator=g))
    rows = 1 + max(r for r, _, _ in steps)
    ids = rng.permutation(num_pages) if shuffle else np.arange(num_pages)
    table = ids[:rows * pages_per_row].reshape(rows, pages_per_row).astype(np.int32)
    for r, n in shared:
        table[r, :n] = table[0, :n]
    T = sum(n for _, _, n in steps)
    q = torch.randn(T, heads, dim, generator=g).to(dtype)
    k_new = torch.randn(T, kv_heads, dim, generator=g).to(dtype)
    v_new = torch.randn(T, kv_heads, dim, generator=g).to(dtype)
    backend = make_backend(kv, window, CPU, name, num_heads=heads, dtype=dtype, native_decode=native)
    assert (getattr(backend, "page_decode", None) is not None) == native
    plan = backend.plan(steps, table)
    plan.check_integrity()
    # q/k/v arrive in step order; backends take the plan's internal order.
    starts = np.cumsum([0] + [n for _, _, n in steps])
    perm = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in plan.order])
    out = backend.forward(0, q[perm], k_new[perm], v_new[perm])
    back = torch.empty_like(out)
    back[perm] = out
    ref = reference_attention(q, kv.slots_view(0, "k"), kv.slots_view(0, "v"), steps, table, page_size, window)
    return back, ref


MIXED = [(0, 20, 1), (1, 3, 7), (2, 0, 1), (3, 9, 6), (4, 31, 1), (5, 8, 5), (6, 0, 12)]


@pytest.mark.parametrize("window", [None, 5, 13])
def test_mixed_decode_and_prefill_steps_match_the_reference(window):
    """Three decode rows of different lengths (padding), prefill chunks from 0 (the causal
    path) and continuing at 3 and 9 (masked), one chunk of a row that adopted row 0's pages."""
    out, ref = run_backend("torch", MIXED, window, shared=[(5, 2)])
    assert torch.allclose(out.double(), ref, atol=1e-5), (out.double() - ref).abs().max()


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("dim", [8, 64])
def test_decode_rows_read_natively_from_the_pools_pages_match_the_reference(kv_dtype, dim):
    """PageDecode (quant/fused_decode.c's attention; no decode mirror) for the decode rows
    of a mixed step and of a decode-only step, over shuffled and adopted pages; head_dim
    8 (the scalar tails) and 64 (full float lanes); a float16 pool read as float16 (the
    reference reads the same stored values)."""
    for steps, seed in ((MIXED, 0), ([(r, 4 * r + 2, 1) for r in range(6)], 1)):
        out, ref = run_backend("torch", steps, None, seed=seed, shared=[(5, 2)], native=True, kv_dtype=kv_dtype,
                               dim=dim)
        assert torch.allclose(out.double(), ref, atol=1e-5), (out.double() - ref).abs().max()


def test_a_batch_of_only_decode_rows_matches_the_reference():
    steps = [(r, 4 * r + 2, 1) for r in range(6)]
    out, ref = run_backend("torch", steps, None, seed=1)
    assert torch.allclose(out.double(), ref, atol=1e-5)


def test_decode_rows_that_read_exactly_whole_pages_need_no_mask_and_match():
    """Every row at a page's last position: the backend skips the mask; it must still be right."""
    steps = [(r, 4 * r + 3, 1) for r in range(5)]
    out, ref = run_backend("torch", steps, None, seed=5)
    assert torch.allclose(out.double(), ref, atol=1e-5)


def test_a_chunk_on_consecutive_pages_is_read_in_place_and_matches():
    """Rows whose pages are consecutive in the pool take the no-copy path (from 0, causal;
    and on top of earlier positions, masked)."""
    out, ref = run_backend("torch", [(0, 0, 9), (1, 5, 9)], None, seed=2, pages_per_row=6,
                           num_pages=12, shuffle=False)
    assert torch.allclose(out.double(), ref, atol=1e-5)


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 3e-2), (torch.float16, 3e-3)])
def test_half_precision_stays_within_its_rounding(dtype, tol):
    out, ref = run_backend("torch", MIXED, 7, dtype=dtype, shared=[(5, 2)])
    err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
    assert err < tol, err


def test_the_window_lets_pages_outside_it_be_missing():
    """Pages below the window are never read: -1 there is fine; -1 inside is a PlanError
    naming the row, not a silent read of slot -4."""
    table = np.arange(32, dtype=np.int32).reshape(2, 16)
    table[0, :3] = -1  # positions 0..11 unreadable; window 5 at start 20 sees 16..20
    plan = plan_step([(0, 20, 1)], table, PS, 32, 5)
    assert plan.n_decode == 1
    plan_step([(0, 16, 4)], table, PS, 32, 5)  # chunk 16..19 sees 12..19
    with pytest.raises(PlanError, match="row 0"):
        plan_step([(0, 14, 1)], table, PS, 32, 5)  # sees 10, 11
    with pytest.raises(PlanError, match="row 0"):
        plan_step([(0, 20, 1)], table, PS, 32, None)  # full causal reads page 0


def test_a_position_beyond_the_page_table_is_a_plan_error():
    table = np.arange(8, dtype=np.int32).reshape(2, 4)
    with pytest.raises(PlanError, match="beyond"):
        plan_step([(1, 15, 2)], table, PS, 8, None)
    with pytest.raises(PlanError):
        plan_step([(1, 0, 1)], table * 0 + 8, PS, 8, None)  # page == num_pages


def _pool_and_backend(seed, num_pages=80, pages_per_row=10, rows=6):
    g = torch.Generator().manual_seed(seed)
    kv = KVPool(num_pages, PS, 1, KVH, D, torch.float32, CPU, "hnd")
    kv.slots_view(0, "k").copy_(torch.randn(num_pages * PS, KVH, D, generator=g))
    kv.slots_view(0, "v").copy_(torch.randn(num_pages * PS, KVH, D, generator=g))
    table = np.random.default_rng(seed).permutation(num_pages)[:rows * pages_per_row]
    return kv, table.reshape(rows, pages_per_row).astype(np.int32), make_backend(kv, None, CPU, "torch", num_heads=H), g


def _step(backend, kv, table, steps, g):
    """One step through the backend; (output, reference over the pool), both in step order."""
    T = sum(n for _, _, n in steps)
    q, k, v = (torch.randn(T, h, D, generator=g) for h in (H, KVH, KVH))
    plan = backend.plan(steps, table)
    starts = np.cumsum([0] + [n for _, _, n in steps])
    perm = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in plan.order])
    out = torch.empty(T, H, D)
    out[perm] = backend.forward(0, q[perm], k[perm], v[perm])
    return out, reference_attention(q, kv.slots_view(0, "k"), kv.slots_view(0, "v"), steps, table, PS, None)


def test_decode_rows_read_from_the_mirror_match_the_reference_step_after_step():
    """The decode mirror keeps rows' K/V between steps: rows decode, one leaves, the order
    changes, a row runs a chunk and comes back, a row joins after its prefill. Every step
    must equal the reference read from the pool (a mirror that missed a write, kept a
    stale row or mixed up slots reads other K/V)."""
    kv, table, be, g = _pool_and_backend(7)
    script = [[(0, 5, 1), (1, 9, 1), (2, 14, 1)],
              [(0, 6, 1), (1, 10, 1), (2, 15, 1)],
              [(2, 16, 1), (0, 7, 1), (3, 0, 6)],  # row 1 absent, row 3 prefills
              [(1, 11, 3), (0, 8, 1), (3, 6, 1), (2, 17, 1)],  # row 1 chunk, row 3 joins
              [(1, 14, 1), (2, 18, 1), (3, 7, 1), (0, 9, 1), (4, 30, 1)]]
    for steps in script:
        out, ref = _step(be, kv, table, steps, g)
        assert be.decode.pages is None, "the decode rows must have been read from the mirror"
        assert torch.allclose(out.double(), ref, atol=1e-5), (steps, (out.double() - ref).abs().max())
        be.mirror.check_integrity()
        assert sorted(be.mirror.rows) == sorted(r for r, _, n in steps if n == 1)


def test_a_new_request_in_a_slot_is_not_read_from_the_old_requests_mirror():
    """Slot 0 gets a new request with other pages that reaches the same length: after
    forget() (the runner calls it for every NewRow) it is read from its own pages. The
    same step without forget() reads the old request's K/V: proof the test can fail."""
    outs = {}
    for forget in (True, False):
        kv, table, be, g = _pool_and_backend(11)
        for start in (8, 9):
            _step(be, kv, table, [(0, start, 1), (1, 3, 1)], g)
        table[0] = table[5]  # a new request, other pages, 10 tokens known: decodes at 10
        if forget:
            be.forget(0)
        outs[forget] = _step(be, kv, table, [(0, 10, 1), (1, 4, 1)], g)
    out, ref = outs[True]
    assert torch.allclose(out.double(), ref, atol=1e-5)
    out, ref = outs[False]
    assert not torch.allclose(out[0].double(), ref[0], atol=1e-3)


def test_decode_over_the_mirror_budget_gathers_from_the_pool_and_matches():
    kv, table, be, g = _pool_and_backend(3)
    be.mirror.budget_bytes = 1  # nothing fits
    out, ref = _step(be, kv, table, [(0, 5, 1), (1, 30, 1), (2, 0, 5)], g)
    assert be.decode.pages is not None and not be.mirror.rows
    assert torch.allclose(out.double(), ref, atol=1e-5)


def test_the_mirror_and_the_gather_give_the_same_bits():
    """Same K/V, same span, same SDPA call: reading the mirror instead of gathering the
    pages must not change a bit (warm == cold and batched == solo rely on it)."""
    results = []
    for budget in (None, 1):
        kv, table, be, g = _pool_and_backend(5)
        if budget:
            be.mirror.budget_bytes = budget
        outs = [_step(be, kv, table, [(r, 4 * r + i + 2, 1) for r in range(5)], g)[0] for i in range(3)]
        results.append(torch.stack(outs))
    assert torch.equal(results[0], results[1])


def _native_pool(g, num_pages, ps, kv_heads, dim, kv_dtype):
    """A random one-layer pool and PageDecode over it (skips without native kernels)."""
    from ferroxmp.gpu_worker.attention.page_decode import PageDecode
    kv = KVPool(num_pages, ps, 1, kv_heads, dim, kv_dtype, CPU, "hnd")
    kv.slots_view(0, "k").copy_(torch.randn(num_pages * ps, kv_heads, dim, generator=g))
    kv.slots_view(0, "v").copy_(torch.randn(num_pages * ps, kv_heads, dim, generator=g))
    pd = PageDecode.build(kv, None, torch.float32)
    if pd is None:
        pytest.skip("no native kernels here")
    return kv, pd


def _page_decode(pd, seqs, q):
    """PageDecode over `seqs` ((pages of a row, positions of its tokens in this step)),
    q [tokens, heads, dim] in the same order."""
    positions, page_at, pages = [], [], []
    for row_pages, pos in seqs:
        page_at += [len(pages)] * len(pos)
        positions += pos
        pages += row_pages.tolist()
    page_at.append(len(pages))
    return pd(0, q, torch.tensor(positions), torch.tensor(page_at), torch.tensor(pages), max(positions) + 1)


def _check_definition(out, q, kv, seqs, ps):
    """Every query of `out` against the softmax over keys 0..its position, in float64."""
    heads, kv_heads, dim = q.shape[1], kv.k.shape[1], q.shape[2]
    ks, vs = kv.slots_view(0, "k").double(), kv.slots_view(0, "v").double()
    i = 0
    for row_pages, pos in seqs:
        slots = (row_pages[:, None] * ps + torch.arange(ps)).reshape(-1)
        for p in pos:
            k, v = ks[slots[:p + 1]], vs[slots[:p + 1]]  # [p + 1, kv_heads, dim]
            for h in range(heads):
                j = h // (heads // kv_heads)
                w = torch.softmax(k[:, j] @ q[i, h].double() / dim ** 0.5, 0)
                want = w @ v[:, j]
                assert torch.allclose(out[i, h].double(), want, atol=1e-5), (p, h, (out[i, h] - want).abs().max())
            i += 1


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,dim", [(6, 2, 8), (9, 3, 64), (8, 1, 48), (4, 4, 128), (16, 2, 32), (64, 1, 16)])
def test_tokens_sharing_their_pages_each_attend_up_to_their_own_position(kv_dtype, heads, kv_heads, dim):
    """PageDecode over rows that share one page list (a chunk's tokens in a fused step: a
    speculative verify, a short prompt), each at its own position, beside single rows:
    every query must see exactly keys 0..its position (causal within the chunk). Cases:
    the scores with queries in lanes (>= 6 queries), a chunk of more queries than one work
    item takes (20 tokens x 8 heads), head sizes whose V sums stay in registers (32, 64,
    128) or not (8, 48), GQA 1-64 (64: more query heads than a work item takes), a float16
    pool."""
    g = torch.Generator().manual_seed(heads * dim)
    ps, num_pages = 4, 64
    kv, pd = _native_pool(g, num_pages, ps, kv_heads, dim, kv_dtype)
    perm = torch.randperm(num_pages, generator=g)
    # (pages of the row, positions of its tokens in this step): a chunk of 20, one of 5, a row alone
    seqs = [(perm[:10], list(range(14, 34))), (perm[10:20], list(range(3, 8))), (perm[20:30], [25])]
    q = torch.randn(sum(len(pos) for _, pos in seqs), heads, dim, generator=g)
    _check_definition(_page_decode(pd, seqs, q), q, kv, seqs, ps)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
def test_long_contexts_in_chunks_match_the_definition_and_do_not_depend_on_the_step(kv_dtype):
    """PageDecode takes a decoding row's keys 512 positions at a time (fused_decode.c's
    chunks, joined by their softmax maxima and sums). Oracle: the softmax over all the keys
    in float64, at positions that end a chunk (511), start one with a single key (512), span
    several (700, 1500), and a verify of 9 tokens past a chunk's end (505-513); and each
    row's output alone in a step is bitwise its output beside the others (the chunks
    depend on the position only, never on the other rows)."""
    heads, kv_heads, dim, ps, num_pages = 9, 3, 64, 16, 400
    g = torch.Generator().manual_seed(7)
    kv, pd = _native_pool(g, num_pages, ps, kv_heads, dim, kv_dtype)
    perm = torch.randperm(num_pages, generator=g)
    seqs = [(perm[0:100], [1500]), (perm[100:140], list(range(505, 514))), (perm[140:190], [700]),
            (perm[190:230], [511]), (perm[230:270], [512])]
    q = torch.randn(sum(len(pos) for _, pos in seqs), heads, dim, generator=g)
    out = _page_decode(pd, seqs, q)
    _check_definition(out, q, kv, seqs, ps)
    i = 0
    for row_pages, pos in seqs:
        if len(pos) == 1:  # a row alone (a verify's queries share an item: its scores take another order)
            alone = _page_decode(pd, [(row_pages, pos)], q[i:i + 1])
            assert torch.equal(alone[0], out[i]), (pos, (alone[0] - out[i]).abs().max())
        i += len(pos)


def test_a_decode_steps_short_plan_is_the_general_plan():
    """plan_step's short path for steps of one token a row (no window) against its general
    path (a window longer than any row, so that every page is read: the same pages), on
    random rows and positions: every array, the write slots, positions and offsets."""
    from ferroxmp.gpu_worker.attention.base import _plan_decode
    rng = np.random.default_rng(5)
    table = rng.permutation(64 * 16).astype(np.int32).reshape(64, 16)
    for _ in range(50):
        rows = rng.choice(64, size=int(rng.integers(1, 17)), replace=False).tolist()
        steps = [(r, int(rng.integers(0, 16 * PS)), 1) for r in rows]
        short = _plan_decode(steps, table, PS, 64 * 16)
        general = plan_step(steps, table, PS, 64 * 16, 10 ** 9)
        assert short is not None and short.decode_only
        short.check_integrity()
        for name in ("rows", "starts", "lengths", "first_page", "kv_indptr", "kv_pages", "positions", "write_slots",
                     "q_indptr", "kv_lens"):
            assert np.array_equal(getattr(short, name), getattr(general, name)), name
        assert short.order == general.order and short.last_index == general.last_index
        # (write_slots takes a decode step's own short path in both: against the table)
        assert short.write_slots.tolist() == [int(table[r, p // PS]) * PS + p % PS for r, p, _ in steps]
