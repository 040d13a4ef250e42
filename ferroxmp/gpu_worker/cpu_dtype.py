"""Whether this CPU multiplies bf16/fp16 matrices natively, and what `--dtype auto` serves.

On an x86 CPU without bf16 (fp16) matrix instructions, torch multiplies those dtypes
through a float32 emulation: measured on a 2-core AVX2 EPYC, a 384x576 by 576x1536 bf16
matmul took 37 ms against 4.3 ms in float32, and the smol-135m shape prefilled 90 tok/s
in bf16 against 541 tok/s in float32 (docs/BENCHMARKS.md, machine section); a 2,147-
token bf16 prompt made one step outlast the 60 s stall timeout on a busy box.

So `--dtype auto` (`choose_dtype`) serves the checkpoint's dtype where the device
computes it natively (CUDA; a CPU with the instructions) and float32 where a CPU would
emulate it: float32 holds every bf16/fp16 value exactly, so the weights are the same
numbers, only the arithmetic is wider (greedy output may differ from a bf16 run). An
explicit --dtype is always obeyed; served in an emulated dtype it gets a warning. The
choice and its reason are logged once by the worker and shown in /server_info.
"""
from __future__ import annotations

import platform
from dataclasses import dataclass
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


@dataclass(frozen=True)
class DtypeChoice:
    dtype: torch.dtype
    reason: str  # one line for the log and /server_info


# The worker reads the choice its load_config made (resolve_dtype returns only the dtype,
# and the checkpoint's own dtype is not kept in ModelConfig): last one made in this process.
LAST: Optional[DtypeChoice] = None


def choose_dtype(requested: Optional[torch.dtype], checkpoint: torch.dtype, cuda: bool,
                 flags: Optional[set[str]] = None) -> DtypeChoice:
    """`requested` None means --dtype auto."""
    global LAST
    ckpt = str(checkpoint).removeprefix("torch.")
    if requested is not None:
        name = str(requested).removeprefix("torch.")
        warning = None if cuda else slow_dtype_warning(requested, flags)
        choice = DtypeChoice(requested, f"{name}: asked for with --dtype" + (f" ({warning})" if warning else ""))
    elif cuda:
        choice = DtypeChoice(checkpoint, f"{ckpt}: the checkpoint's dtype (--dtype auto on CUDA)")
    elif half_is_emulated(checkpoint, flags):
        need = " or ".join(_NATIVE[checkpoint])
        choice = DtypeChoice(torch.float32, (
            f"float32: the checkpoint is {ckpt}, which this CPU only emulates (no {need}; measured 6x slower "
            f"prefill on AVX2), so --dtype auto serves float32 (the same weights, exactly); "
            f"pass --dtype {ckpt} to compute in {ckpt}"))
    else:
        choice = DtypeChoice(checkpoint, f"{ckpt}: the checkpoint's dtype, native on this device (--dtype auto)")
    LAST = choice
    return choice
