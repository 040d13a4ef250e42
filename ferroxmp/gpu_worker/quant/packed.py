"""PackedF16: a float16 weight packed for FBGEMM's fp16 GEMM, called like F.linear.

Job: hold the packed weight and run `quantized::linear_dynamic_fp16`; `pack` decides
which form a loaded weight takes, and `linear(x, w, b)` is the one dispatch DecoderLM
uses (a float tensor goes to F.linear, anything else is called: PackedF16, Groups);
`cpu_f32_linear` is that dispatch with float32 CPU products routed by row count
(groups.c's f32_mm for 1-16 rows, `gemm`, oneDNN, for more).

Invariants: `nbytes` counts the float16 values (FBGEMM's packed copy holds the same
bytes in its own layout); CPU only (policy.resolve_mode refuses fp16 elsewhere).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ferroxmp.gpu_worker.quant.native import library, ptr


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
    """A weight in the form its kernel wants: a float16 tensor in a model that computes in
    another dtype (--quantization fp16) -> PackedF16; Groups -> Groups.packed() (int4:
    Int4x16, its kernel's layout); a float tensor as it is."""
    if isinstance(w, torch.Tensor) and w.dtype == torch.float16 and model_dtype != torch.float16:
        return PackedF16(w)
    return w if isinstance(w, torch.Tensor) else w.packed()


def linear(x: torch.Tensor, w, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """F.linear for a float weight; the weight's own kernel otherwise (PackedF16, Groups)."""
    if isinstance(w, torch.Tensor):
        return F.linear(x, w, bias)
    return w(x, bias)


# Activation rows for which float32 weights go through groups.c's f32_mm instead of
# torch's GEMM: a batch of decode rows. MKL's small-M path reads the LM head at half the
# rate f32_mm does at 4-8 rows, and MKL's one-row path at 0.4x of f32_mm's own
# (docs/BENCHMARKS.md 22-23); from ~24 rows on the GEMM wins.
SMALL_ROWS = (1, 16)


def f32_mm(x2: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x2 [m, k] @ w[n, k]^T through groups.c's f32_mm (both float32, contiguous, CPU;
    k a multiple of 32)."""
    y = torch.empty(x2.shape[0], w.shape[0])
    library().f32_mm(x2.shape[0], w.shape[0], w.shape[1], ptr(x2), ptr(w), ptr(y))
    return y


# torch's oneDNN matmul over a plain (not prepacked) float32 weight: on the AMD EPYC of
# docs/BENCHMARKS.md 23, 1.2-1.7x MKL's sgemm (F.linear's) at 32-512 rows, a prefill
# chunk's products; the same product within float rounding. False where this torch was
# built without oneDNN (then MKL's).
ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def gemm(x2: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x2 [m, k] @ w[n, k]^T (+ bias), float32 on CPU, many rows: oneDNN where torch has
    it (and torch.backends.mkldnn is not turned off), else F.linear."""
    if ONEDNN and torch.backends.mkldnn.enabled:
        return torch.ops.mkldnn._linear_pointwise(x2, w, bias, "none", [], "")
    return F.linear(x2, w, bias)


def cpu_f32_linear(x: torch.Tensor, w, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`linear`, with a float32 CPU weight through f32_mm for 1-16 rows and through `gemm`
    for more. The runner installs it as model.linear where the native kernels load (never
    --deterministic: a row's sum order here depends on how many rows the step has)."""
    if isinstance(w, torch.Tensor) and w.dtype == torch.float32 and x.dtype == torch.float32 \
            and w.is_contiguous() and w.device.type == "cpu":
        n, k = w.shape
        m = x.numel() // k
        if SMALL_ROWS[0] <= m <= SMALL_ROWS[1] and k % 32 == 0:
            y = f32_mm(x.reshape(m, k).contiguous(), w)
            if bias is not None:
                y += bias
            return y.reshape(*x.shape[:-1], n)
        if m > SMALL_ROWS[1] and (bias is None or bias.dtype == torch.float32):
            y = gemm(x.reshape(m, k).contiguous(), w, None if bias is None else bias.contiguous())
            return y.reshape(*x.shape[:-1], n)
    return linear(x, w, bias)
