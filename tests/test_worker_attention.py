"""Paged attention (the batched fast path) against the reference implementation.

The oracle is `reference_attention`: one query at a time in float64, straight from the
definition (causal, window W means key k > q - W), reading slots through the page table.
Random pools, shuffled page tables, shared (adopted) pages, GQA, decode rows mixed with
prefill chunks: any indexing, padding or mask error changes the output.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from ferroxmp.gpu_worker.attention import PlanError, build_plan, paged_attention, reference_attention

PS, KVH, H, D = 4, 2, 6, 8


def _setup(steps, window, seed=0, num_pages=64, pages_per_row=10, shared=()):
    """Random prior KV everywhere, a shuffled page table per row; rows in `shared` reuse
    row 0's first pages (adoption)."""
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    k_slots = torch.randn(num_pages * PS, KVH, D, generator=g)
    v_slots = torch.randn(num_pages * PS, KVH, D, generator=g)
    rows = 1 + max(r for r, _, _ in steps)
    perm = rng.permutation(num_pages)[:rows * pages_per_row].reshape(rows, pages_per_row)
    table = perm.astype(np.int32)
    for r, n in shared:
        table[r, :n] = table[0, :n]
    T = sum(n for _, _, n in steps)
    q = torch.randn(T, H, D, generator=g)
    k_new = torch.randn(T, KVH, D, generator=g)
    v_new = torch.randn(T, KVH, D, generator=g)
    return k_slots, v_slots, table, q, k_new, v_new


def _run(steps, window, **kw):
    k_slots, v_slots, table, q, k_new, v_new = _setup(steps, window, **kw)
    plan = build_plan(steps, table, PS, k_slots.shape[0] // PS, window, torch.device("cpu"))
    plan.check_integrity()
    # q/k/v arrive in step order; the fast path wants the plan's internal order.
    starts = np.cumsum([0] + [n for _, _, n in steps])
    perm = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in plan.order])
    out = paged_attention(q[perm], k_new[perm], v_new[perm], k_slots, v_slots, plan, PS)
    back = torch.empty_like(out)
    back[perm] = out
    ref = reference_attention(q, k_slots, v_slots, steps, table, PS, window)
    assert sorted(plan.order) == list(range(len(steps)))
    return back, ref


@pytest.mark.parametrize("window", [None, 5, 13])
def test_mixed_decode_and_prefill_steps_match_the_reference(window):
    """Three decode rows of different lengths (padding), two prefill chunks (one from 0,
    one continuing at 9), one chunk of a row that adopted row 0's pages."""
    steps = [(0, 20, 1), (1, 3, 7), (2, 0, 1), (3, 9, 6), (4, 31, 1), (5, 8, 5)]
    out, ref = _run(steps, window, shared=[(5, 2)])
    assert torch.allclose(out.double(), ref, atol=1e-5), (out.double() - ref).abs().max()


def test_a_batch_of_only_decode_rows_matches_the_reference():
    steps = [(r, 4 * r + 2, 1) for r in range(6)]
    out, ref = _run(steps, None, seed=1)
    assert torch.allclose(out.double(), ref, atol=1e-5)


def test_the_window_lets_pages_outside_it_be_missing():
    """Pages below the window are never read: -1 there is fine; -1 inside is a PlanError
    naming the row, not a silent read of slot -4."""
    table = np.arange(32, dtype=np.int32).reshape(2, 16)
    table[0, :3] = -1  # positions 0..11 unreadable; window 5 at start 20 sees 16..20
    plan = build_plan([(0, 20, 1)], table, PS, 32, 5, torch.device("cpu"))
    assert plan.n_decode == 1
    build_plan([(0, 16, 4)], table, PS, 32, 5, torch.device("cpu"))  # chunk 16..19 sees 12..19
    with pytest.raises(PlanError, match="row 0"):
        build_plan([(0, 14, 1)], table, PS, 32, 5, torch.device("cpu"))  # sees 10, 11
    with pytest.raises(PlanError, match="row 0"):
        build_plan([(0, 20, 1)], table, PS, 32, None, torch.device("cpu"))  # full causal reads page 0


def test_a_position_beyond_the_page_table_is_a_plan_error():
    table = np.arange(8, dtype=np.int32).reshape(2, 4)
    with pytest.raises(PlanError, match="beyond"):
        build_plan([(1, 15, 2)], table, PS, 8, None, torch.device("cpu"))
    with pytest.raises(PlanError):
        build_plan([(1, 0, 1)], table * 0 + 8, PS, 8, None, torch.device("cpu"))  # page == num_pages
