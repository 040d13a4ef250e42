"""Our own paged attention kernels in Triton: the CUDA fallback where FlashInfer is absent.

Job: per step, copy the plan's CSR arrays (q offsets, each row's read pages) to the
device once; per layer, write the new K/V into their slots (one indexed copy each) and
run two kernels over the pool in the "nhd" layout (`[slots, kv_heads, head_dim]`):
- decode: one program per (decode row, KV head) computes all G query heads of that KV
  head at once, streaming the row's pages block by block with an online softmax;
- extend: one program per (chunk, block of BLOCK_M queries, query head), the same loop
  with a causal + window mask in absolute positions (a chunk on top of adopted pages
  sees them like any earlier position).

Invariants:
- A key at position p of a row lives in slot kv_pages[kv_indptr[row] + (p - kv_start) //
  page_size] * page_size + p % page_size; nothing below kv_start (the first page holding
  a visible position) or past the query is read into the softmax.
- Accumulation in float32; scores scaled by head_dim ** -0.5; output in q's dtype.
- Tested on CPU tensors under TRITON_INTERPRET=1 against the float64 reference
  (tests/test_triton_attention.py); on a GPU by tools/gpu_check.sh.
"""
from __future__ import annotations

import os
from typing import Optional

import numpy as np
import torch
import triton
import triton.language as tl

from ferroxmp.gpu_worker.attention.base import AttentionBackend, StepPlan


