"""The KV page pool tensors, and how many pages fit in the memory budget.

Job: own K and V for every layer on the model's device; page p of every layer is the
same page (a page group). Two layouts, chosen by the attention backend:
- "nhd": `[layers, slots, kv_heads, head_dim]`, i.e. per layer `[num_pages, page_size,
  kv_heads, head_dim]` (FlashInfer's NHD paged layout; our Triton kernels read it too);
- "hnd": `[layers, kv_heads, slots, head_dim]`: each head's positions of a page are one
  contiguous block, so the CPU path gathers a row's pages per head with large copies and
  hands SDPA `[kv_heads, positions, head_dim]` without a transpose.

Invariants:
- Slot s = page * page_size + offset addresses one token's K/V in every layout;
  `slots_view(layer)` is `[slots, kv_heads, head_dim]` in both (a view, strided for hnd).
- The pool never frees or allocates pages: which page holds what is the scheduler's
  business (shared page table); this class only stores bytes.
- Every sizing failure names what it sized: 2 (K, V) x layers x tokens x kv heads x
  head_dim x dtype bytes (`kv_sizing`), never only "out of memory".
"""
from __future__ import annotations

import logging
import math
import mmap
from dataclasses import dataclass, field
from typing import Optional

import torch

from ferroxmp.gpu_worker.loader import ModelConfig

log = logging.getLogger("ferroxmp.kv_pool")


def kv_sizing(layers: int, tokens: int, kv_heads: int, head_dim: int, itemsize: int) -> str:
    """'2 (K, V) x 30 layers x 8192 tokens x 3 kv heads x 64 head_dim x 2 bytes = 0.18 GiB'."""
    total = 2 * layers * tokens * kv_heads * head_dim * itemsize  # Python ints: no overflow
    return (f"2 (K, V) x {layers} layers x {tokens} tokens x {kv_heads} kv heads x {head_dim} head_dim x "
            f"{itemsize} bytes = {total / 2**30:.3g} GiB")


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor; on CPU an anonymous mapping, whose pages the kernel supplies as zeros
    when first touched: a pool sized for --kv-cache-gb costs resident memory only for the
    pages the load has written (torch.zeros writes every byte at start)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = math.prod(shape) * itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    # The tensor keeps the mapping alive (frombuffer holds the buffer); no file behind it.
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(shape)


def available_memory() -> Optional[int]:
    """Bytes the kernel says can be allocated without swapping (MemAvailable), or None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


@dataclass
class KVPool:
    num_pages: int
    page_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    layout: str = "nhd"
    k: torch.Tensor = field(init=False, repr=False)  # [layers, slots, kv_heads, head_dim]
    v: torch.Tensor = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.layout not in ("nhd", "hnd"):
            raise ValueError(f"unknown KV layout {self.layout!r}")
        shape = self.shape
        # Zeros, not empty: a padded read of a never-written slot must be finite, or a
        # masked-out NaN would still poison softmax (0 * NaN).
        try:
            # Written lazily on CPU (zeros()), so the machine's memory is checked here, not
            # by the OOM killer under load once the pages fill.
            available = available_memory() if self.device.type == "cpu" else None
            asked = 2 * math.prod(shape) * torch.empty((), dtype=self.dtype).element_size()
            if available is not None and asked > available:
                raise MemoryError(f"{asked / 2**30:.3g} GiB asked, the machine has "
                                  f"{available / 2**30:.3g} GiB available (MemAvailable)")
            self.k = zeros(shape, self.dtype, self.device)
            self.v = zeros(shape, self.dtype, self.device)
        except (RuntimeError, MemoryError, OSError) as e:  # torch.OutOfMemoryError is a RuntimeError
            itemsize = torch.empty((), dtype=self.dtype).element_size()
            sized = kv_sizing(self.num_layers, self.num_slots, self.num_kv_heads, self.head_dim, itemsize)
            raise RuntimeError(f"cannot allocate the KV pool on {self.device} ({self.num_pages} pages of "
                               f"{self.page_size} tokens: {sized}): {str(e).splitlines()[0][:200]}; lower "
                               "--kv-pages / --kv-cache-gb / --mem-fraction") from None

    @classmethod
    def for_model(cls, cfg: ModelConfig, num_pages: int, page_size: int, device: torch.device,
                  layout: str = "nhd") -> "KVPool":
        """The pool of `cfg`'s KV geometry, storing `cfg.cache_dtype` (--kv-cache-dtype)."""
        return cls(num_pages, page_size, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.cache_dtype,
                   device, layout)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        if self.layout == "hnd":
            return (self.num_layers, self.num_kv_heads, self.num_slots, self.head_dim)
        return (self.num_layers, self.num_slots, self.num_kv_heads, self.head_dim)

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def slots_view(self, layer: int, which: str = "k") -> torch.Tensor:
        """[slots, kv_heads, head_dim] view of one layer, whatever the layout."""
        t = (self.k if which == "k" else self.v)[layer]
        return t.transpose(0, 1) if self.layout == "hnd" else t

    def fill_page(self, page: int, value: float) -> None:
        """Overwrite one page of every layer, K and V (tests: poison a page never to be read)."""
        span = slice(page * self.page_size, (page + 1) * self.page_size)
        for t in (self.k, self.v):
            if self.layout == "hnd":
                t[:, :, span] = value
            else:
                t[:, span] = value

    def check_integrity(self) -> None:
        assert self.k.shape == self.v.shape == self.shape
        assert self.k.is_contiguous() and self.v.is_contiguous()


