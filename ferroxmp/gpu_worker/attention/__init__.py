"""Picks the attention backend for a device: `make_backend` and `backend_layout`.

The interface (AttentionBackend, StepPlan, plan_step, the float64 reference) lives in
attention/base.py, which the backends (cpu, deterministic, triton_backend, flashinfer_backend)
import; it is re-exported here so callers keep one import path. The factory imports
each backend only when it is chosen (Triton and FlashInfer are optional), and no
backend imports this module, so the two never form an import cycle.
"""
from __future__ import annotations

from typing import Optional

import torch

from ferroxmp.gpu_worker.attention.base import AttentionBackend, PlanError, StepPlan, plan_step, reference_attention  # noqa: F401


def make_backend(kv, window: Optional[int], device: torch.device, name: str = "auto",
                 num_heads: Optional[int] = None, dtype: Optional[torch.dtype] = None,
                 native_decode: bool = False) -> AttentionBackend:
    """auto: FlashInfer on CUDA when installed, else our Triton kernels on CUDA; torch on CPU.
    `kv` must have been created with `backend_layout(device, name)`; `dtype`: the model's,
    when the pool stores another (--kv-cache-dtype, torch backend only); `native_decode`:
    the torch backend attends decode rows in one native call over the pool's pages
    (attention/page_decode.py) where it can, instead of keeping a decode mirror."""
    if name == "auto":
        name = "torch" if device.type != "cuda" else ("flashinfer" if _has("flashinfer") else "triton")
    if name == "torch":
        from ferroxmp.gpu_worker.attention.cpu import TorchBackend
        return TorchBackend(kv, window, num_heads, dtype, native_decode)
    if name == "det":  # --deterministic: bits independent of batch and chunking (attention/deterministic.py)
        from ferroxmp.gpu_worker.attention.deterministic import DeterministicBackend
        return DeterministicBackend(kv, window, num_heads)
    if name == "triton":
        from ferroxmp.gpu_worker.attention.triton_backend import TritonBackend
        return TritonBackend(kv, window, num_heads)
    if name == "flashinfer":
        from ferroxmp.gpu_worker.attention.flashinfer_backend import FlashInferBackend
        return FlashInferBackend(kv, window, num_heads)
    raise ValueError(f"unknown attention backend {name!r} (auto, torch, det, triton, flashinfer)")


def backend_layout(device: torch.device, name: str = "auto") -> str:
    """KV layout the chosen backend reads: 'hnd' (torch, det: per head, contiguous slots) or
    'nhd' (triton, flashinfer: [pages, page_size, heads, dim])."""
    if name == "auto":
        name = "torch" if device.type != "cuda" else "gpu"
    return "hnd" if name in ("torch", "det") else "nhd"


def _has(module: str) -> bool:
    import importlib.util
    return importlib.util.find_spec(module) is not None
