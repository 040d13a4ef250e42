"""int4 / int8 Groups multiplied on a GPU: Triton kernels over the canonical GGUF layout.

Job: `groups_linear(x, g, bias)` is F.linear for a Groups weight whose tensors live on a
CUDA device (--quantization int4/int8 on CUDA). The weight is read as stored (no repack:
the loader's Groups is what the GPU holds) and widened in registers:
- up to DEQUANT_ROWS activation rows (decode, small chunks): `_mm_kernel`, one program
  per tile of 16 rows x BLOCK_N weight rows, looping over the groups of 32; a group's
  values are widened to the activations' dtype (q * d + m in float32, then rounded) and
  multiplied on the tensor cores with float32 accumulation. Bytes read: the weight once
  per 16 activation rows, a quarter (int4) or half (int8) of a float16 weight's.
- more rows (a prefill chunk): `_dequant_kernel` widens the whole weight into the
  activations' dtype once and cuBLAS multiplies it (its GEMM beats a kernel of ours at
  that size; the widening is one pass over the weight against M passes of compute).

Why Triton and not torch's `_weight_int4pack_mm` (tinygemm): its int4 format holds scale
and zero in bfloat16, which would round our float16 scales (GGUF's values would change),
and a Triton kernel is the one this machine can test: under TRITON_INTERPRET=1 it runs on
CPU tensors (tests/test_triton_groups.py, against Groups.dequantize in float64).

Invariants: x's last dimension equals the weight's columns (a multiple of 32); the
output has x's dtype; a Groups weight stays on its device (the kernels never copy it).
"""
from __future__ import annotations

import os
from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

GROUP = 32
BLOCK_M = 16   # tl.dot's smallest tile: decode rows share each group read
BLOCK_N = 64
# Activation rows from which the weight is widened whole and multiplied by cuBLAS. Not
# measured on a GPU yet (none was lent): a guess between a decode batch and a chunk.
DEQUANT_ROWS = 64


