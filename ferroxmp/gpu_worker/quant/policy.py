"""Which weights are kept compressed, in which format, and what they cost in memory.

Modes (--quantization):
- auto: a GGUF file stored block-quantized (Q4_1, Q6_K...) is kept as int4 on CPU (the
  fastest and smallest here: docs/BENCHMARKS.md 21; fp16 where the int4 kernels cannot
  be built); a float GGUF or a Hugging Face folder stays as
  --dtype says; on CUDA (until its kernels have been timed on a GPU), or under
  --deterministic, everything is float.
- none: float, a GGUF dequantized at load (the reference path).
- fp16: weights in float16 through FBGEMM's fp16 GEMM, activations float32.
- int4: weights in groups of 32 (groups.py; int4 multiplied by int4x16.c, activations on
  a 16-bit grid inside the matmul). The projections are int4; the embedding and the LM
  head int8 (their error reaches every logit). A GGUF keeps its Q4_0/Q4_1 and Q8_0
  tensors as stored (same values), its Q4_K as int4 with the same values (sub-block
  scales rounded to float16), and converts every other block type (Q5_*, Q6_K...) to
  int8, the nearest format with a kernel that holds their values to within 1/254 of a
  group's range.
- int8: every compressed tensor int8 in groups of 32 (a GGUF's Q8_0 as stored).
A tensor whose rows are not a multiple of 32 wide stays float. On CUDA int4/int8 run
through triton_groups.py (same layout, activations in the model's dtype); fp16 is CPU
only. All three are refused by name with --deterministic, and int4/int8 where their
kernels cannot be built (native.py on CPU, no Triton on CUDA).

Compressed tensors: every attention and MLP projection, the LM head and the embedding
table. fp16 packs a tied head as its own FBGEMM copy (2 x the table); int4/int8 multiply
by the embedding's own groups (one copy; int4: the packed Int4x16 serves both). Norms and biases stay float.

Invariants: `resolve_mode` never returns a mode the device cannot run; `tensor_bytes`
adds up exactly the bytes the model holds (tested against the tensors themselves), and
`stored_bytes` predicts it from the file headers alone.
"""
from __future__ import annotations

from collections import Counter
from typing import Iterable, Optional

import torch

from ferroxmp.checkpoint import is_gguf

MODES = ("auto", "none", "fp16", "int8", "int4")
QUANTIZED_SUFFIXES = ("_proj.weight", "model.embed_tokens.weight", "lm_head.weight")
TABLES = ("model.embed_tokens.weight", "lm_head.weight")
FLOAT_TYPES = ("F32", "F16", "BF16")
AS_STORED = {"Q4_0": "int4", "Q4_1": "int4", "Q8_0": "int8"}  # GGUF types groups.py reads unchanged
# GGUF types whose values groups.py reads unchanged but whose per-group scales it rounds
# to float16 once (Q4_K: d * 6-bit scale, dmin * 6-bit min per sub-block of 32)
AS_STORED_VALUES = {"Q4_K": "int4"}
READ_AS_GROUPS = {**AS_STORED, **AS_STORED_VALUES}  # Groups.from_gguf reads their blocks, no dequantize


def read_as_groups(type_name: str, fmt: Optional[str]) -> bool:
    """Groups.from_gguf reads this GGUF type's blocks straight into `fmt` (no dequantize)."""
    return fmt is not None and READ_AS_GROUPS.get(type_name) == fmt


class QuantizationRefused(ValueError):
    """The flags ask for a compressed mode this device or mode cannot run."""


def resolve_mode(requested: str, model_path: str, device: torch.device, deterministic: bool = False) -> str:
    """'none', 'fp16', 'int8' or 'int4' for this checkpoint on this device."""
    if requested not in MODES:
        raise QuantizationRefused(f"--quantization {requested!r} is not one of {', '.join(MODES)}")
    if requested in ("fp16", "int8", "int4"):
        if device.type != "cpu" and (requested == "fp16" or device.type != "cuda"):
            raise QuantizationRefused(f"--quantization {requested} has no kernel on {device.type}; "
                                      f"use --quantization none" + (" (or int4 / int8)" if device.type == "cuda" else ""))
        if deterministic:
            raise QuantizationRefused(f"--quantization {requested} with --deterministic: its kernels are not "
                                      "batch-invariant (a prefill chunk takes another path than a decode row); "
                                      "use --quantization none")
        if device.type == "cuda":
            try:
                import triton  # noqa: F401  (triton_groups.py's kernels)
            except ImportError:
                raise QuantizationRefused(f"--quantization {requested} on CUDA needs Triton "
                                          "(pip install triton)") from None
        elif requested != "fp16":
            from ferroxmp.gpu_worker.quant.native import available
            why = available()
            if why is not None:
                raise QuantizationRefused(f"--quantization {requested}: {why}")
        return requested
    if requested == "auto" and device.type == "cpu" and not deterministic and block_quantized_gguf(model_path):
        # int4 (the file's Q4 blocks as stored, its Q8_0 as int8, other types int8) is the
        # fastest on one stream and on 16 users and the smallest (docs/BENCHMARKS.md 21);
        # fp16 where its kernels cannot be built here.
        from ferroxmp.gpu_worker.quant.native import available
        return "int4" if available() is None else "fp16"
    return "none"


