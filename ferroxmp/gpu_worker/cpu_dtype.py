"""Whether this CPU multiplies bf16/fp16 matrices natively, and the startup warning when not.

Job: `--dtype auto` keeps the checkpoint's dtype (the answer must equal transformers' on
the same checkpoint). On an x86 CPU without bf16 (fp16) matrix instructions, torch
multiplies those dtypes through a float32 emulation: measured on a 2-core AVX2 EPYC,
a 384x576 by 576x1536 bf16 matmul took 37 ms against 4.3 ms in float32, and the
smol-135m shape prefilled 90 tok/s in bf16 against 541 tok/s in float32
(docs/BENCHMARKS.md, machine section). The worker says so once, with the flag that
fixes it, instead of silently serving at a ninth of the speed.
"""
from __future__ import annotations

import platform
from typing import Optional

import torch

# /proc/cpuinfo flags that give native matrix instructions for each dtype.
_NATIVE = {torch.bfloat16: ("avx512_bf16", "amx_bf16"), torch.float16: ("avx512_fp16", "amx_fp16")}


def cpu_flags() -> Optional[set[str]]:
    """The first CPU's flags, or None where /proc/cpuinfo is not there to read."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return None


def half_is_emulated(dtype: torch.dtype, flags: Optional[set[str]] = None) -> bool:
    """True when `dtype` matmuls on this x86 CPU have no native instructions. Unknown
    (not x86, no /proc/cpuinfo, not a half dtype) counts as native: no warning."""
    if dtype not in _NATIVE or platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    flags = cpu_flags() if flags is None else flags
    return flags is not None and not any(f in flags for f in _NATIVE[dtype])


def slow_dtype_warning(dtype: torch.dtype, flags: Optional[set[str]] = None) -> Optional[str]:
    if not half_is_emulated(dtype, flags):
        return None
    name = str(dtype).removeprefix("torch.")
    need = " or ".join(_NATIVE[dtype])
    return (f"serving in {name} on a CPU without {need}: torch emulates {name} matmuls here, "
            f"which makes prefill several times slower than float32 (measured 6x on AVX2); "
            f"pass --dtype float32 for speed (greedy output may then differ from {name})")
