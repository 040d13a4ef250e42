"""The compiled kernels of groups.c and fused_decode.c, built at first use with the machine's C compiler.

Job: find or build the shared library for this CPU and load it (ctypes); say in one
sentence why not when it cannot (no compiler, a CPU without AVX2/FMA/F16C, a build error),
so --quantization int4/int8 is refused by name instead of failing in a step.

Why a compile at first use and not a wheel: the kernels are built for the CPU they run on
(-march=native: AVX-512 where it exists), and a C file builds in about a second with
no torch headers. The library is cached in `cache_dir()`, keyed by the source, the flags
and the CPU's flags, and written by rename so that concurrent workers never load half a
file.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
# fused_decode.c includes groups.c and int4x16.c: one translation unit, so the whole-step
# function calls the kernels inline. Every file is hashed into the cache key.
SOURCES = tuple(os.path.join(HERE, f) for f in ("groups.c", "int4x16.c", "fused_decode.c"))
# FERROXMP_KERNEL_MARCH: another -march (e.g. haswell: the AVX2 code on an AVX-512 CPU)
FLAGS = ["-O3", f"-march={os.environ.get('FERROXMP_KERNEL_MARCH', 'native')}", "-fopenmp", "-shared", "-fPIC"]
NEEDED_CPU_FLAGS = ("avx2", "fma", "f16c")


class NativeUnavailable(RuntimeError):
    """The kernels cannot run here; the message says why."""


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cache_dir() -> str:
    """$FERROXMP_KERNEL_CACHE, else $FERROXMP_CACHE/kernels (default ~/.cache/ferroxmp/kernels).
    Its own variable so that processes with private caches (each test's server) can still
    share one build: a build costs ~1-2 s of both cores."""
    if os.environ.get("FERROXMP_KERNEL_CACHE"):
        return os.environ["FERROXMP_KERNEL_CACHE"]
    root = os.environ.get("FERROXMP_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "ferroxmp")
    return os.path.join(root, "kernels")


@functools.lru_cache(maxsize=None)
def library() -> ctypes.CDLL:
    """The loaded kernels; raises NativeUnavailable with the reason."""
    import torch  # noqa: F401  (torch's OpenMP runtime first: the library then shares it)
    flags = _cpu_flags()
    missing = [f for f in NEEDED_CPU_FLAGS if f not in flags]
    if missing:
        raise NativeUnavailable(f"the int4/int8 kernels need an x86 CPU with {', '.join(NEEDED_CPU_FLAGS)}; "
                                f"this one lacks {', '.join(missing) or 'them'}")
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise NativeUnavailable("the int4/int8 kernels are compiled at first use and no C compiler was found "
                                "(install gcc, or set CC)")
    source = b""
    for name in SOURCES:
        with open(name, "rb") as f:
            source += f.read()
    key = hashlib.sha256(source + " ".join(FLAGS).encode() + " ".join(sorted(flags)).encode()).hexdigest()[:16]
    path = os.path.join(cache_dir(), f"groups-{key}.so")
    if not os.path.exists(path):
        os.makedirs(cache_dir(), exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache_dir())
        os.close(fd)
        try:
            done = subprocess.run([compiler, *FLAGS, SOURCES[-1], "-o", tmp, "-lm"], capture_output=True, text=True,
                                  timeout=120)
            if done.returncode != 0:
                raise NativeUnavailable(f"compiling the int4/int8 kernels failed: {done.stderr.strip()[-500:]}")
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    lib = ctypes.CDLL(path)
    for name in ("int4x16_mm", "int8x16_mm", "int4x16_rows", "f32_panel_mm", "fused_decode", "fused_decode_steps",
                 "decode_attention", "rows_rms", "rows_rope", "rows_silu_mul", "rows_argmax"):
        getattr(lib, name).restype = None
    lib.fused_decode_scratch.restype = lib.int4x16_scratch.restype = ctypes.c_int64
    return lib


def ptr(t) -> ctypes.c_void_p:
    """A tensor's data address for a ctypes call into the kernels."""
    return ctypes.c_void_p(t.data_ptr())


def available() -> str | None:
    """None when the kernels load here, else the reason they do not."""
    try:
        library()
        return None
    except NativeUnavailable as e:
        return str(e)