def block_quantized_gguf(model_path: str) -> bool:
    """A GGUF file whose projections are stored in a block-quantized type (Q4_1, Q6_K...):
    auto keeps those compressed. A float GGUF (F32/F16/BF16) is served as stored, like a
    Hugging Face folder, so its output stays bit-equal to the folder's."""
    if not is_gguf(model_path):
        return False
    from ferroxmp.checkpoint.gguf_file import open_gguf
    from ferroxmp.checkpoint.gguf_weights import hf_name, weight_names
    g = open_gguf(model_path)
    return any(g.tensors[n].type_name not in FLOAT_TYPES
               for n in weight_names(g) if should_quantize(hf_name(n)))


def should_quantize(name: str) -> bool:
    return name.endswith(QUANTIZED_SUFFIXES)


def target_format(name: str, shape: tuple, mode: str, stored: Optional[str] = None) -> Optional[str]:
    """The format tensor `name` is held in under `mode` ('fp16', 'int8', 'int4'), or None
    for the model's float dtype. `stored`: its GGUF type name (None for a float folder)."""
    if mode == "none" or not should_quantize(name):
        return None
    if mode == "fp16":
        return "fp16"
    if len(shape) != 2 or shape[1] % 32:
        return None
    if mode == "int8":
        return "int8"
    if stored in READ_AS_GROUPS:
        return READ_AS_GROUPS[stored]
    if stored is not None and stored not in FLOAT_TYPES:
        return "int8"
    return "int8" if name.endswith(TABLES) else "int4"


def format_bytes(fmt: Optional[str], shape: tuple, itemsize: int) -> int:
    if fmt in ("int4", "int8") and len(shape) == 2:
        # int4x16.c's blocks of 16 rows, the last padded with zeros (on CPU; a GPU holds the
        # rows unpadded, so there this counts at most 15 rows a tensor too many)
        shape = (-(-shape[0] // 16) * 16, shape[1])
    n = 1
    for d in shape:
        n *= d
    if fmt == "int4":
        return n // 2 + 4 * (n // 32)  # two values a byte; float16 d and m per group
    if fmt == "int8":
        return n + 2 * (n // 32)
    return n * (2 if fmt == "fp16" else itemsize)


def tensor_bytes(tensors: Iterable) -> dict[str, int]:
    """Resident bytes by format ('int4', 'int8' or a float dtype's name) of weights and biases."""
    out: Counter = Counter()
    for t in tensors:
        if t is None:
            continue
        if isinstance(t, torch.Tensor):
            out[str(t.dtype).removeprefix("torch.")] += t.numel() * t.element_size()
        else:  # Groups, PackedF16, PackedF32
            out[t.format] += t.nbytes
    return dict(out)


def describe_bytes(weights: dict[str, int], kv_bytes: int, kv_dtype: str = "") -> str:
    parts = ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in sorted(weights.items()))
    return f"weights {sum(weights.values()) / 2**20:.1f} MiB ({parts}); KV pool {kv_bytes / 2**20:.1f} MiB {kv_dtype}".rstrip()


def log_gguf_conversions(g, mode: str) -> None:
    """One log line per GGUF storage type among the tensors kept compressed: what it becomes."""
    import logging

    from ferroxmp.checkpoint.gguf_weights import hf_name, weight_names
    log = logging.getLogger("ferroxmp.worker")
    seen: Counter = Counter()
    for n in weight_names(g):
        info = g.tensors[n]
        fmt = target_format(hf_name(n), info.shape, mode, info.type_name)
        if fmt is not None:
            seen[(info.type_name, fmt)] += 1
    for (type_name, fmt), count in sorted(seen.items()):
        if fmt == "fp16":
            how = "float16 (FBGEMM fp16 GEMM, float32 activations)"
        elif AS_STORED.get(type_name) == fmt:
            how = f"{fmt} in groups of 32, as stored"
        elif read_as_groups(type_name, fmt):
            how = f"{fmt} in groups of 32, values as stored, sub-block scales rounded to float16"
        else:
            how = f"{fmt} in groups of 32 (dequantized, then requantized: {type_name} is not read as stored)"
        log.info("GGUF %s: %d tensors -> %s", type_name, count, how)
