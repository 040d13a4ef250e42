"""Batch-invariant linear layers for `--deterministic`, and what was measured to need them.

Job: `invariant_linear(x, w, b)` gives each row of x the same output bits whatever the
other rows are and however many there are (`deterministic_linear`, the model's matmul
in this mode: that for plain tensors, a float32 weight in panels as it is, already
row-invariant: quant/groups.c); `check_linear(w)` verifies that on this
torch build and these shapes (the worker runs it at startup in deterministic mode and
refuses to start if it fails, rather than serve a mode that does not hold).

What varies (measured on this machine, torch 2.13 CPU, 2 threads; tests/test_deterministic_ops.py
`test_the_first_op_that_varies_is_found_and_deterministic_mode_removes_it` traces every
op of the real model per (row, position) and reports the first one whose bits differ):
- F.linear, float32: a row's output has one of three bit patterns, by where the row sits
  in the gemm: M == 1 (a gemv), a row in the tail of M % 4 (the 4-row micro-tile's
  remainder) or a row in a full 4-row tile. The batch's size and the row's offset
  beyond that do not matter (M = 1..2100, K up to 1536, N up to 8192). A one-token
  chunk or decode step (M = 1) and a prompt whose length is not a multiple of 4 hit
  the other kernels: logits move by ~1e-6. bfloat16 showed no variation at these shapes.
- Attention (torch SDPA): a query's output depends on how many queries and keys the
  call holds (flash blocks) and where its chunk starts: first differing op when a prompt
  is split into chunks at different points. Fixed by `attention/deterministic.py`.
- RMSNorm (float32), softmax / log_softmax over the vocabulary, sum: row-invariant.
- Elementwise SiLU in float32 varies with the tensor's length when a row's tail falls in
  the scalar remainder of the vectorised loop (a [M, 1000] contiguous tensor); the
  model applies it to [M, intermediate] slices with intermediate a multiple of 32, all
  vectorised: no variation observed in the traced model.
- Sampling: already counter-based per (seed, position) over row-wise ops.

The fix: every matmul is called on blocks of exactly `ROW_TILE` rows (the last block
padded with zero rows, which are dropped), so the gemm sees one shape whatever the batch
and picks one kernel, one blocking and one threading split for every row. Padding the
batch to a multiple of 4 rows (the first fix) held on an AMD EPYC but not on an Intel
Xeon with AVX-512 (measured: for K = 1536 the row's bits changed with M at tiles of 4,
8 and 32), because there the library's choice of kernel depends on M itself. Cost: at
most ROW_TILE - 1 extra rows per matmul, and a prefill chunk runs as M / ROW_TILE calls.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ferroxmp.gpu_worker.quant.packed import PackedF32

ROW_TILE = 16  # rows per gemm call: a multiple of every sgemm row micro-tile seen (4, 8, 16)


def invariant_linear(x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor] = None) -> torch.Tensor:
    """F.linear with each row's bits independent of the batch: one gemm shape, [ROW_TILE, K]."""
    m = x.shape[0]
    padded = -(-m // ROW_TILE) * ROW_TILE
    if padded != m:
        x = torch.cat([x, x.new_zeros((padded - m,) + tuple(x.shape[1:]))])
    if padded == ROW_TILE:
        return F.linear(x, w, b)[:m]
    return torch.cat([F.linear(blk, w, b) for blk in x.split(ROW_TILE)])[:m]


def deterministic_linear(x: torch.Tensor, w, b: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`invariant_linear` for a plain tensor; a PackedF32 as it is: groups.c's panels sum
    each output in one chain over k at any row count, row-invariant by construction (and
    a one-row step then reads the weight once instead of multiplying 16 rows)."""
    return w(x, b) if isinstance(w, PackedF32) else invariant_linear(x, w, b)


def check_linear(w, b: Optional[torch.Tensor] = None, sizes=(1, 2, 3, 5, 8, 13, 21, 40)) -> None:
    """Raise RuntimeError unless every row of a random batch gets the same bits from
    `deterministic_linear` alone, at every batch size in `sizes` and at a shifted offset."""
    gen = torch.Generator().manual_seed(0)
    dtype, device = (torch.float32, torch.device("cpu")) if isinstance(w, PackedF32) else (w.dtype, w.device)
    x = torch.randn(max(sizes) + 3, w.shape[1], generator=gen).to(dtype).to(device)
    alone = torch.cat([deterministic_linear(x[i:i + 1], w, b) for i in range(x.shape[0])])
    for m in sizes:
        for off in (0, 3):
            if not torch.equal(deterministic_linear(x[off:off + m], w, b), alone[off:off + m]):
                raise RuntimeError(f"--deterministic: a {tuple(w.shape)} {w.dtype} matmul on {w.device} gives a "
                                   f"row different bits in a batch of {m}; this build's matmul is not "
                                   f"row-invariant (plain weights: in {ROW_TILE}-row tiles)")


def make_deterministic(model) -> None:
    """Install the invariant linear on a `DecoderLM` (its `linear` hook) after checking it
    on each distinct matrix shape the model multiplies by (with its bias, if any)."""
    mats = [(model.lm_head, None)]
    for L in model.layers:
        mats += [(L.w_qkv, L.b_qkv), (L.w_o, L.b_o), (L.w_gate_up, None), (L.w_down, None)]
    seen = set()
    for w, b in mats:
        key = (tuple(w.shape), type(w), getattr(w, "dtype", None), b is None)
        if key not in seen:
            seen.add(key)
            check_linear(w, b)
    model.linear = deterministic_linear
