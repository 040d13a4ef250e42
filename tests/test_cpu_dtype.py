"""The worker's warning for bf16/fp16 on a CPU that emulates them (cpu_dtype.py)."""
import platform

import pytest
import torch

from ferroxmp.gpu_worker.cpu_dtype import cpu_flags, half_is_emulated, slow_dtype_warning

x86 = pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="x86 flags only")

AVX2 = {"fpu", "sse2", "avx", "avx2", "fma"}
SAPPHIRE = AVX2 | {"avx512f", "avx512_bf16", "amx_bf16", "avx512_fp16", "amx_fp16"}
ZEN4 = AVX2 | {"avx512f", "avx512_bf16"}  # bf16 dot products, no fp16 ones


@x86
@pytest.mark.parametrize("flags,dtype,emulated", [
    (AVX2, torch.bfloat16, True), (AVX2, torch.float16, True), (AVX2, torch.float32, False),
    (SAPPHIRE, torch.bfloat16, False), (SAPPHIRE, torch.float16, False),
    (ZEN4, torch.bfloat16, False), (ZEN4, torch.float16, True),
])
def test_the_rule_per_dtype_and_cpu(flags, dtype, emulated):
    assert half_is_emulated(dtype, flags) is emulated
    warning = slow_dtype_warning(dtype, flags)
    assert (warning is not None) is emulated
    if warning:  # names the dtype, the missing instructions and the flag that helps
        name = str(dtype).removeprefix("torch.")
        assert name in warning and "--dtype float32" in warning and "avx512_" in warning


@x86
def test_unknown_flags_mean_no_warning(monkeypatch):
    import ferroxmp.gpu_worker.cpu_dtype as cd
    monkeypatch.setattr(cd, "cpu_flags", lambda: None)
    assert slow_dtype_warning(torch.bfloat16) is None


def test_reads_this_machines_flags():
    flags = cpu_flags()
    if flags is None:
        pytest.skip("no /proc/cpuinfo here")
    if platform.machine().lower() in ("x86_64", "amd64"):
        assert "sse2" in flags  # every x86-64 CPU has it: the parse found the flags line