def check_cache_dtype(cfg: ModelConfig, device: torch.device, deterministic: bool = False) -> None:
    """Refuse a --kv-cache-dtype other than the model's where no backend stores it: the
    CPU backend (attention/cpu.py) and the fused decode step store float16/bfloat16 and
    widen what they read; CUDA's kernels and the --deterministic backend read the pool in
    the model's dtype."""
    if cfg.kv_dtype is None or cfg.kv_dtype == cfg.dtype:
        return
    where = ("on CUDA (its attention kernels read the pool in the model's dtype)" if device.type != "cpu" else
             "with --deterministic (its attention reads the pool in the model's dtype)" if deterministic else None)
    if where is None and cfg.kv_dtype.itemsize >= cfg.dtype.itemsize:
        where = f"not narrower than the model's {cfg.dtype_name} (no memory saved, range or precision lost)"
    if where is not None:
        raise ValueError(f"--kv-cache-dtype {cfg.cache_dtype_name} is not supported {where}; "
                         f"use --kv-cache-dtype auto")


def pages_for_budget(cfg: ModelConfig, page_size: int, kv_pages: Optional[int],
                     kv_cache_gb: float, mem_fraction: float, device: torch.device,
                     reserved_bytes: int = 0, context: Optional[int] = None, draft_bytes_per_token: int = 0) -> int:
    """Pages that fit: an explicit --kv-pages wins; on CPU --kv-cache-gb; on CUDA
    mem_fraction of the free device memory, less `reserved_bytes` (weights not loaded yet).
    A page costs the model's KV of page_size tokens plus a --draft-model's
    (`draft_bytes_per_token`: the draft keeps its KV in the same pages).
    A budget under two pages is an error, one under `context` tokens (default: the
    model's) a warning; both name the sizing of one page and of one context."""
    if kv_pages is not None:
        return int(kv_pages)
    itemsize = cfg.cache_dtype.itemsize
    per_page = (cfg.kv_bytes_per_token() + draft_bytes_per_token) * page_size
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = mem_fraction * free - reserved_bytes
    else:
        budget = kv_cache_gb * (1 << 30)
    pages = max(0, int(budget // per_page))
    context = context or cfg.max_position_embeddings
    geometry = (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, itemsize)
    one_context = kv_sizing(geometry[0], context, *geometry[1:])
    if pages < 2:
        raise RuntimeError(f"the KV budget ({budget / 2**30:.3g} GiB) holds {pages} pages of {page_size} "
                           f"tokens (a page: {kv_sizing(geometry[0], page_size, *geometry[1:])}); one full "
                           f"context takes {one_context}; raise --kv-cache-gb / --mem-fraction or pass --kv-pages")
    if pages * page_size < context:
        log.warning("the KV pool (%d pages = %d tokens) holds less than one full context: %s; longer "
                    "requests are refused (raise --kv-cache-gb / --mem-fraction, or lower --max-model-len)",
                    pages, pages * page_size, one_context)
    return pages
