"""How much CUDA memory the KV pool gets from --mem-fraction, measured after loading, logged.

Job: `--mem-fraction` of the device memory free when the worker starts is for this
worker's weights, its activations and the KV pool. With one rank the worker loads the
weights over a small pool, runs the largest step the scheduler may send
(`profile_lengths`) and reads both terms off the allocator (`measure`): the pool gets
what is left. Under --tp the ranks agree on a size before loading, so there the terms
are the checkpoint's byte count and `activation_bytes`, an upper estimate. `KVBudget`
keeps every term so the log line shows the arithmetic.

Not in the profile: the decode CUDA graphs' private pools (captured after the pool is
attached) and attention scratch that grows with context rather than with the step's
tokens (the torch backend's gather of long rows; FlashInfer and the Triton kernels read
pages in place). `--mem-fraction` below 1 leaves the room for them.
"""
from __future__ import annotations

from dataclasses import dataclass

GiB = float(1 << 30)


@dataclass
class KVBudget:
    free_at_start: int  # bytes free on the device before this worker allocated anything
    mem_fraction: float
    weights: int  # bytes of this worker's weights
    activations: int  # upper estimate of one step's scratch
    bytes_per_page: int
    measured: bool = False  # weights and activations read off the allocator, not estimated

    @property
    def kv_bytes(self) -> int:
        return max(0, int(self.mem_fraction * self.free_at_start) - self.weights - self.activations)

    @property
    def pages(self) -> int:
        return self.kv_bytes // self.bytes_per_page

    def describe(self) -> str:
        return (f"KV pool {self.pages} pages ({self.kv_bytes / GiB:.2f} GiB) = {self.mem_fraction} x "
                f"{self.free_at_start / GiB:.2f} GiB free - weights {self.weights / GiB:.2f} GiB - "
                f"activations {self.activations / GiB:.2f} GiB "
                f"({'measured after loading' if self.measured else 'estimated before loading'})")


def activation_bytes(hidden: int, qkv_width: int, intermediate: int, vocab: int, max_batch_tokens: int,
                     max_rows: int, dtype_bytes: int) -> int:
    """An upper estimate of one step's scratch: per token the residual, norm output, q/k/v,
    attention output and gate/up (x2 for the temporaries between them), and float32 logits
    of every sampling row three times (logits, their log-softmax, the sampler's sort)."""
    per_token = (3 * hidden + qkv_width + hidden + 2 * intermediate + intermediate) * dtype_bytes
    return 2 * max_batch_tokens * per_token + 3 * max_rows * vocab * 4


def cuda_kv_budget(shape, dtype, page_size: int, mem_fraction: float, max_batch_tokens: int,
                   max_rows: int, weights: int, device) -> KVBudget:
    """The budget on this device now (call before loading anything). `shape` is the
    ModelConfig of this worker's share of the model."""
    import torch
    free, _ = torch.cuda.mem_get_info(device)
    size = torch.tensor([], dtype=dtype).element_size()
    act = activation_bytes(shape.hidden_size, (shape.num_heads + 2 * shape.num_kv_heads) * shape.head_dim,
                           shape.intermediate_size, shape.vocab_size, max_batch_tokens, max_rows, size)
    return KVBudget(free, mem_fraction, weights, act, shape.kv_bytes_per_token(dtype) * page_size)


def after_load(device) -> str:
    """What the worker holds once weights and KV pool are allocated (the log line after sizing)."""
    import torch
    free, total = torch.cuda.mem_get_info(device)
    return (f"after loading: this worker holds {torch.cuda.memory_allocated(device) / GiB:.2f} GiB "
            f"(reserved {torch.cuda.memory_reserved(device) / GiB:.2f} GiB); the device has "
            f"{free / GiB:.2f} of {total / GiB:.2f} GiB free")


def profile_lengths(max_batch_tokens: int, max_rows: int, max_len: int) -> list[int]:
    """Rows of the largest step the scheduler may send: --max-batch-tokens split over as
    many rows as may run (each samples, so the logits are as wide as they get), none
    longer than the model's context."""
    rows = max(1, min(max_rows, max_batch_tokens))
    base, extra = divmod(max_batch_tokens, rows)
    lengths = [min(max_len, base + (r < extra)) for r in range(rows)]
    return [n for n in lengths if n > 0]


def profile_pages(lengths: list[int], page_size: int) -> int:
    return sum(-(-n // page_size) for n in lengths)


def measure(runner, lengths: list[int], free_at_start: int, mem_fraction: float) -> KVBudget:
    """Run the profiling step on `runner` (weights loaded, a pool of profile_pages) and
    read the weights and the step's peak scratch off the CUDA allocator."""
    import torch
    device = runner.device
    torch.cuda.synchronize(device)
    held = torch.cuda.memory_allocated(device)  # weights + the small KV pool
    torch.cuda.reset_peak_memory_stats(device)
    runner.profile_step(lengths)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - held
    bytes_per_page = runner.kv_bytes // runner.kv.num_pages  # a --draft-model's KV included
    return KVBudget(free_at_start, mem_fraction, held - runner.kv_bytes, peak, bytes_per_page, measured=True)
