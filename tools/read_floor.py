"""The machine's read rate over a buffer in 2 MiB pages, for issue 29's bandwidth floor
(bytes a step must read / the fastest rate this machine reads them at).

Job: time summing the first `nbytes` of a buffer laid out as the worker's weights are
(huge_pages.WeightArena) several ways: torch's sum (one stream a thread) and
tools/read_probe.c with 2, 3, 4 and 6 streams a thread (built here with the machine's C
compiler, cached by the source's hash); the floor is the fastest way's median time.

Why not torch's sum alone: on this AMD box a one-row product reading three streams a
thread ran faster than torch's sum read the same bytes (docs/BENCHMARKS.md 33); the
floor is the machine's rate, not one loop's.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import statistics
import subprocess
import tempfile
import time

import torch

SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "read_probe.c")
STREAMS = (2, 3, 4, 6)


def _library() -> ctypes.CDLL:
    with open(SRC, "rb") as f:
        key = hashlib.sha256(f.read()).hexdigest()[:16]
    path = os.path.join(tempfile.gettempdir(), f"ferroxmp-read-probe-{key}.so")
    if not os.path.exists(path):
        tmp = f"{path}.{os.getpid()}"
        subprocess.run(["cc", "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", SRC, "-o", tmp], check=True)
        os.replace(tmp, path)
    lib = ctypes.CDLL(path)
    lib.read_streams.restype = ctypes.c_float
    lib.read_streams.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    return lib


def median_seconds(fn, repeat: int) -> float:
    """The median seconds of `repeat` calls of fn(), after one (its warm-up)."""
    fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


class ReadFloor:
    """A buffer of `capacity` bytes in 2 MiB pages and the ways of reading it."""

    def __init__(self, capacity: int):
        from ferroxmp.gpu_worker.huge_pages import WeightArena
        self.buf = torch.ones(capacity // 4 + 1)
        self.arena = WeightArena([self.buf])  # (the buffer lives in it)
        self.lib = _library()

    def ways(self, nbytes: int) -> dict:
        view = self.buf[: nbytes // 4]
        out = {"torch sum": view.sum}
        for s in STREAMS:
            out[f"{s} streams"] = lambda s=s: self.lib.read_streams(view.data_ptr(), view.numel(), s)
        return out

    def times(self, nbytes: int, repeat: int = 5) -> dict[str, float]:
        """Each way's median seconds over `repeat` reads, after one."""
        return {name: median_seconds(fn, repeat) for name, fn in self.ways(nbytes).items()}

    def seconds(self, nbytes: int, repeat: int = 5) -> tuple[float, str]:
        """(the fastest way's median seconds, its name)."""
        return min((t, name) for name, t in self.times(nbytes, repeat).items())
