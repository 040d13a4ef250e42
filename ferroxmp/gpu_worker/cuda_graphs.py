"""Decode steps replayed from CUDA graphs, one graph per padded batch size (CUDA only).

Job: a decode-only step of n rows runs as the graph captured for the smallest size >= n
(`graph_batch_sizes`), captured on first use: inputs are copied from pinned host buffers
into static device buffers without a sync, the attention backend fills its static
per-step tensors (`prepare_padded`), the graph replays the whole model forward, and the
runner reads the first n rows of the static output. Launch overhead of ~30 layers x
~15 kernels per step is what graphs remove; it dominates small-batch decode on a GPU.

Invariants:
- Padding rows (n..size) read and write only the backend's pad page (one page past the
  scheduler's pool, never in a page table), so they change nothing any row reads.
- Everything a captured graph reads lives in buffers allocated before capture and only
  written in place afterwards; Python values baked into a graph (the batch size, the
  backend's row counts) are fixed per size.
- Only decode-only steps fit; a step with a prefill chunk, or more rows than the largest
  size, runs eagerly. `--disable-cuda-graph` turns this off; CPU never builds it.
Written for a GPU this project has not had yet: the padding arithmetic and the padded
Triton path are tested on CPU (tests/test_triton_attention.py); capture and replay are
exercised only by tools/gpu_check.sh.
"""
from __future__ import annotations

import bisect
import logging
from typing import Optional

import numpy as np
import torch

log = logging.getLogger("ferroxmp.worker")
LARGEST = 256  # beyond this, a decode step's matmuls dwarf launch overhead


def graph_batch_sizes(max_rows: int, largest: int = LARGEST) -> list[int]:
    """Padded batch sizes to capture: 1, 2, 4, 8, then every 16 up to min(max_rows,
    largest), plus that bound itself; at most 1/16 of the rows are padding beyond 16."""
    top = max(1, min(max_rows, largest))
    sizes = [s for s in (1, 2, 4, 8) if s < top] + list(range(16, top, 16)) + [top]
    return sorted(set(sizes))


def padded_batch_size(n: int, sizes: list[int]) -> Optional[int]:
    """Smallest size >= n, or None when n is larger than every size (run eagerly)."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if n > 0 and i < len(sizes) else None


def pad_rows(a: np.ndarray, size: int, value: int) -> np.ndarray:
    """`a` followed by `value` up to `size` entries (int64)."""
    return np.concatenate([a.astype(np.int64), np.full(size - len(a), value, np.int64)])


class PinnedStager:
    """Host -> device copies through persistent pinned buffers, without a sync. A buffer
    is reused by the next step: safe because every step ends by reading its sampled ids
    back, which waits for every copy queued before."""

    def __init__(self, pin: bool = True) -> None:
        self.pin = pin  # False: plain host memory (CPU tests; pinning needs CUDA)
        self.host: dict[str, torch.Tensor] = {}

    def copy(self, name: str, dst: torch.Tensor, a: np.ndarray) -> None:
        n = len(a)
        buf = self.host.get(name)
        if buf is None or buf.numel() < n or buf.dtype != dst.dtype:
            buf = self.host[name] = torch.empty(max(n, 64), dtype=dst.dtype)
            if self.pin:
                buf = self.host[name] = buf.pin_memory()
        buf[:n].copy_(torch.from_numpy(np.ascontiguousarray(a)))
        dst[:n].copy_(buf[:n], non_blocking=True)


class DecodeGraphs:
    def __init__(self, model, attn, sizes: list[int], device: torch.device):
        self.model, self.attn, self.sizes = model, attn, sizes
        top = sizes[-1]
        self.ids = torch.zeros(top, dtype=torch.int64, device=device)
        self.positions = torch.zeros(top, dtype=torch.int64, device=device)
        self.stager = PinnedStager()
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.mempool = torch.cuda.graph_pool_handle()  # one pool: sizes share their scratch

    def fits(self, plan) -> bool:
        return plan.decode_only and padded_batch_size(plan.n_decode, self.sizes) is not None

    def forward(self, plan, ids: np.ndarray) -> torch.Tensor:
        """The step's final hidden states [n, hidden] (a view of the graph's static output)."""
        n = plan.n_decode
        size = padded_batch_size(n, self.sizes)
        self.attn.prepare_padded(plan, size, self.stager)
        self.stager.copy("ids", self.ids, pad_rows(ids, size, 0))
        self.stager.copy("positions", self.positions, pad_rows(plan.positions, size, 0))
        if size not in self.graphs:
            self._capture(size)
        graph, out = self.graphs[size]
        graph.replay()
        return out[:n]

    def _capture(self, size: int) -> None:
        """Warm up on a side stream (Triton compiles, the allocator settles), then capture.
        The warm-up writes this step's K/V into its slots: the same values replay writes."""
        ids, pos = self.ids[:size], self.positions[:size]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self.model.forward(ids, pos, self.attn)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.mempool):
            out = self.model.forward(ids, pos, self.attn)
        self.graphs[size] = (graph, out)
        log.info("captured a CUDA graph for decode batches of %d rows (%d graphs)", size, len(self.graphs))
