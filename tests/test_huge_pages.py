"""Weights in one region of 2 MiB pages on CPU (gpu_worker/huge_pages.py).

Oracles: the tensors' own values before the move (bitwise: a copy), their place (inside
the region, each on a cache line), the kernel's account of the region (/proc/self/smaps
AnonHugePages, where the machine's THP mode allows them), and, for a built runner, the
addresses the fused step keeps (every one inside the region: the move ran before they
were recorded; otherwise the step would read freed memory). That serving still gives
transformers' answers is every other CPU test's oracle: they all run on moved weights.
"""
from __future__ import annotations

import re

import pytest
import torch

from ferroxmp.gpu_worker.huge_pages import WeightArena, tensors_of
from ferroxmp.gpu_worker.quant.int4x16 import Int4x16


def _thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return re.search(r"\[(\w+)\]", f.read()).group(1)
    except (OSError, AttributeError):
        return "never"


def test_moved_tensors_keep_their_values_and_objects_and_live_in_the_region():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(1000, 577, generator=g)  # an odd size: the next tensor is realigned
    b = torch.randint(0, 255, (3, 4097), dtype=torch.uint8, generator=g)
    c = torch.randn(64, generator=g).half()
    base = torch.randn(10, 10, generator=g)
    view = base[2:5]  # shares base's storage: moving it would copy it a second time
    before = [t.clone() for t in (a, b, c, view)]
    view_at = view.data_ptr()
    arena = WeightArena(tensors_of([a, b, c, view, a]))
    assert arena.moved == 3
    for t, want in zip((a, b, c, view), before):
        assert torch.equal(t, want) and t.dtype == want.dtype and t.shape == want.shape
    for t in (a, b, c):
        assert arena.holds(t) and t.data_ptr() % 64 == 0
    assert not arena.holds(view) and view.data_ptr() == view_at
    assert arena.start % (2 << 20) == 0
    a[0, 0] = 7.0  # the tensor is the region: writes land there
    assert arena.holds(a) and a[0, 0].item() == 7.0


def test_objects_holding_tensors_give_up_theirs():
    q = torch.randint(0, 255, (2, 18, 256), dtype=torch.uint8)
    d, m = torch.rand(2, 18, 16).half(), torch.rand(2, 18, 16).half()
    w = Int4x16(q, d, m, rows=32)
    x = torch.randn(3, 18 * 32)
    want = w(x)
    arena = WeightArena(tensors_of([w]))
    assert all(arena.holds(t) for t in (w.q, w.d, w.m))
    assert torch.equal(w(x), want)


@pytest.mark.skipif(_thp_mode() == "never", reason="this machine's transparent huge pages are off")
def test_the_kernel_backs_the_region_with_huge_pages():
    x = torch.ones(3 << 20)  # 12 MiB
    arena = WeightArena([x])
    assert arena.huge_bytes() >= 8 << 20, arena.huge_bytes()
    assert x.sum().item() == 3 << 20


@pytest.mark.parametrize("mode", ["int4", "none"])
def test_a_built_runner_keeps_every_weight_and_the_fused_steps_addresses_in_the_region(tiny_models, make_harness,
                                                                                     mode):
    h = make_harness(tiny_models["qwen2"], page_size=4, max_rows=2, pages_per_row=16, quantization=mode)
    model = h.runner.model
    arena = model.weight_arena
    tensors = tensors_of(model.held_weights())
    assert tensors and all(arena.holds(t) for t in tensors)
    fused = model.fused_decode
    assert fused is not None
    for L in fused._layers:
        for lin in (L.qkv, L.o, L.gate_up, L.down):
            assert lin.q is not None and arena.start <= lin.q < arena.start + arena.nbytes
        assert arena.start <= L.in_norm < arena.start + arena.nbytes
    assert h.runner.memory_info()["weight_huge_page_bytes"] == arena.huge_bytes()


def test_two_tensors_over_one_storage_stay_one_copy():
    a = torch.randn(64, 32)
    b = a.view(32, 64)  # the same whole storage under another shape
    want = a.clone()
    arena = WeightArena(tensors_of([a, b]))
    assert arena.nbytes == 64 * 32 * 4 and arena.holds(a) and arena.holds(b)
    assert a.data_ptr() == b.data_ptr() and torch.equal(a, want)
    b[0, 0] = 3.0  # still one storage
    assert a[0, 0].item() == 3.0


def test_a_kernel_that_refuses_the_advice_leaves_ordinary_pages(monkeypatch):
    import mmap

    monkeypatch.setattr(mmap, "MADV_HUGEPAGE", 9999, raising=False)  # an advice the kernel refuses: EINVAL
    a = torch.randn(1000, 100)
    want = a.clone()
    arena = WeightArena([a])
    assert arena.holds(a) and torch.equal(a, want)
