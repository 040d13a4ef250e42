"""Run test code against another build of the native kernels (groups.c, int4x16.c,
fused_decode.c) than this CPU's own.

On an AVX-512 machine the native build never runs the AVX2 lanes, nor (with VNNI) the
AVX-512 integer path without VNNI: `run_avx2(code, cache, march)` runs `code` in a
subprocess whose kernels are built with -march=`march` (haswell: AVX2;
skylake-avx512: AVX-512 without VNNI) into their own cache folder, checks the build
landed there, and returns what it printed. The subprocess imports from tests/ too.
"""
from __future__ import annotations

import os
import subprocess
import sys

from ferroxmp.gpu_worker.cpu_dtype import cpu_flags


def run_avx2(code: str, cache, march: str = "haswell") -> str:
    """(An AVX-512 build cannot run on a CPU without AVX-512: the test is skipped there, where
    the native build is the AVX2 one.)"""
    if march != "haswell" and "avx512f" not in (cpu_flags() or {"avx512f"}):
        import pytest
        pytest.skip(f"-march={march} needs AVX-512, which this CPU lacks (its native build is AVX2)")
    kernels = os.path.join(str(cache), "kernels")
    tests = os.path.dirname(os.path.abspath(__file__))
    path = os.pathsep.join(p for p in (tests, os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "FERROXMP_KERNEL_MARCH": march, "FERROXMP_KERNEL_CACHE": kernels, "PYTHONPATH": path}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert os.listdir(kernels), "the build was not cached where FERROXMP_KERNEL_CACHE says"
    return out.stdout.strip() + ("" if out.returncode == 0 else "\n" + out.stderr[-2000:])
