#!/usr/bin/env python3
"""A/B of builds of groups.c's float32 panel product (f32_panel_mm) alone, on a stack of
decoder layers' weights read from memory, the builds alternated pass by pass.

Why beside bench_kernel_ab.py (the whole fused step): the products alone, at row counts
the step takes, with nothing else in the pass (attention, norms, the runner's Python),
so a change to the tiles shows at its own size. The weights are random float32 panels
in one region of 2 MiB pages, as the worker holds them (huge_pages.WeightArena), in the order a
step reads them: q, k, v, o, gate, up, down, for each layer. Every build's outputs must
equal the first's, bitwise (each output is one FMA chain over k in every build).

    .venv/bin/python tools/bench_panels.py --variant before=HEAD~1 --variant after=. \\
        [--variant k48=.:-DKBLOCK=48] [--rows 1,4,8,16] [--passes 7]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_kernel_ab import build  # noqa: E402
from ferroxmp.gpu_worker.huge_pages import WeightArena  # noqa: E402
from ferroxmp.gpu_worker.quant.native import ptr  # noqa: E402
from ferroxmp.gpu_worker.quant.packed import PackedF32  # noqa: E402


def layer_stack(layers: int, hidden: int, inter: int, kv: int) -> tuple[list[PackedF32], WeightArena]:
    """The layers' matrices as panels, moved into one region of 2 MiB pages (the worker's
    WeightArena; keep it as long as the panels)."""
    shapes = [(hidden, hidden), (kv, hidden), (kv, hidden), (hidden, hidden), (inter, hidden), (inter, hidden),
              (hidden, inter)]
    g = torch.Generator().manual_seed(0)
    mats = [PackedF32(torch.randn(n, k, generator=g)) for _ in range(layers) for n, k in shapes]
    return mats, WeightArena([m.panels for m in mats])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--variant", action="append", required=True, help="NAME=REV[:CFLAGS] (bench_kernel_ab.py's)")
    p.add_argument("--rows", default="1,4,8,16", help="activation rows a call, comma-separated")
    p.add_argument("--passes", type=int, default=7, help="passes over the stack a build and row count")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--hidden", type=int, default=576, help="SmolLM2-135M's shape by default")
    p.add_argument("--intermediate", type=int, default=1536)
    p.add_argument("--kv", type=int, default=192, help="k and v projections' rows (kv heads x head dim)")
    a = p.parse_args()
    mats, arena = layer_stack(a.layers, a.hidden, a.intermediate, a.kv)
    print(f"{len(mats)} matrices, {sum(m.nbytes for m in mats) / 2**20:.0f} MiB of float32 panels "
          f"({arena.huge_bytes() / 2**20:.0f} MiB in huge pages)")
    with tempfile.TemporaryDirectory() as tmp:
        libs = dict(build(v, tmp) for v in a.variant)
        for lib in libs.values():
            lib.f32_panel_mm.restype = None
        for rows in (int(r) for r in a.rows.split(",")):
            g = torch.Generator().manual_seed(rows)
            xs = {k: torch.randn(rows, k, generator=g) for k in {m.in_features for m in mats}}
            ys = {n: torch.empty(rows, n) for n in {m.out_features for m in mats}}
            times: dict[str, list[float]] = {n: [] for n in libs}
            first: dict[int, torch.Tensor] = {}
            for _ in range(a.passes):
                for name, lib in libs.items():
                    t = time.perf_counter()
                    for m in mats:
                        lib.f32_panel_mm(rows, m.out_features, m.in_features, ptr(xs[m.in_features]), ptr(m.panels),
                                         ptr(ys[m.out_features]))
                    times[name].append(time.perf_counter() - t)
                    for n, y in ys.items():  # the last matrix of each shape
                        if not torch.equal(first.setdefault(n, y.clone()), y):
                            sys.exit(f"{name}'s product differs from {list(libs)[0]}'s at {rows} rows")
            print(f"{rows:3d} row(s), median of {a.passes} passes: " +
                  ", ".join(f"{n} {statistics.median(t) * 1e3:.2f} ms" for n, t in times.items()), flush=True)


if __name__ == "__main__":
    main()
