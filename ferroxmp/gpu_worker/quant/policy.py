"""Which weights are kept compressed, under which mode, and what they cost in memory.

Modes (--quantization):
- auto: a GGUF file stored block-quantized (Q4_1, Q6_K...) is kept compressed as fp16
  on CPU; a float GGUF or a Hugging Face folder stays as --dtype says; on CUDA, or under --deterministic, everything is float as before
  (FBGEMM is CPU only, and its batch invariance is unverified).
- none: float, a GGUF dequantized at load (the reference path).
- fp16: weights in float16 through FBGEMM's fp16 GEMM, activations float32. Measured on
  SmolLM2 Q4_1: greedy tokens equal to `none` on a fixed prompt set (tests/test_quant_model.py).
- int8: int8 weights (one float32 scale per output row) through FBGEMM's dynamic int8
  GEMM, which ALSO quantizes each call's activations to uint8 (one scale per call).
  Fastest, but lossy on small models with outlier activations: on SmolLM2 it changes
  greedy answers from the first tokens (docs/BENCHMARKS.md); use it knowingly.
fp16 and int8 are refused by name on CUDA and with --deterministic.

Compressed tensors: every attention and MLP projection, the LM head and the embedding
table (fp16: a float16 table, each looked-up row widened; int8: Int8Rows, each row
dequantized). A head tied to the embedding gets its own FBGEMM-packed copy, so a tied
vocabulary costs 2 x its compressed size (still under float32's one copy). Norms and
biases stay float.

Invariants: `resolve_mode` never returns a mode the device cannot run; `tensor_bytes`
adds up exactly the bytes the model holds (tested against the tensors themselves).
"""
from __future__ import annotations

from collections import Counter
from typing import Iterable

import torch

from ...checkpoint import is_gguf

MODES = ("auto", "none", "fp16", "int8")
QUANTIZED_SUFFIXES = ("_proj.weight", "model.embed_tokens.weight", "lm_head.weight")


class QuantizationRefused(ValueError):
    """The flags ask for a compressed mode this device or mode cannot run."""


def resolve_mode(requested: str, model_path: str, device: torch.device, deterministic: bool = False) -> str:
    """'none', 'fp16' or 'int8' for this checkpoint on this device."""
    if requested not in MODES:
        raise QuantizationRefused(f"--quantization {requested!r} is not one of {', '.join(MODES)}")
    if requested in ("fp16", "int8"):
        if device.type != "cpu":
            raise QuantizationRefused(f"--quantization {requested} runs through FBGEMM, which is CPU only; "
                                      f"on {device.type} use --quantization none")
        if deterministic:
            raise QuantizationRefused(f"--quantization {requested} with --deterministic: FBGEMM's kernels "
                                      "are not verified batch-invariant; use --quantization none")
        return requested
    if requested == "auto" and device.type == "cpu" and not deterministic and block_quantized_gguf(model_path):
        return "fp16"
    return "none"


def block_quantized_gguf(model_path: str) -> bool:
    """A GGUF file whose projections are stored in a block-quantized type (Q4_1, Q6_K...):
    auto keeps those compressed. A float GGUF (F32/F16/BF16) is served as stored, like a
    Hugging Face folder, so its output stays bit-equal to the folder's."""
    if not is_gguf(model_path):
        return False
    from ...checkpoint.gguf_file import open_gguf
    from ...checkpoint.gguf_weights import hf_name, weight_names
    g = open_gguf(model_path)
    return any(g.tensors[n].type_name not in ("F32", "F16", "BF16")
               for n in weight_names(g) if should_quantize(hf_name(n)))


def should_quantize(name: str) -> bool:
    return name.endswith(QUANTIZED_SUFFIXES)


def tensor_bytes(tensors: Iterable) -> dict[str, int]:
    """Resident bytes by format ('int8' or a float dtype's name) of weights and biases."""
    out: Counter = Counter()
    for t in tensors:
        if t is None:
            continue
        if isinstance(t, torch.Tensor):
            out[str(t.dtype).removeprefix("torch.")] += t.numel() * t.element_size()
        else:  # Int8Rows (values + per-row scales), PackedInt8, PackedF16
            out[t.format] += t.nbytes
    return dict(out)


def describe_bytes(weights: dict[str, int], kv_bytes: int) -> str:
    parts = ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in sorted(weights.items()))
    return f"weights {sum(weights.values()) / 2**20:.1f} MiB ({parts}); KV pool {kv_bytes / 2**20:.1f} MiB"


def log_gguf_conversions(g, mode: str) -> None:
    """One log line per GGUF storage type among the tensors kept compressed: what it becomes."""
    import logging

    from ...checkpoint.gguf_weights import hf_name, weight_names
    counts: Counter = Counter(g.tensors[n].type_name for n in weight_names(g) if should_quantize(hf_name(n)))
    what = {"fp16": "float16 (FBGEMM fp16 GEMM, float32 activations)",
            "int8": "int8 with a float32 scale per row (FBGEMM dynamic int8 GEMM)"}[mode]
    log = logging.getLogger("ferroxmp.worker")
    for type_name, n in sorted(counts.items()):
        log.info("GGUF %s: %d tensors -> %s; torch's int4/int8 weight-only CPU kernels measured slower "
                 "than float32 here (tools/bench_quant.py)", type_name, n, what)
