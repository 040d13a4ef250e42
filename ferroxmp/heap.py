"""Freed heap memory given back to the OS.

glibc keeps the pages a process freed (a load's activations, a tokenizer's build, a burst
of requests' buffers) in its heap and arenas, and the resident size keeps counting them;
`malloc_trim` returns every whole free page. Each process calls it where it has just
gone idle or finished a start, never per request. A no-op where libc is not glibc.
"""
from __future__ import annotations

import ctypes


def release_freed_memory() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
