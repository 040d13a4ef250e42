"""Weights kept compressed on CPU and multiplied by FBGEMM (through torch's
`quantized::linear_dynamic_fp16` / `quantized::linear_dynamic`) instead of float32 copies.

Modules (one job each):
- rows.py    Int8Rows: a weight as int8 values + one float32 scale per output row, in
             a form that can be sliced (tensor parallelism) and concatenated (fused
             qkv, gate/up) before it is packed; the embedding lookup reads it directly.
- packed.py  PackedF16 / PackedInt8: a weight packed for FBGEMM, callable like F.linear;
             `pack` (which form a loaded weight takes) and `linear`, the dispatch
             DecoderLM.linear uses (a float tensor goes to F.linear).
- policy.py  which mode a checkpoint gets (--quantization auto/none/fp16/int8), which
             tensors are compressed, the byte accounting reported at start and in /server_info.

Why FBGEMM fp16 (the default for a quantized GGUF) and not the int4/int8 weight-only
kernels: tools/bench_quant.py on this box (docs/BENCHMARKS.md) measured torch's
`_weight_int4pack_mm_for_cpu` and `_weight_int8pack_mm` at 0.1-0.4x of float32 F.linear
at M = 1 and 0.01-0.9x at M = 16 and 512; FBGEMM's fp16 GEMM ran 1.0-6x float32 in all
but one (load-hit) cell and FBGEMM's dynamic int8 1.5-10x, but int8 quantizes the
activations too, which changed SmolLM2's greedy answers from the first tokens and
tripled its perplexity, while fp16 kept every answer (perplexity +0.01%).
"""
from .packed import PackedF16, PackedInt8, linear, pack
from .policy import QUANTIZED_SUFFIXES, describe_bytes, resolve_mode, should_quantize, tensor_bytes
from .rows import Int8Rows, cat_rows

__all__ = ["Int8Rows", "PackedF16", "PackedInt8", "QUANTIZED_SUFFIXES", "cat_rows", "describe_bytes", "linear",
           "pack", "resolve_mode", "should_quantize", "tensor_bytes"]