@triton.jit
def _group_weights(Q, D, Mn, rn, nmask, g, groups, cols, INT4: tl.constexpr):
    """Group g of weight rows rn widened to float32: int4 as (values 0-15, values 16-31)
    [BLOCK_N, 16] each; int8 as ([BLOCK_N, 32], None-like zeros)."""
    rn64 = rn.to(tl.int64)
    d = tl.load(D + rn64 * groups + g, mask=nmask, other=0.0).to(tl.float32)[:, None]
    if INT4:
        h = tl.arange(0, 16)
        b = tl.load(Q + rn64[:, None] * (cols // 2) + g * 16 + h[None, :], mask=nmask[:, None], other=0)
        m = tl.load(Mn + rn64 * groups + g, mask=nmask, other=0.0).to(tl.float32)[:, None]
        return (b & 15).to(tl.float32) * d + m, (b >> 4).to(tl.float32) * d + m
    c = tl.arange(0, 32)
    q = tl.load(Q + rn64[:, None] * cols + g * 32 + c[None, :], mask=nmask[:, None], other=0)
    w = q.to(tl.float32) * d
    return w, w


@triton.jit
def _mm_kernel(X, Q, D, Mn, Y, M, N, K, stride_xm, stride_ym,
               INT4: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               PRECISION: tl.constexpr, DOT_F32: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mmask, nmask = rm < M, rn < N
    groups = K // 32
    xrow = X + rm[:, None].to(tl.int64) * stride_xm
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for g in range(0, groups):
        w_a, w_b = _group_weights(Q, D, Mn, rn, nmask, g, groups, K, INT4)
        w_a, w_b = w_a.to(X.dtype.element_ty), w_b.to(X.dtype.element_ty)  # what the dot multiplies
        if INT4:  # a byte holds value j (low nibble) and j + 16 (high): two dots of 16
            h = tl.arange(0, 16)
            x_a = tl.load(xrow + g * 32 + h[None, :], mask=mmask[:, None], other=0.0)
            x_b = tl.load(xrow + g * 32 + 16 + h[None, :], mask=mmask[:, None], other=0.0)
            if DOT_F32:
                x_a, x_b, w_a, w_b = x_a.to(tl.float32), x_b.to(tl.float32), w_a.to(tl.float32), w_b.to(tl.float32)
            acc = tl.dot(x_a, tl.trans(w_a), acc, input_precision=PRECISION)
            acc = tl.dot(x_b, tl.trans(w_b), acc, input_precision=PRECISION)
        else:
            c = tl.arange(0, 32)
            x = tl.load(xrow + g * 32 + c[None, :], mask=mmask[:, None], other=0.0)
            if DOT_F32:
                x, w_a = x.to(tl.float32), w_a.to(tl.float32)
            acc = tl.dot(x, tl.trans(w_a), acc, input_precision=PRECISION)
    out = Y + rm[:, None].to(tl.int64) * stride_ym + rn[None, :]
    tl.store(out, acc.to(Y.dtype.element_ty), mask=mmask[:, None] & nmask[None, :])


@triton.jit
def _dequant_kernel(Q, D, Mn, W, N, K, INT4: tl.constexpr, BLOCK_N: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    g = tl.program_id(1)
    nmask = rn < N
    w_a, w_b = _group_weights(Q, D, Mn, rn, nmask, g, K // 32, K, INT4)
    row = W + rn[:, None].to(tl.int64) * K + g * 32
    if INT4:
        h = tl.arange(0, 16)
        tl.store(row + h[None, :], w_a.to(W.dtype.element_ty), mask=nmask[:, None])
        tl.store(row + 16 + h[None, :], w_b.to(W.dtype.element_ty), mask=nmask[:, None])
    else:
        c = tl.arange(0, 32)
        tl.store(row + c[None, :], w_a.to(W.dtype.element_ty), mask=nmask[:, None])


def _dot_options(dtype: torch.dtype) -> tuple[str, bool]:
    # The interpreter's tl.dot mangles bfloat16 (numpy has none): there, and only there,
    # bf16 tiles are widened to float32 before the dot. float32 stays float32 (no TF32).
    dot_f32 = dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1"
    return ("ieee" if dtype == torch.float32 or dot_f32 else "tf32"), dot_f32


def _fields(g) -> tuple:
    """q, d, m for the kernels: int8 has no m, which its kernel never reads (d stands in)."""
    return g.q, g.d, (g.m if g.m is not None else g.d)


def dequantize(g, dtype: torch.dtype) -> torch.Tensor:
    """The whole weight widened to `dtype` on its device (one pass of `_dequant_kernel`)."""
    rows, cols = g.shape
    w = torch.empty(rows, cols, dtype=dtype, device=g.q.device)
    _dequant_kernel[(triton.cdiv(rows, BLOCK_N), cols // GROUP)](
        *_fields(g), w, rows, cols, INT4=g.m is not None, BLOCK_N=BLOCK_N)
    return w


def groups_linear(x: torch.Tensor, g, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """F.linear(x, g.dequantize(), bias) for a Groups weight on the GPU, in x's dtype."""
    rows, cols = g.shape
    x2 = x.reshape(-1, cols)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    n = x2.shape[0]
    if n > DEQUANT_ROWS:
        return F.linear(x, dequantize(g, x.dtype), bias)
    y = torch.empty(n, rows, dtype=x.dtype, device=x.device)
    precision, dot_f32 = _dot_options(x.dtype)
    _mm_kernel[(triton.cdiv(n, BLOCK_M), triton.cdiv(rows, BLOCK_N))](
        x2, *_fields(g), y, n, rows, cols, x2.stride(0), y.stride(0),
        INT4=g.m is not None, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, PRECISION=precision, DOT_F32=dot_f32)
    if bias is not None:
        y += bias.to(y.dtype)
    return y.reshape(*x.shape[:-1], rows)
