"""Our Triton paged kernels (decode and extend), run on CPU tensors under
TRITON_INTERPRET=1, against the float64 reference.

The cases are the CPU backend's (tests/test_worker_attention.py `run_backend`): decode
rows of different lengths mixed with chunks from 0 and on top of earlier positions,
GQA (6 query heads over 2 KV heads), shuffled page tables (pages out of order), rows that
adopted another row's pages, sliding windows that start mid-page, chunks longer than one
query block. A wrong page index, slot, mask or softmax rescale changes the output far
beyond the tolerance. Skipped only where Triton cannot be installed.
"""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: kernels run on CPU tensors

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="triton is not installable on this platform")
from test_worker_attention import MIXED, run_backend  # noqa: E402

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("TRITON_INTERPRET was set to something else before this module", allow_module_level=True)

LONG = [(0, 0, 37), (1, 30, 1), (2, 5, 21), (3, 17, 1)]  # chunks over 2-3 query blocks of 16


@pytest.mark.parametrize("window", [None, 5, 13])
def test_mixed_decode_and_extend_match_the_reference(window):
    out, ref = run_backend("triton", MIXED, window, shared=[(5, 2)])
    assert torch.allclose(out.double(), ref, atol=1e-5), (out.double() - ref).abs().max()


@pytest.mark.parametrize("window", [None, 9])
def test_chunks_longer_than_a_query_block_match_the_reference(window):
    out, ref = run_backend("triton", LONG, window, seed=3, pages_per_row=12, num_pages=60, shared=[(2, 1)])
    assert torch.allclose(out.double(), ref, atol=1e-5), (out.double() - ref).abs().max()


def test_pages_larger_than_a_key_block_and_one_query_head_per_kv_head():
    """page_size 32 (> the 16-key block: a block reads part of a page), no GQA."""
    steps = [(0, 70, 1), (1, 0, 40), (2, 33, 30)]
    out, ref = run_backend("triton", steps, None, seed=4, page_size=32, num_pages=20, pages_per_row=4,
                           heads=4, kv_heads=4, dim=16, shared=[(2, 1)])
    assert torch.allclose(out.double(), ref, atol=1e-5), (out.double() - ref).abs().max()


def test_a_batch_of_only_decode_rows_with_a_window_matches_the_reference():
    steps = [(r, 5 * r + 3, 1) for r in range(7)]
    out, ref = run_backend("triton", steps, 6, seed=1)
    assert torch.allclose(out.double(), ref, atol=1e-5)


@pytest.mark.parametrize("dtype,tol", [(torch.float16, 3e-3), (torch.bfloat16, 3e-2)])
def test_half_precision_stays_within_its_rounding(dtype, tol):
    out, ref = run_backend("triton", MIXED, 7, dtype=dtype, shared=[(5, 2)])
    err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
    assert err < tol, err


def test_a_decode_step_padded_for_a_cuda_graph_matches_and_touches_only_the_pad_page():
    """The static, padded path CUDA graphs replay (cuda_graphs.py), run eagerly on CPU: 3
    decode rows padded to 8 must give the reference's output for the 3 rows, and the
    pool may change only at the 3 rows' new slots and on the pad page (a padding row that
    wrote anywhere else would corrupt another row's K/V)."""
    import numpy as np
    from ferroxmp.gpu_worker.attention import make_backend, reference_attention
    from ferroxmp.gpu_worker.cuda_graphs import PinnedStager, padded_batch_size, graph_batch_sizes
    from ferroxmp.gpu_worker.kv.pool import KVPool
    from test_worker_attention import CPU, D, H, KVH, PS

    g = torch.Generator().manual_seed(9)
    pages, pad = 40, 40  # the pool has one page more than the scheduler's 40
    kv = KVPool(pages + 1, PS, 1, KVH, D, torch.float32, CPU, "nhd")
    kv.slots_view(0, "k").copy_(torch.randn((pages + 1) * PS, KVH, D, generator=g))
    kv.slots_view(0, "v").copy_(torch.randn((pages + 1) * PS, KVH, D, generator=g))
    table = np.random.default_rng(9).permutation(pages)[:30].reshape(3, 10).astype(np.int32)
    steps = [(0, 13, 1), (1, 2, 1), (2, 30, 1)]
    be = make_backend(kv, None, CPU, "triton", num_heads=H)
    size = padded_batch_size(3, graph_batch_sizes(256))
    assert size == 4
    size = 8  # more padding than the smallest size, to exercise several padding rows
    be.enable_padding(max_rows=8, max_pages=30, pad_page=pad)
    plan = be.plan(steps, table)
    be.prepare_padded(plan, size, PinnedStager(pin=False))
    before_k = kv.slots_view(0, "k").clone()
    q = torch.zeros(size, H, D)
    k = torch.zeros(size, KVH, D)
    v = torch.zeros(size, KVH, D)
    q[:3], k[:3], v[:3] = (torch.randn(3, h, D, generator=g) for h in (H, KVH, KVH))
    k[3:], v[3:] = 1e4, 1e4  # a padding row's K/V, loud if it lands in a real slot
    out = be.forward(0, q, k, v)
    ref = reference_attention(q[:3], kv.slots_view(0, "k"), kv.slots_view(0, "v"), steps, table, PS, None)
    assert torch.allclose(out[:3].double(), ref, atol=1e-5)
    changed = (kv.slots_view(0, "k") != before_k).any(-1).any(-1).nonzero().flatten().tolist()
    real = sorted(int(table[r, s // PS]) * PS + s % PS for r, s, _ in steps)
    assert sorted(set(changed) - set(range(pad * PS, (pad + 1) * PS))) == real
    with pytest.raises(Exception, match="page"):  # the pad page is no row's: a table naming it is refused
        bad = table.copy()
        bad[0, 0] = pad
        be.plan([(0, 1, 1)], bad)
