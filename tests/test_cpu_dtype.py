"""bf16/fp16 on a CPU that emulates them (cpu_dtype.py): the warning, and what
`--dtype auto` serves (float32 there; the checkpoint's dtype where it is native)."""
import platform

import pytest
import torch

from ferroxmp.gpu_worker.cpu_dtype import choose_dtype, cpu_flags, half_is_emulated, slow_dtype_warning

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


@x86
@pytest.mark.parametrize("flags,requested,cuda,served", [
    (AVX2, None, False, torch.float32),  # auto, emulated: float32
    (SAPPHIRE, None, False, torch.bfloat16),  # auto, native: the checkpoint's
    (AVX2, None, True, torch.bfloat16),  # auto on CUDA: the checkpoint's
    (AVX2, torch.bfloat16, False, torch.bfloat16),  # explicit: obeyed, even emulated
    (SAPPHIRE, torch.float16, False, torch.float16),
])
def test_auto_serves_float32_only_where_the_cpu_would_emulate_and_an_explicit_dtype_is_obeyed(
        flags, requested, cuda, served):
    """A bf16 checkpoint served with --dtype auto on an AVX2 CPU computed in emulated
    bf16 (a 2,147-token prompt outlasted the 60 s stall timeout). Each row is a case of
    the rule; the reason names what was served and, for the switch, why and how to undo it."""
    choice = choose_dtype(requested, torch.bfloat16, cuda, flags)
    assert choice.dtype == served
    assert choice.reason.startswith(str(served).removeprefix("torch."))
    if requested is None and served == torch.float32:
        assert "bfloat16" in choice.reason and "--dtype bfloat16" in choice.reason
    if requested is not None:
        assert "asked for with --dtype" in choice.reason
        assert ("--dtype float32" in choice.reason) is (requested == torch.bfloat16 and flags == AVX2)


@x86
def test_resolve_dtype_applies_the_rule_to_a_checkpoint_config(monkeypatch):
    """The loader's path: config.json says bfloat16; auto on a CPU without the flags is
    float32, explicit bfloat16 stays bfloat16, and CUDA keeps the checkpoint's."""
    import ferroxmp.gpu_worker.cpu_dtype as cd
    from ferroxmp.gpu_worker.loader import resolve_dtype
    monkeypatch.setattr(cd, "cpu_flags", lambda: AVX2)
    ckpt = {"torch_dtype": "bfloat16"}
    assert resolve_dtype("auto", ckpt, cuda=False) == torch.float32
    assert resolve_dtype("bfloat16", ckpt, cuda=False) == torch.bfloat16
    assert resolve_dtype("auto", ckpt, cuda=True) == torch.bfloat16
    assert resolve_dtype("auto", {"torch_dtype": "float32"}, cuda=False) == torch.float32


def test_server_info_shows_the_dtype_served_and_why(tmp_path):
    """A real server on a bf16 checkpoint with --dtype auto: /server_info's worker_info
    names the dtype served (float32 where this CPU emulates bf16, else bfloat16, as the
    rule computed independently here says) and the reason, and the log says it once."""
    from ferroxmp.tiny_model import build_model
    from serverproc import serving
    model = build_model("llama", str(tmp_path / "bf16"), dtype="bfloat16")
    want = "float32" if half_is_emulated(torch.bfloat16) and not torch.cuda.is_available() else "bfloat16"
    with serving(model, "--kv-pages", "64", "--max-running-requests", "2") as srv:
        info = srv.info["worker_info"]
        log = srv.log()
    assert info["dtype"] == want, info
    assert info["dtype_reason"].startswith(want) and "auto" in info["dtype_reason"], info
    assert log.count("serving in " + want) == 1, log
