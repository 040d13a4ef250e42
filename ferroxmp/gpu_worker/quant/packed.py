"""PackedInt8: an Int8Rows packed for FBGEMM's weight-int8 linear, called like F.linear.

Job: hold the packed weight (torch's `quantized::linear_prepack` over a per-channel
qint8 tensor: FBGEMM on x86) and run `quantized::linear_dynamic`, which quantizes the
activations of each call to uint8 (one scale per call, reduce_range as FBGEMM asks on
x86) and accumulates in int32; the output is float32, cast back to the input's dtype.
`linear(x, w, b)` is the one dispatch DecoderLM uses: a float tensor goes to F.linear.

Invariants: `nbytes` counts the int8 values and the per-row scales (what the weight
costs resident; FBGEMM's packed copy holds the same bytes in its own layout, and the
Int8Rows it came from is dropped unless the embedding lookup keeps it); CPU only (the
caller falls back to float on CUDA: policy.resolve_mode).
"""
from __future__ import annotations

import warnings
from typing import Optional

import torch
import torch.nn.functional as F

from .rows import Int8Rows


class PackedInt8:
    format = "int8"

    def __init__(self, rows: Int8Rows):
        if rows.q.device.type != "cpu":
            raise RuntimeError("int8 weights run through FBGEMM, which is CPU only")
        with warnings.catch_warnings():  # torch marks per-channel quantized tensors deprecated
            warnings.simplefilter("ignore")
            qw = torch._make_per_channel_quantized_tensor(
                rows.q, rows.scale.double(), torch.zeros(rows.q.shape[0], dtype=torch.long), 0)
            self.packed = torch.ops.quantized.linear_prepack(qw, None)
        self.out_features, self.in_features = rows.q.shape
        self.nbytes = rows.nbytes

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.out_features, self.in_features))

    def __call__(self, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        y = torch.ops.quantized.linear_dynamic(x.float().contiguous(), self.packed, True)
        if bias is not None:
            y = y + bias.float()
        return y.to(x.dtype)


class PackedF16:
    """A float16 weight packed for FBGEMM's fp16 GEMM: the activations stay float32 (the
    weights are widened inside the kernel, accumulation in float32), so the only error is
    the weights' rounding to float16, far below a GGUF type's own quantization step."""
    format = "float16"

    def __init__(self, w: torch.Tensor):
        if w.device.type != "cpu":
            raise RuntimeError("float16 weights run through FBGEMM, which is CPU only")
        self.packed = torch.ops.quantized.linear_prepack_fp16(w.float(), None)
        self.out_features, self.in_features = w.shape
        self.nbytes = w.numel() * 2

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.out_features, self.in_features))

    def __call__(self, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        y = torch.ops.quantized.linear_dynamic_fp16(x.float().contiguous(), self.packed)
        if bias is not None:
            y = y + bias.float()
        return y.to(x.dtype)


def pack(w, model_dtype: torch.dtype):
    """A weight in the form its kernel wants: Int8Rows -> PackedInt8; a float16 tensor in
    a model that computes in another dtype (--quantization fp16) -> PackedF16; else as is."""
    if isinstance(w, Int8Rows):
        return PackedInt8(w)
    if isinstance(w, torch.Tensor) and w.dtype == torch.float16 and model_dtype != torch.float16:
        return PackedF16(w)
    return w


def release_freed_memory() -> None:
    """Give freed float copies (a GGUF tensor dequantized on the way in, the float32
    input of a prepack) back to the OS: glibc keeps freed heap pages otherwise, and the
    resident size would still count them. A no-op where libc is not glibc."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def linear(x: torch.Tensor, w, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """F.linear for a float weight; the packed kernel for a PackedInt8."""
    if isinstance(w, torch.Tensor):
        return F.linear(x, w, bias)
    return w(x, bias)
