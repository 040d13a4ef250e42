"""Weights kept compressed on CPU instead of float32 copies.

Modules (one job each):
- groups.py  Groups: a weight in groups of 32 values (int4 = GGUF's Q4_1 layout, int8 =
             Q8_0), sliced, fused and padded like a tensor, called like F.linear.
- groups.c   its matmul and widening kernels (AVX2 / AVX-512, float32 activations).
- fused_decode.c  up to 16 decoding rows through every layer in one call (includes groups.c).
- fused_decode.py FusedDecode: when the runner uses it, and its ctypes side.
- native.py  builds groups.c + fused_decode.c for this CPU at first use and loads them.
- packed.py  PackedF16 (FBGEMM's fp16 GEMM), `pack` (which form a loaded weight takes)
             and `linear`, the dispatch DecoderLM uses.
- policy.py  which mode a checkpoint gets (--quantization auto/none/fp16/int8/int4),
             which format each tensor takes, the byte accounting reported at start and
             in /server_info.

Why our own int4/int8 kernels: torch's `_weight_int4pack_mm_for_cpu` and
`_weight_int8pack_mm` measured 0.01-0.85x of float32 F.linear on this CPU and torchao's
PyPI wheel ships no CPU kernels (tools/bench_quant.py, docs/BENCHMARKS.md 18); FBGEMM's
dynamic int8 quantizes activations per call, which changed SmolLM2's greedy answers from
the first tokens. groups.c keeps activations float32.
"""
from ferroxmp.gpu_worker.quant.groups import Groups, cat_rows
from ferroxmp.gpu_worker.quant.packed import PackedF16, linear, pack
from ferroxmp.gpu_worker.quant.policy import QUANTIZED_SUFFIXES, describe_bytes, resolve_mode, should_quantize, target_format, tensor_bytes

__all__ = ["Groups", "PackedF16", "QUANTIZED_SUFFIXES", "cat_rows", "describe_bytes", "linear", "pack",
           "resolve_mode", "should_quantize", "target_format", "tensor_bytes"]
