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
