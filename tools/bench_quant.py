"""Micro-benchmark: the weight-only quantized matmul kernels ferroxmp can call on CPU,
against float32 F.linear, on SmolLM2-135M's matrix shapes at M = 1, 16 and 512 rows.

    .venv/bin/python tools/bench_quant.py [--threads 2] [--repeats 7] [--llama-ops BIN]
    .venv/bin/python tools/bench_quant.py --f32-stack 30 --rows 1,4,8,16,32,64,256

Kernels: torch's `_weight_int4pack_mm_for_cpu` (int4, groups of 32, scale + zero per
group: GGUF Q4_0/Q4_1 map onto it exactly: scale = d, zero = m + 8d for q - 8, checked
against the dequantized float), `_weight_int8pack_mm` (int8 weights, one scale per output
row, float activations), FBGEMM's `quantized::linear_dynamic_fp16` (fp16 weights, float32
activations), `quantized::linear_dynamic` (int8 weights per row AND activations
quantized to uint8 per call: W8A8), and ferroxmp's own groups of 32: `grp-int4` =
GGUF Q4_1's values in quant/int4x16.c's blocks of 16 rows (activations on a 16-bit grid,
integer dot products: what a built model multiplies), `grp-int8` = Q8_0's (quant/groups.c,
float32 activations), `grp-f32`: float32 weights in groups.c's panels, packed.PackedF32,
what a float32 model multiplies on CPU). Each cell is the median of `repeats` rounds; the kernels alternate
inside a round so that load from other processes hits them alike. Prints one table
(ms per call and the speed-up over float32). On a shared box, label the figures
contaminated.

--llama-ops BIN: llama.cpp's own kernels on the same matrices, through its
`test-backend-ops perf` (built from the same tree as llama-server, with
-DLLAMA_BUILD_TESTS=ON): the shapes are written as a --test-file of MUL_MAT ops with
Q4_1 (`ll-q4_1`) and Q8_0 (`ll-q8_0`) weights and float32 activations, the formats of
grp-int4 and grp-int8. test-backend-ops runs the CPU backend on hardware threads / 2
threads: compare with --threads set to the same number.
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import tempfile
import time
import warnings

import torch
import torch.nn.functional as F

SHAPES = {"q/o 576x576": (576, 576), "gate+up 3072x576": (3072, 576), "down 576x1536": (576, 1536),
          "qkv 960x576": (960, 576), "head 49152x576": (49152, 576)}


def kernels(n: int, k: int, group: int = 32):
    w = torch.randn(n, k)
    q4 = torch.randint(0, 16, (n, k), dtype=torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q4, 1)
    sz = torch.rand(k // group, n, 2)
    q8 = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    s8 = torch.rand(n)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qw = torch._make_per_channel_quantized_tensor(q8, s8.double(), torch.zeros(n, dtype=torch.long), 0)
    fb8 = torch.ops.quantized.linear_prepack(qw, None)
    fb16 = torch.ops.quantized.linear_prepack_fp16(w, None)
    from ferroxmp.gpu_worker.quant import Groups, pack
    from ferroxmp.gpu_worker.quant.packed import PackedF32
    g4, g8 = pack(Groups.quantize(w, "int4"), torch.float32), Groups.quantize(w, "int8")
    return {"f32": lambda x: F.linear(x, w),
            "int8": lambda x: torch.ops.aten._weight_int8pack_mm(x, q8, s8),
            "int4": lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group, sz),
            "fb-fp16": lambda x: torch.ops.quantized.linear_dynamic_fp16(x, fb16),
            "fb-w8a8": lambda x: torch.ops.quantized.linear_dynamic(x, fb8, True),
            "grp-int4": g4, "grp-int8": g8, "grp-f32": PackedF32(w)}


GGML_OP_MUL_MAT, GGML_F32 = 29, 0  # enum values in ggml.h of llama-cpp-python 0.3.36's tree
GGML_TYPES = {"q4_1": (3, 20), "q8_0": (8, 34)}  # type id, bytes per block of 32


def llama_ops(binary: str, shapes: list[tuple[int, int]], rows: list[int]) -> dict:
    """ms per call of llama.cpp's MUL_MAT for each (type, n, k, m), from test-backend-ops perf."""
    lines = []
    for n, k in shapes:
        for name, (tid, block) in GGML_TYPES.items():
            row = k // 32 * block
            for m in rows:  # op type ne[4] n_params n_src, then per source: type ne[4] nb[4]
                lines.append(f"{GGML_OP_MUL_MAT} {GGML_F32} {n} {m} 1 1 0 2 "
                             f"{tid} {k} {n} 1 1 {block} {row} {row * n} {row * n} "
                             f"{GGML_F32} {k} {m} 1 1 4 {4 * k} {4 * k * m} {4 * k * m} -")
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write("\n".join(lines) + "\n")
    try:
        r = subprocess.run([binary, "perf", "-b", "CPU", "--test-file", f.name], capture_output=True,
                           text=True, timeout=3600)
    finally:
        os.unlink(f.name)
    got = {}
    pat = r"MUL_MAT\(type=f32,ne=\[(\d+),(\d+),1,1\].*?sources=(\w+)\[(\d+),.*?([\d.]+) us/run"
    for n, m, t, k, us in re.findall(pat, r.stdout):
        got[(t, int(n), int(k), int(m))] = float(us) / 1e3
    if not got:  # another tree's enum values, or an output format this does not read
        raise SystemExit(f"no MUL_MAT timings from {binary} (rc {r.returncode}):\n"
                         f"{r.stdout[-2000:]}{r.stderr[-2000:]}")
    return got


