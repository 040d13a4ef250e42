"""PageDecode: the decode rows of an eager CPU step attended in one native call over
their pages in the pool (quant/fused_decode.c's `decode_attention`, the attention the
fused step runs).

Job: what the decode mirror did for an eager step (a prefill chunk beside decoding
rows, a batch past the fused step's 16 rows) without a second copy of the rows' K/V:
the mirror had to be refilled from the pool for every row a fused step had advanced
(a whole context per row: ~200 MB for 16 rows of SmolLM2 at 300 positions) and held
that copy until the worker went idle. Reads a float32 or float16 pool.

Invariants: the pool never moves (its addresses are kept in one ctypes struct); the
step's K/V are in the pool before `__call__` (attention/cpu.py writes them first);
only for models without a sliding window (every row reads from position 0), computing
in float32.
"""
from __future__ import annotations

import ctypes
from ctypes import c_int
from typing import Optional

import torch

from ferroxmp.gpu_worker.quant.fused_decode import _Model
from ferroxmp.gpu_worker.quant.native import available, library, ptr


class PageDecode:
    def __init__(self, kv):
        self.kv, self.fn = kv, library().decode_attention
        # Only the head geometry (query heads: set per call, from q) and the pool are read.
        self.m = _Model(kv.num_layers, 0, kv.num_kv_heads, kv.head_dim, 0, 0, 0.0, None,
                        kv.k.data_ptr(), kv.v.data_ptr(), kv.num_slots, kv.page_size,
                        int(kv.dtype == torch.float16))
        self._scratch = torch.empty(0)

    @classmethod
    def build(cls, kv, window: Optional[int], dtype: torch.dtype) -> Optional["PageDecode"]:
        """A PageDecode for this pool, or None where it cannot serve (the caller keeps
        the decode mirror): a sliding window, a model not computing in float32, a pool
        neither float32 nor float16, or no native kernels."""
        if (window is not None or dtype != torch.float32 or kv.dtype not in (torch.float32, torch.float16)
                or kv.device.type != "cpu" or kv.layout != "hnd" or available() is not None):
            return None
        return cls(kv)

    def __call__(self, layer: int, q: torch.Tensor, positions: torch.Tensor, page_at: torch.Tensor,
                 pages: torch.Tensor, span: int) -> torch.Tensor:
        """q [R, heads, head_dim] float32 -> attention output, same shape. positions: each
        row's new position (int64 [R]; span: their max + 1, the scores' length);
        pages[page_at[r]:page_at[r + 1]]: row r's pages (int64)."""
        rows, self.m.heads = q.shape[0], q.shape[1]
        q = q.contiguous()
        out = torch.empty_like(q)
        need = rows * q.shape[1] * span
        if self._scratch.numel() < need:
            self._scratch = torch.empty(2 * need)
        self.fn(ctypes.byref(self.m), c_int(layer), c_int(rows), ptr(q), ptr(out), ptr(positions), ptr(page_at),
                ptr(pages), ptr(self._scratch))
        return out
