"""Freed heap memory given back to the OS.

glibc keeps the pages a process freed (a load's activations, a tokenizer's build, a burst
of requests' buffers) in its heap and arenas, and the resident size keeps counting them;
`malloc_trim` returns every whole free page. Each process calls it where it has just
gone idle or finished a start, never per request. A no-op where libc is not glibc.
"""
from __future__ import annotations

import ctypes
import gc


def release_freed_memory() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def settle_after_start() -> None:
    """A process finished its start (a worker its load, the frontend its tokenizer): the
    objects made so far (modules, a model's Python objects, the tokenizer) leave the
    collector's generations, so a full collection while serving walks only what serving
    made, and the start's freed memory goes back. torch's ~1,100 modules are most of a
    worker's objects: gc took 3.7% of a one-row int4 step's samples, 1.6% frozen
    (docs/BENCHMARKS.md 26)."""
    gc.collect()
    gc.freeze()
    release_freed_memory()
