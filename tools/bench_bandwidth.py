"""The machine's read bandwidth, as the bandwidth floor of a decode step uses it: the
seconds to read N bytes once with every core (torch's sum over a float32 tensor far
larger than the caches), median of several passes, in 4 KiB pages and again in 2 MiB
pages (the region ferroxmp's CPU weights live in: gpu_worker/huge_pages.py); then, in
2 MiB pages, every way tools/read_floor.py reads (torch's sum, 2-6 streams a thread): the
fastest is the floor's rate.

    .venv/bin/python tools/bench_bandwidth.py [--gib 1] [--threads N] [--passes 9]

The floor of a batch-1 decode step is (weight bytes read per token) / this figure
(docs/BENCHMARKS.md 21); nothing but the weights is counted, so it is a lower bound:
take the faster of the two figures.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from read_floor import ReadFloor, median_seconds  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--passes", type=int, default=9)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    x = torch.ones(int(a.gib * (1 << 30)) // 4)
    measure(x, "4 KiB pages", a)
    from ferroxmp.gpu_worker.huge_pages import WeightArena
    arena = WeightArena([x])  # x now lives in the arena's region
    measure(x, f"2 MiB pages ({arena.huge_bytes() / 2**20:.0f} of {arena.nbytes / 2**20:.0f} MiB huge)", a)
    del arena, x
    nbytes = int(a.gib * (1 << 30))
    for name, t in ReadFloor(nbytes).times(nbytes, a.passes).items():
        print(f"read bandwidth, 2 MiB pages, {name}: {nbytes / t / 1e9:.1f} GB/s")


def measure(x: torch.Tensor, pages: str, a) -> None:
    s = median_seconds(x.sum, a.passes)  # (its first sum faults the pages in)
    print(f"read bandwidth, {pages}: {x.numel() * 4 / s / 1e9:.1f} GB/s ({a.threads} threads, {a.gib} GiB, "
          f"median of {a.passes}: {s * 1e3:.1f} ms)")


if __name__ == "__main__":
    main()
