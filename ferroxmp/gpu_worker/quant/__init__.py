"""Weights kept compressed on CPU instead of float32 copies.

Modules (one job each):
- groups.py  Groups: a weight in groups of 32 values (int4 = GGUF's Q4_1 layout, int8 =
             Q8_0), sliced, fused and padded like a tensor, called like F.linear.
- groups.c   float32 weights in panels times activation rows (f32_panel_mm) and the
             float lanes the other C files build on (AVX2 / AVX-512).
- int4x16.py Int4x16: an int4 weight repacked in blocks of 16 rows once the model is built;
  int4x16.c  its kernel: integer dot products against activations on a 16-bit grid.
- fused_decode.c  up to 16 decoding rows through every layer in one call (includes groups.c
             and int4x16.c).
- fused_decode.py FusedDecode: when the runner uses it, and its ctypes side.
- glue.py    RowGlue: fused_decode.c's RMSNorm / RoPE / SiLU-mul loops for an eager step.
- native.py  builds the three C files (one translation unit) for this CPU at first use.
- packed.py  PackedF16 (FBGEMM's fp16 GEMM), PackedF32 (groups.c's panels), `pack`
             (which form a loaded weight takes) and `linear`, the dispatch DecoderLM uses.
- policy.py  which mode a checkpoint gets (--quantization auto/none/fp16/int8/int4),
             which format each tensor takes, the byte accounting reported at start and
             in /server_info.

Why our own int4/int8 kernels: torch's `_weight_int4pack_mm_for_cpu` and
`_weight_int8pack_mm` measured 0.01-0.85x of float32 F.linear on this CPU and torchao's
PyPI wheel ships no CPU kernels (tools/bench_quant.py, docs/BENCHMARKS.md 18); FBGEMM's
dynamic int8 quantizes activations per call, which changed SmolLM2's greedy answers from
the first tokens. groups.c keeps activations float32; int4x16.c rounds them per group of
32 to a 16-bit grid (perplexity within 0.01% of float32's, the same greedy answers) for
integer dot products: 1.3-1.9x the float path (docs/BENCHMARKS.md 24).
"""
from ferroxmp.gpu_worker.quant.groups import Groups, cat_rows
from ferroxmp.gpu_worker.quant.packed import PackedF16, PackedF32, linear, pack
from ferroxmp.gpu_worker.quant.policy import QUANTIZED_SUFFIXES, describe_bytes, resolve_mode, should_quantize, target_format, tensor_bytes

__all__ = ["Groups", "PackedF16", "PackedF32", "QUANTIZED_SUFFIXES", "cat_rows", "describe_bytes", "linear", "pack",
           "resolve_mode", "should_quantize", "target_format", "tensor_bytes"]