def timed(fn, x, calls: int) -> float:
    t = time.perf_counter()
    for _ in range(calls):
        fn(x)
    return (time.perf_counter() - t) / calls * 1e3


def f32_stack(layers: int, rows: list[int], repeats: int) -> None:
    """Float32 weights as a decode step reads them: `layers` layers' own matrices (qkv, o,
    gate+up, down: ~515 MB at 30, past any cache) then the LM head, once per pass, through
    torch's F.linear (MKL) and groups.c's panels (PackedF32), in 4 KiB pages, and the panels
    again in 2 MiB pages (`panels 2M`: gpu_worker/huge_pages.py's region, where a served
    model's weights live); median ms per pass, alternating."""
    from ferroxmp.gpu_worker.huge_pages import WeightArena, tensors_of
    from ferroxmp.gpu_worker.quant.packed import PackedF32
    ws = [torch.randn(n, k) for _ in range(layers) for n, k in
          (SHAPES["qkv 960x576"], SHAPES["q/o 576x576"], SHAPES["gate+up 3072x576"], SHAPES["down 576x1536"])]
    head = torch.randn(*SHAPES["head 49152x576"])
    panels = [PackedF32(w) for w in ws + [head]]
    huge = [PackedF32(w) for w in ws + [head]]
    arena = WeightArena(tensors_of(huge))
    stacks = {"F.linear": (lambda x, w: F.linear(x, w), ws, head),
              "panels": (lambda x, w: w(x), panels[:-1], panels[-1]),
              "panels 2M": (lambda x, w: w(x), huge[:-1], huge[-1])}

    print(f"float32, {layers} layers then the head, median of {repeats} passes (ms): layers / head "
          f"({arena.huge_bytes() / 2**20:.0f} of {arena.nbytes / 2**20:.0f} MiB of the 2M copy in huge pages)")
    for m in rows:
        xs = {k: torch.randn(m, k) for k in (576, 1536)}
        got: dict = {name: ([], []) for name in stacks}
        for _ in range(repeats):
            for name, (fn, mats, last) in stacks.items():
                t0 = time.perf_counter()
                for w in mats:
                    fn(xs[w.shape[1]], w)
                t1 = time.perf_counter()
                fn(xs[576], last)
                got[name][0].append(t1 - t0)
                got[name][1].append(time.perf_counter() - t1)
        print(f"M={m:>4} " + "  ".join(f"{name} {1e3 * statistics.median(a):7.1f} / {1e3 * statistics.median(b):6.1f}"
                                       for name, (a, b) in got.items()))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--rows", default="1,16,512")
    p.add_argument("--llama-ops", default=None, help="llama.cpp's test-backend-ops binary: time its "
                   "Q4_1/Q8_0 MUL_MAT on the same shapes")
    p.add_argument("--f32-stack", type=int, default=0, metavar="LAYERS",
                   help="instead: float32 F.linear vs the panels (PackedF32) over LAYERS layers' matrices and the head")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    if a.f32_stack:
        with torch.inference_mode():
            f32_stack(a.f32_stack, [int(r) for r in a.rows.split(",")], a.repeats)
        return
    print(f"threads={a.threads} repeats={a.repeats} (median ms per call; x = speed-up over f32)")
    names = ["f32", "int8", "int4", "fb-fp16", "fb-w8a8", "grp-int4", "grp-int8", "grp-f32"]
    rows = [int(r) for r in a.rows.split(",")]
    ll = llama_ops(a.llama_ops, list(SHAPES.values()), rows) if a.llama_ops else None
    if ll is not None:
        names += ["ll-q4_1", "ll-q8_0"]
    print(f"{'shape':<18} {'M':>4} " + " ".join(f"{n:>8}" for n in names) + " " +
          " ".join(f"{n + ' x':>9}" for n in names[1:]))
    with torch.inference_mode():
        for label, (n, k) in SHAPES.items():
            ks = kernels(n, k)
            for m in rows:
                x = torch.randn(m, k)
                calls = max(1, int(2e7 / (n * k * max(m, 4))))
                samples = {name: [] for name in ks}
                for name, fn in ks.items():
                    timed(fn, x, 1)  # warm
                for _ in range(a.repeats):
                    for name, fn in ks.items():
                        samples[name].append(timed(fn, x, calls))
                med = {name: statistics.median(v) for name, v in samples.items()}
                if ll is not None:
                    for t in GGML_TYPES:
                        med[f"ll-{t}"] = ll.get((t, n, k, m), float("nan"))
                print(f"{label:<18} {m:>4} " + " ".join(f"{med[n]:>8.3f}" for n in names) + " " +
                      " ".join(f"{med['f32'] / med[n]:>9.2f}" for n in names[1:]))


if __name__ == "__main__":
    main()