@triton.jit
def _key_block(K, V, kv_pages, page_base, kv_start, offs_n, n0, offs_d, kvh, stride_s, stride_h,
               PAGE: tl.constexpr, D: tl.constexpr, n_valid, DOT_F32: tl.constexpr):
    """Load BLOCK_N keys/values of one KV head starting at relative key index n0."""
    rel = n0 + offs_n
    pos = kv_start + rel
    inb = rel < n_valid
    page = tl.load(kv_pages + page_base + rel // PAGE, mask=inb, other=0).to(tl.int64)
    slot = page * PAGE + pos % PAGE
    ptr = slot[:, None] * stride_s + kvh * stride_h + offs_d[None, :]
    dmask = inb[:, None] & (offs_d[None, :] < D)
    k = tl.load(K + ptr, mask=dmask, other=0.0)
    v = tl.load(V + ptr, mask=dmask, other=0.0)
    if DOT_F32:
        k, v = k.to(tl.float32), v.to(tl.float32)
    return k, v, pos, inb


@triton.jit
def _decode_kernel(Q, K, V, O, q_row, q_pos, kv_start, kv_indptr, kv_pages, sm_scale, window,
                   stride_qt, stride_qh, stride_s, stride_h,
                   G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                   PAGE: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr,
                   PRECISION: tl.constexpr, DOT_F32: tl.constexpr):
    row = tl.program_id(0)
    kvh = tl.program_id(1)
    t = tl.load(q_row + row).to(tl.int64)  # this row's token index in q
    qp = tl.load(q_pos + row)
    k0 = tl.load(kv_start + row)
    page_base = tl.load(kv_indptr + row)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kvh * G + offs_g
    qmask = (offs_g[:, None] < G) & (offs_d[None, :] < D)
    q = tl.load(Q + t * stride_qt + heads[:, None] * stride_qh + offs_d[None, :], mask=qmask, other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    n_keys = qp - k0 + 1
    for n0 in range(0, n_keys, BLOCK_N):
        k, v, pos, inb = _key_block(K, V, kv_pages, page_base, k0, offs_n, n0, offs_d, kvh,
                                    stride_s, stride_h, PAGE, D, n_keys, DOT_F32)
        ok = inb
        if HAS_WINDOW:
            ok = ok & (pos > qp - window)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * sm_scale
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(O + t * stride_qt + heads[:, None] * stride_qh + offs_d[None, :], out.to(O.dtype.element_ty), mask=qmask)


@triton.jit
def _extend_kernel(Q, K, V, O, q_begin, q_len, q_start, kv_start, kv_indptr, kv_pages, sm_scale, window,
                   stride_qt, stride_qh, stride_s, stride_h,
                   G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr,
                   PRECISION: tl.constexpr, DOT_F32: tl.constexpr):
    row = tl.program_id(0)
    mblk = tl.program_id(1)
    h = tl.program_id(2)
    kvh = h // G
    n_q = tl.load(q_len + row)
    if mblk * BLOCK_M >= n_q:
        return
    t0 = tl.load(q_begin + row).to(tl.int64)
    p0 = tl.load(q_start + row)
    k0 = tl.load(kv_start + row)
    page_base = tl.load(kv_indptr + row)
    offs_m = mblk * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    m_ok = offs_m < n_q
    qpos = p0 + offs_m
    qmask = m_ok[:, None] & (offs_d[None, :] < D)
    qptr = (t0 + offs_m)[:, None] * stride_qt + h * stride_qh + offs_d[None, :]
    q = tl.load(Q + qptr, mask=qmask, other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    last = tl.minimum(p0 + (mblk + 1) * BLOCK_M, p0 + n_q) - 1  # this block's last query position
    n_keys = last - k0 + 1
    lo = 0
    if HAS_WINDOW:  # skip whole key blocks below every query's window
        lo = tl.maximum(p0 + mblk * BLOCK_M - window + 1 - k0, 0) // BLOCK_N * BLOCK_N
    for n0 in range(lo, n_keys, BLOCK_N):
        k, v, pos, inb = _key_block(K, V, kv_pages, page_base, k0, offs_n, n0, offs_d, kvh,
                                    stride_s, stride_h, PAGE, D, n_keys, DOT_F32)
        ok = inb[None, :] & (pos[None, :] <= qpos[:, None])
        if HAS_WINDOW:
            ok = ok & (pos[None, :] > qpos[:, None] - window)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * sm_scale
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a padded query row sees nothing
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(O + qptr, out.to(O.dtype.element_ty), mask=qmask)


def padded_decode_arrays(step: StepPlan, size: int, pad_page: int) -> dict[str, np.ndarray]:
    """The kernels' per-step arrays for a decode-only step of n rows padded to `size`:
    padding row i (n <= i < size) is one token at position 0 reading and writing slot 0
    of `pad_page`; the real rows' entries are the plan's."""
    n, ps = step.n_decode, step.page_size
    assert n == len(step.rows) and n <= size, "only decode-only steps are padded"
    counts = np.concatenate([np.diff(step.kv_indptr), np.ones(size - n, np.int64)])
    return {"write_slots": np.concatenate([step.write_slots, np.full(size - n, pad_page * ps)]).astype(np.int64),
            "q_begin": np.arange(size, dtype=np.int32), "q_len": np.ones(size, np.int32),
            "q_start": np.concatenate([step.starts, np.zeros(size - n, np.int64)]).astype(np.int32),
            "kv_start": np.concatenate([step.kv_start, np.zeros(size - n, np.int64)]).astype(np.int32),
            "kv_indptr": np.concatenate([[0], np.cumsum(counts)]).astype(np.int32),
            "kv_pages": np.concatenate([step.kv_pages, np.full(size - n, pad_page)]).astype(np.int32)}


def _pow2(n: int, floor: int = 16) -> int:
    return max(floor, triton.next_power_of_2(n))


class TritonBackend(AttentionBackend):
    name = "triton"
    BLOCK_M = 16

    def __init__(self, kv, window: Optional[int], num_heads: Optional[int] = None):
        if kv.layout != "nhd":
            raise ValueError("the triton backend needs the KV pool in the 'nhd' layout")
        super().__init__(kv, window, num_heads)
        self.t: dict[str, torch.Tensor] = {}
        self.max_chunk = 0

    def prepare(self, step: StepPlan) -> None:
        b = step.n_decode
        qi = step.q_indptr

        def dev(a, dtype=torch.int32) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(a)).to(dtype).to(self.kv.device, non_blocking=True)
        self.t = {"write_slots": dev(step.write_slots, torch.int64), "q_begin": dev(qi[:-1]),
                  "q_len": dev(step.lengths), "q_start": dev(step.starts), "kv_start": dev(step.kv_start),
                  "kv_indptr": dev(step.kv_indptr), "kv_pages": dev(step.kv_pages)}
        self.n_decode, self.n_rows = b, len(step.rows)
        self.max_chunk = int(step.lengths[b:].max()) if self.n_rows > b else 0

    def enable_padding(self, max_rows: int, max_pages: int, pad_page: int) -> None:
        """Static per-step tensors for decode steps replayed from CUDA graphs (`cuda_graphs.py`):
        up to `max_rows` rows reading up to `max_pages` pages in all; padding rows read and
        write only `pad_page`, a page the KV pool has past the scheduler's pages."""
        self.pad_page = pad_page
        dev = self.kv.device
        self.static = {name: torch.zeros(n, dtype=dtype, device=dev) for name, n, dtype in (
            ("write_slots", max_rows, torch.int64), ("q_begin", max_rows, torch.int32),
            ("q_len", max_rows, torch.int32), ("q_start", max_rows, torch.int32),
            ("kv_start", max_rows, torch.int32), ("kv_indptr", max_rows + 1, torch.int32),
            ("kv_pages", max_pages + max_rows, torch.int32))}

    def prepare_padded(self, step: StepPlan, size: int, stager) -> None:
        """A decode-only step padded to `size` rows, in the static tensors (copied in place:
        a captured graph keeps reading the same addresses)."""
        arrays = padded_decode_arrays(step, size, self.pad_page)
        for name, a in arrays.items():
            stager.copy(name, self.static[name], a)
        n = {"kv_pages": len(self.static["kv_pages"]), "kv_indptr": size + 1}
        self.t = {name: buf[:n.get(name, size)] for name, buf in self.static.items()}
        self.n_decode = self.n_rows = size
        self.max_chunk = 0

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        kv, t = self.kv, self.t
        K, V = kv.k[layer], kv.v[layer]  # [slots, KVH, D]
        K.index_copy_(0, t["write_slots"], k)
        V.index_copy_(0, t["write_slots"], v)
        q = q.contiguous()
        out = torch.empty_like(q)
        heads, kvh, dim = q.shape[1], kv.num_kv_heads, kv.head_dim
        G = heads // kvh
        scale = dim ** -0.5
        win = self.window or 0
        # The interpreter's tl.dot mangles bfloat16 (numpy has none): there, and only there,
        # bf16 tiles are widened to float32 before the dot. On a GPU the dot stays bf16.
        dot_f32 = q.dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1"
        prec = "ieee" if q.dtype == torch.float32 or dot_f32 else "tf32"
        block_n = max(16, kv.page_size)
        common = dict(D=dim, BLOCK_D=_pow2(dim), PAGE=kv.page_size, BLOCK_N=block_n,
                      HAS_WINDOW=self.window is not None, PRECISION=prec, DOT_F32=dot_f32)
        if self.n_decode:
            b = self.n_decode
            _decode_kernel[(b, kvh)](q, K, V, out, t["q_begin"][:b], t["q_start"][:b], t["kv_start"][:b],
                                     t["kv_indptr"], t["kv_pages"], scale, win,
                                     q.stride(0), q.stride(1), K.stride(0), K.stride(1),
                                     G=G, BLOCK_G=_pow2(G), **common)
        if self.n_rows > self.n_decode:
            b, n = self.n_decode, self.n_rows - self.n_decode
            grid = (n, triton.cdiv(self.max_chunk, self.BLOCK_M), heads)
            _extend_kernel[grid](q, K, V, out, t["q_begin"][b:], t["q_len"][b:], t["q_start"][b:],
                                 t["kv_start"][b:], t["kv_indptr"][b:], t["kv_pages"], scale, win,
                                 q.stride(0), q.stride(1), K.stride(0), K.stride(1),
                                 G=G, BLOCK_M=self.BLOCK_M, **common)
        return out
