"""RowGlue: an eager step's row-wise work between the matmuls (RMSNorm, RoPE, SiLU-mul) as
fused_decode.c's own loops, for a float32 model on CPU.

Job: DecoderLM calls these instead of torch's ops when the runner sets `model.glue` (CPU,
float32, the native kernels built, not --deterministic or --disable-fused-decode). Why:
torch spends 3-6 passes over the activations on each (RMSNorm: square, mean, rsqrt,
two multiplies; RoPE: negate, concatenate, two multiplies, add; SiLU-mul: a scalar exp
per value, then a multiply): ~9% of a 256-token prefill of SmolLM2 (docs/BENCHMARKS.md
24); one loop per row here, the exponential in float lanes.

Invariants: the formulas of models/llama.py (RMSNorm: w * (x * 1/sqrt(mean(x^2) + eps));
RoPE: x * cos + rotate_half(x) * sin from the model's own tables; silu(g) * u), summed in
another order: results within float32 rounding of torch's, not to the bit
(tests/test_glue.py). Each row is computed alone (no dependence on the other rows).
"""
from __future__ import annotations

import ctypes

import torch

from ferroxmp.gpu_worker.quant.native import library, ptr


class RowGlue:
    def __init__(self, cos_table: torch.Tensor, sin_table: torch.Tensor):
        self.lib = library()
        self.cos, self.sin = cos_table.contiguous(), sin_table.contiguous()

    def rms(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm over the last dimension of x (rows may be strided), times w."""
        n = x.shape[-1]
        x2 = x.reshape(-1, n)  # a view where the rows allow it (h), else a copy (a q/k head view)
        if x2.stride(1) != 1 or x2.stride(0) < n:
            x2 = x2.contiguous()
        out = torch.empty(x2.shape[0], n)
        self.lib.rows_rms(x2.shape[0], n, ptr(x2), ctypes.c_int64(x2.stride(0)), ptr(w), ctypes.c_float(eps),
                          ptr(out))
        return out.reshape(x.shape)

    def rope_(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """RoPE in place on x [T, heads, head_dim] (heads contiguous in a row; rows may be
        strided: q and k are views of the fused qkv output). pos: int64 [T], contiguous
        (converted once per step by the caller, not per layer)."""
        t, heads, d = x.shape
        assert x.stride(2) == 1 and x.stride(1) == d, "rope_ needs each row's heads contiguous"
        self.lib.rows_rope(t, heads, d, ptr(x), ctypes.c_int64(x.stride(0)), ptr(self.cos), ptr(self.sin), ptr(pos))
        return x

    def silu_mul(self, gu: torch.Tensor) -> torch.Tensor:
        """gu [T, 2I] (gate then up) -> silu(gate) * up [T, I]."""
        gu = gu.contiguous()
        out = torch.empty(gu.shape[0], gu.shape[1] // 2)
        self.lib.rows_silu_mul(gu.shape[0], out.shape[1], ptr(gu), ptr(out))
        return out
