"""The CUDA attention backend on FlashInfer (`flashinfer-python`), when it is installed.

Job: per step, plan FlashInfer's two wrappers once (paged decode for the length-1 rows,
paged prefill for the chunks: their `plan()` does the scheduling and copies the CSR
arrays to the device); per layer, write the step's K/V into their slots and `run()` each
wrapper over the pool in the NHD layout (`[num_pages, page_size, kv_heads, head_dim]`).

Invariants (FlashInfer's conventions, mapped from ours):
- A row's KV is the page list from its first visible page (`first_page`), so its kv
  length is `start + length - kv_start`; the last page holds `kv_len - (pages - 1) *
  page_size` positions (1..page_size).
- Causal prefill aligns queries to the END of the row's kv (bottom-right): query i of a
  chunk is at relative position kv_len - length + i = start - kv_start + i, ours exactly,
  for chunks from 0 and on top of adopted pages alike.
- Our window W (key k visible iff k > q - W) is FlashInfer's window_left = W - 1
  (k >= q - window_left); -1 when there is none. RoPE is applied by the model
  (pos_encoding_mode "NONE"); sm_scale is head_dim ** -0.5.
- Written against FlashInfer's documented wrapper API; never run on this project's
  CPU machines (tools/gpu_check.sh checks it against the reference on a GPU).
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from ferroxmp.gpu_worker.attention.base import AttentionBackend, StepPlan

WORKSPACE_BYTES = 128 << 20  # FlashInfer's documented default for its split-k scratch


class FlashInferBackend(AttentionBackend):
    name = "flashinfer"

    def __init__(self, kv, window: Optional[int], num_heads: Optional[int] = None):
        import flashinfer  # import-guarded: only constructed on CUDA with flashinfer installed
        if kv.layout != "nhd":
            raise ValueError("the flashinfer backend needs the KV pool in the 'nhd' layout")
        if kv.device.type != "cuda":
            raise ValueError("flashinfer runs on CUDA only")
        if not num_heads:
            raise ValueError("the flashinfer backend plans with the number of query heads")
        super().__init__(kv, window, num_heads)
        self.window_left = -1 if window is None else window - 1

        def workspace() -> torch.Tensor:
            return torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=kv.device)
        # Tensor cores pay off for decode from GQA groups of 4 (FlashInfer's advice).
        self.decode_wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            workspace(), "NHD", use_tensor_cores=num_heads // kv.num_kv_heads >= 4)
        self.prefill_wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace(), "NHD")
        self.write_slots: Optional[torch.Tensor] = None
        self.n_decode = self.n_rows = 0

    def prepare(self, step: StepPlan) -> None:
        kv, ps = self.kv, step.page_size
        self.write_slots = torch.from_numpy(step.write_slots).to(kv.device, non_blocking=True)
        b, R = step.n_decode, len(step.rows)
        self.n_decode, self.n_rows = b, R
        counts = np.diff(step.kv_indptr)
        last_len = (step.kv_lens - (counts - 1) * ps).astype(np.int32)

        def host(a: np.ndarray) -> torch.Tensor:  # plan() reads these on the host; pinned for the copy
            return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32)).pin_memory()
        common = dict(num_qo_heads=self.num_heads, num_kv_heads=kv.num_kv_heads, page_size=ps,
                      window_left=self.window_left, q_data_type=kv.dtype, kv_data_type=kv.dtype,
                      sm_scale=kv.head_dim ** -0.5)
        if b:
            p = int(step.kv_indptr[b])
            self.decode_wrapper.plan(host(step.kv_indptr[:b + 1]), host(step.kv_pages[:p]).to(kv.device),
                                     host(last_len[:b]), head_dim=kv.head_dim, pos_encoding_mode="NONE",
                                     **common)
        if R > b:
            p0 = int(step.kv_indptr[b])
            qo = step.q_indptr[b:] - step.q_indptr[b]
            self.prefill_wrapper.plan(host(qo), host(step.kv_indptr[b:] - p0),
                                      host(step.kv_pages[p0:]).to(kv.device), host(last_len[b:]),
                                      head_dim_qk=kv.head_dim, causal=True, pos_encoding_mode="NONE", **common)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        kv = self.kv
        K, V = kv.k[layer], kv.v[layer]  # [slots, KVH, D]
        K.index_copy_(0, self.write_slots, k)
        V.index_copy_(0, self.write_slots, v)
        shape = (kv.num_pages, kv.page_size, kv.num_kv_heads, kv.head_dim)
        cache = (K.view(shape), V.view(shape))
        b = self.n_decode
        outs = []
        if b:
            outs.append(self.decode_wrapper.run(q[:b].contiguous(), cache))
        if self.n_rows > b:
            outs.append(self.prefill_wrapper.run(q[b:].contiguous(), cache))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)
