"""The KV page pool tensors, and how many pages fit in the memory budget.

Job: own K and V for every layer, `[num_pages, page_size, kv_heads, head_dim]` each, on
the model's device; page p of every layer is the same page (a page group).

Invariants:
- Slot s = page * page_size + offset addresses one token's K/V; `k_slots(layer)` and
  `v_slots(layer)` are views `[num_pages * page_size, kv_heads, head_dim]` of the same
  storage, so one indexed write or read moves a whole step's tokens.
- The pool never frees or allocates pages: which page holds what is the scheduler's
  business (shared page table); this class only stores bytes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from .loader import ModelConfig


@dataclass
class KVPool:
    num_pages: int
    page_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    k: torch.Tensor = field(init=False, repr=False)  # [layers, slots, kv_heads, head_dim]
    v: torch.Tensor = field(init=False, repr=False)

    def __post_init__(self) -> None:
        shape = (self.num_layers, self.num_slots, self.num_kv_heads, self.head_dim)
        # Zeros, not empty: a padded read of a never-written slot must be finite, or a
        # masked-out NaN would still poison softmax (0 * NaN).
        self.k = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.v = torch.zeros(shape, dtype=self.dtype, device=self.device)

    @classmethod
    def for_model(cls, cfg: ModelConfig, num_pages: int, page_size: int,
                  dtype: torch.dtype, device: torch.device) -> "KVPool":
        return cls(num_pages, page_size, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype, device)

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def page_view(self, layer: int, which: str = "k") -> torch.Tensor:
        """[num_pages, page_size, kv_heads, head_dim] view of one layer (tests, debugging)."""
        t = self.k if which == "k" else self.v
        return t[layer].view(self.num_pages, self.page_size, self.num_kv_heads, self.head_dim)

    def check_integrity(self) -> None:
        assert self.k.shape == self.v.shape == (self.num_layers, self.num_slots, self.num_kv_heads, self.head_dim)
        assert self.k.is_contiguous() and self.v.is_contiguous()


def pages_for_budget(cfg: ModelConfig, page_size: int, dtype: torch.dtype, kv_pages: Optional[int],
                     kv_cache_gb: float, mem_fraction: float, device: torch.device,
                     reserved_bytes: int = 0) -> int:
    """Pages that fit: an explicit --kv-pages wins; on CPU --kv-cache-gb; on CUDA
    mem_fraction of the free device memory, less `reserved_bytes` (weights not loaded yet)."""
    if kv_pages is not None:
        return int(kv_pages)
    per_page = cfg.kv_bytes_per_token(dtype) * page_size
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = mem_fraction * free - reserved_bytes
    else:
        budget = kv_cache_gb * (1 << 30)
    pages = int(budget // per_page)
    if pages < 2:
        raise RuntimeError(f"the KV budget ({budget / 2**30:.2f} GiB) holds {pages} pages of {page_size} "
                           f"tokens ({per_page} bytes each); raise --kv-cache-gb / --mem-fraction or "
                           f"pass --kv-pages")
    return pages
