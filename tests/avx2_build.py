"""Run test code against the AVX2 build of the native kernels (groups.c, fused_decode.c).

On an AVX-512 machine the native build never runs the AVX2 lanes: `run_avx2(code,
cache)` runs `code` in a subprocess whose kernels are built with -march=haswell into
their own cache folder, checks the build landed there, and returns what it printed.
"""
from __future__ import annotations

import os
import subprocess
import sys


def run_avx2(code: str, cache) -> str:
    kernels = os.path.join(str(cache), "kernels")
    env = {**os.environ, "FERROXMP_KERNEL_MARCH": "haswell", "FERROXMP_KERNEL_CACHE": kernels}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert os.listdir(kernels), "the build was not cached where FERROXMP_KERNEL_CACHE says"
    return out.stdout.strip() + ("" if out.returncode == 0 else "\n" + out.stderr[-2000:])
