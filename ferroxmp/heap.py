"""Freed heap memory given back to the OS.

glibc keeps the pages a process freed (a load's activations, a tokenizer's build, a burst
of requests' buffers) in its heap and arenas, and the resident size keeps counting them;
`malloc_trim` returns every whole free page. Each process calls it where it has just
gone idle or finished a start, never per request. A no-op where libc is not glibc.

The same holds for code: `import torch` runs the registration of ~2,000 operators spread
over libtorch's 325 MB of text, leaving ~50 MB of it resident in the worker although a
step runs a few MB of it (issue 30's memory target: that was most of the gap to
llama-server). At the end of a start the shared libraries' pages go back too
(`release_library_pages`); what serving runs faults back in once, from the page cache
or the file, at the first requests. Pages another process maps stay (the kernel skips
them), so the libraries every process shares are untouched.
"""
from __future__ import annotations

import ctypes
import gc

MADV_PAGEOUT = 21  # Linux 5.4+; elsewhere madvise fails and nothing changes


def release_freed_memory() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _is_library(path: str) -> bool:
    name = path.rsplit("/", 1)[-1]
    return path.startswith("/") and (name.endswith(".so") or ".so." in name)


def release_library_pages() -> int:
    """Reclaim the pages of this process's shared-library mappings that are not writable
    (code and read-only data: clean copies of the file, so nothing is lost and nothing
    needs swap). Returns the bytes of address range advised."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        with open("/proc/self/maps") as f:
            lines = f.read().splitlines()
    except (OSError, AttributeError):
        return 0
    advised = 0
    for line in lines:
        parts = line.split(maxsplit=5)
        if len(parts) < 6 or "w" in parts[1] or not _is_library(parts[5]):
            continue
        lo, hi = (int(x, 16) for x in parts[0].split("-"))
        if libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), MADV_PAGEOUT) == 0:
            advised += hi - lo
    return advised


def settle_after_start() -> None:
    """A process finished its start (a worker its load, the frontend its tokenizer): the
    objects made so far (modules, a model's Python objects, the tokenizer) leave the
    collector's generations, so a full collection while serving walks only what serving
    made, and the start's freed memory goes back. torch's ~1,100 modules are most of a
    worker's objects: gc took 3.7% of a one-row int4 step's samples, 1.6% frozen
    (docs/BENCHMARKS.md 26). The libraries' pages the start alone ran go back too."""
    gc.collect()
    gc.freeze()
    release_freed_memory()
    release_library_pages()
