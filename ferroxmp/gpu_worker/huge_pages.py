"""WeightArena: a CPU model's weights moved into one region of 2 MiB pages.

Job: after a model is built on CPU, copy every weight tensor it holds (float tensors, the
int4/int8 blocks and scales of quant's forms) into one anonymous mapping that asked the
kernel for transparent huge pages, in the order a step reads them, and point each tensor
there (`t.data = view`: the objects holding them keep their identity).

Why: a decode step streams every weight once, and in 4 KiB pages the CPU takes a TLB
miss every 4 KiB and its prefetchers stop at each page's end. float32 SmolLM2's 30
layers and head through the float32 kernel at one row: -14% from the same bytes in 2 MiB pages
(tools/bench_quant.py --f32-stack; docs/BENCHMARKS.md 27). The kernel's THP mode
"madvise" (a common default) backs a region with huge pages only where it is asked to;
under "never" the region is ordinary pages and nothing else changes. Resident cost: the
last huge page, under 2 MiB.

Invariants: runs before anything records a weight's address (FusedDecode keeps them,
built later by the runner). Copies are bitwise, so outputs do not change. A view of a
part of a storage is left where it is (moving it would make a second copy); tensors
over one whole storage share one place. The arena lives as long as the model (model.weight_arena).
"""
from __future__ import annotations

import logging
import mmap

import torch

from ferroxmp.heap import release_freed_memory

log = logging.getLogger("ferroxmp.worker")

HUGE = 2 << 20  # x86-64's transparent huge page
ALIGN = 64      # each tensor starts on a cache line (the kernels' vector loads)


def _owns_storage(t: torch.Tensor) -> bool:
    return (t.device.type == "cpu" and t.is_contiguous() and t.storage_offset() == 0
            and t.untyped_storage().nbytes() == t.numel() * t.element_size())


def tensors_of(weights: list) -> list[torch.Tensor]:
    """The tensors behind `weights` (tensors, or objects holding them as attributes:
    Int4x16, Groups), each once, in order."""
    out: dict[int, torch.Tensor] = {}
    for w in weights:
        held = getattr(w, "__dict__", {})  # (an object of no tensor attributes, e.g. FBGEMM's packed fp16: none)
        parts = [w] if isinstance(w, torch.Tensor) else [v for v in held.values() if isinstance(v, torch.Tensor)]
        for t in parts:
            out.setdefault(id(t), t)
    return list(out.values())


class WeightArena:
    def __init__(self, tensors: list[torch.Tensor]):
        movable = [t for t in tensors if _owns_storage(t) and t.numel() > 0]
        # One place per storage: two tensors over the same whole storage stay one copy.
        first: dict[int, int] = {}  # storage address -> byte offset in the region
        end = 0
        for t in movable:
            key = t.untyped_storage().data_ptr()
            if key not in first:
                first[key] = end
                end += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
        self.nbytes = end
        self._map = mmap.mmap(-1, end + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        try:  # a kernel built without THP says EINVAL: the region is ordinary pages then
            self._map.madvise(mmap.MADV_HUGEPAGE)
        except (AttributeError, OSError):
            pass
        region = torch.frombuffer(self._map, dtype=torch.uint8)
        skip = -region.data_ptr() % HUGE  # start on a huge page boundary: every 2 MiB of weights one page
        self._region = region[skip:skip + end]
        copied: set[int] = set()
        for t in movable:
            key, n = t.untyped_storage().data_ptr(), t.numel() * t.element_size()
            view = self._region[first[key]:first[key] + n].view(t.dtype).view(t.shape)
            if key not in copied:
                view.copy_(t)
                copied.add(key)
            t.data = view  # the old storage is freed with its last reference
        self.moved = len(movable)

    @property
    def start(self) -> int:
        return self._region.data_ptr()

    def holds(self, t: torch.Tensor) -> bool:
        return self.start <= t.data_ptr() < self.start + self.nbytes

    def huge_bytes(self) -> int:
        """Bytes of the region the kernel backs with huge pages now (/proc/self/smaps)."""
        lo, hi, total, inside = self.start, self.start + self.nbytes, 0, False
        try:
            with open("/proc/self/smaps") as f:
                for line in f:
                    head = line.split(maxsplit=1)[0]
                    if "-" in head and not head.endswith(":"):
                        a, b = (int(x, 16) for x in head.split("-"))
                        inside = a < hi and b > lo
                    elif inside and head == "AnonHugePages:":
                        total += int(line.split()[1]) * 1024
        except OSError:
            return 0
        return total


def move_weights(model) -> WeightArena:
    """Every weight of `model` (a CPU DecoderLM) into one WeightArena, logged."""
    arena = WeightArena(tensors_of(model.held_weights()))
    release_freed_memory()  # the old copies
    log.info("weights: %.1f MiB in one region, %.1f MiB of it in 2 MiB pages", arena.nbytes / 2**20,
             arena.huge_bytes() / 2**20)
    return arena
