#!/usr/bin/env python3
"""A/B of builds of the native kernels (gpu_worker/quant/*.c) inside one runner, step by step.

The box's memory rate moves between states for minutes at a time (docs/BENCHMARKS.md 29),
so two processes timed one after the other compare minutes, not kernels. Here every
variant is compiled into its own library and loaded into one process; one ModelRunner
decodes, and its fused step's call (`FusedDecode.fn`) is switched to the next variant at
every step, so all variants see the same minutes. Prints each variant's median step.

A variant is NAME=REV[:CFLAGS]: the kernel sources at git revision REV ("." for the
working tree) built with extra compiler flags (e.g. "-DNTA_AHEAD=256", for a constant
the source guards with #ifndef). Only the fused step switches (prefill, and steps past
16 rows, run the working tree's library), and every variant must keep the working
tree's `fused_decode` interface (its arguments and Model struct).

    .venv/bin/python tools/bench_kernel_ab.py --model /tmp/smollm2-f32 --quantization none \\
        --variant before=HEAD~1 --variant after=. [--rows 1] [--context 100] [--steps 300]
"""
from __future__ import annotations

import argparse
import ctypes
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tools"))

from bench_worker import RunnerBench  # noqa: E402
from ferroxmp.gpu_worker.quant import native  # noqa: E402
from ferroxmp.heap import settle_after_start  # noqa: E402
from ferroxmp.protocol import ForwardBatch, RowStep  # noqa: E402


def build(spec: str, into: str) -> tuple[str, ctypes.CDLL]:
    """NAME=REV[:CFLAGS] -> (NAME, the loaded library)."""
    name, _, rest = spec.partition("=")
    rev, _, cflags = rest.partition(":")
    src = os.path.join(into, name)
    os.makedirs(src)
    for path in native.SOURCES:
        rel = os.path.relpath(path, ROOT)
        text = open(path, "rb").read() if rev == "." else subprocess.run(
            ["git", "-C", ROOT, "show", f"{rev}:{rel}"], check=True, capture_output=True).stdout
        with open(os.path.join(src, os.path.basename(path)), "wb") as f:
            f.write(text)
    out = os.path.join(into, f"{name}.so")
    cc = os.environ.get("CC", "cc")
    subprocess.run([cc, *native.FLAGS, *cflags.split(), os.path.join(src, "fused_decode.c"), "-o", out, "-lm"],
                   check=True)
    lib = ctypes.CDLL(out)
    lib.fused_decode.restype = None
    return name, lib


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--quantization", default="auto")
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--variant", action="append", required=True, help="NAME=REV[:CFLAGS]; two or more")
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--context", type=int, default=100)
    p.add_argument("--steps", type=int, default=300, help="steps per variant")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        libs = dict(build(v, tmp) for v in a.variant)
        bench = RunnerBench(a.model, a.rows, a.context + a.steps * len(libs) + 16, 16, False, "auto",
                            quantization=a.quantization, kv_cache_dtype=a.kv_cache_dtype)
        fused = bench.runner.model.fused_decode
        if fused is None:
            sys.exit("this model does not run the fused step here (see the worker's log line)")
        rng = random.Random(0)
        bench.start({r: [rng.randrange(1000, 20000) for _ in range(a.context)] for r in range(a.rows)})
        bench.run([], [RowStep(r, 0, a.context, True) for r in range(a.rows)])
        settle_after_start()
        times: dict[str, list[float]] = {n: [] for n in libs}
        for i in range(a.steps * len(libs)):
            name = list(libs)[i % len(libs)]
            fused.fn = libs[name].fused_decode
            steps = [RowStep(r, len(bench.runner.rows[r].tokens) - 1, 1, True) for r in range(a.rows)]
            t = time.perf_counter()
            bench.run([], steps)
            times[name].append(time.perf_counter() - t)
        bench.close()
    print(f"{a.rows} row(s) at ~{a.context} positions, median of {a.steps} steps each, alternated: " +
          ", ".join(f"{n} {statistics.median(t) * 1e3:.3f} ms" for n, t in times.items()))


if __name__ == "__main__":
    main()
