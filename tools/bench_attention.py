"""Micro-benchmark: the CPU decode attention (quant/fused_decode.c's, through PageDecode)
over 30 layers of SmolLM2-135M's geometry, its K/V read from a pool as a decode step
reads it: each row's pages scattered over the pool, and the caches evicted between
layers (what a step's weights streaming through them do), or warm (--warm).

    .venv/bin/python tools/bench_attention.py [--kv-dtype float16] [--warm] [--repeats 5]

Cases: one row at 300 and 1,000 positions, a 9-token verify of one sequence at 450, 16
rows at 400. Prints the best of `repeats` passes (ms for the 30 layers' attention alone,
the eviction not counted) and the K/V bytes a pass reads.
"""
from __future__ import annotations

import argparse
import time

import torch

from ferroxmp.gpu_worker.attention.page_decode import PageDecode
from ferroxmp.gpu_worker.kv.pool import KVPool

LAYERS, KV_HEADS, HEADS, HEAD_DIM, PAGE = 30, 3, 9, 64, 16
CASES = [("1 row at 300", 1, 300, False), ("1 row at 1000", 1, 1000, False),
         ("9-token verify at 450", 9, 450, True), ("16 rows at 400", 16, 400, False)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kv-dtype", default="float16", choices=["float16", "float32"])
    p.add_argument("--warm", action="store_true", help="no eviction between layers")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--pool-pages", type=int, default=2000)
    a = p.parse_args()
    dtype = getattr(torch, a.kv_dtype)
    kv = KVPool(a.pool_pages, PAGE, LAYERS, KV_HEADS, HEAD_DIM, dtype, torch.device("cpu"), "hnd")
    kv.k.normal_()
    kv.v.normal_()
    attend = PageDecode(kv)
    evict = torch.randn(12 * 2**20)  # 48 MB, past the 32 MB L3 of the box of docs/BENCHMARKS.md
    g = torch.Generator().manual_seed(1)
    print(f"{a.kv_dtype} K/V, {'warm' if a.warm else 'caches evicted between layers'}, best of {a.repeats}")
    for name, rows, ctx, one_sequence in CASES:
        per = (ctx + PAGE - 1) // PAGE
        if one_sequence:  # a verify: the rows are one sequence's tokens at consecutive positions
            pages = torch.randperm(a.pool_pages, generator=g)[:per]
            page_at = torch.tensor([0] * rows + [per])
            pos = torch.arange(ctx - rows, ctx)
            tokens = ctx
        else:
            pages = torch.randperm(a.pool_pages, generator=g)[:rows * per]
            page_at = torch.arange(rows + 1) * per
            pos = torch.full((rows,), ctx - 1)
            tokens = rows * ctx
        q = torch.randn(rows, HEADS, HEAD_DIM)
        span = int(pos.max()) + 1
        best = float("inf")
        for _ in range(a.repeats):
            total = 0.0
            for layer in range(LAYERS):
                if not a.warm:
                    evict.sum()
                t = time.perf_counter()
                attend(layer, q, pos, page_at, pages, span)
                total += time.perf_counter() - t
            best = min(best, total)
        nbytes = 2 * LAYERS * KV_HEADS * HEAD_DIM * tokens * dtype.itemsize
        print(f"{name:>22}: {best * 1e3:6.2f} ms  ({nbytes / 2**20:6.1f} MiB of K/V, {nbytes / best / 1e9:5.1f} GB/s)")


if __name__ == "__main__":
    main()
