"""PackedF16 and PackedF32: float weights in a CPU kernel's layout, called like F.linear.

Job: PackedF16 holds a float16 weight packed for FBGEMM's fp16 GEMM
(`quantized::linear_dynamic_fp16`); PackedF32 a float32 weight in groups.c's panels.
`pack` decides which form a loaded weight takes, and `linear(x, w, b)` is the one
dispatch DecoderLM uses (a float tensor goes to F.linear, anything else is called:
PackedF16, PackedF32, Groups).

Invariants: `nbytes` counts the values as held (FBGEMM's packed copy holds the float16
bytes in its own layout); CPU only (policy.resolve_mode refuses fp16 elsewhere).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ferroxmp.gpu_worker.quant.native import library, ptr

PANEL = 32  # output rows a panel of a PackedF32 (groups.c's PANEL)


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


class PackedF32:
    """A float32 weight [N, K] as groups.c's panels: ceil(N / 32) blocks of [K][32] (output
    rows n..n+31, k-major, the last block zero-padded), multiplied by f32_panel_mm at any
    row count: at 8-16 rows 1.3-1.7x the kernels it replaced (a dot-product kernel over
    [N][K] rows, 1-16 rows, and oneDNN's GEMM past that), at one row the same read rate,
    past 32 rows level with oneDNN (docs/BENCHMARKS.md 31). A row's result does not depend
    on the call's other rows, to the bit. A tied embedding looks its rows up here.

    Invariants: the panels are the weight's values, bitwise; `nbytes` counts them (the
    padding included: under 32 rows of K)."""
    format = "float32"

    def __init__(self, w: torch.Tensor):
        if w.device.type != "cpu" or w.dtype != torch.float32 or w.dim() != 2:
            raise ValueError("PackedF32 holds a 2-D float32 CPU weight")
        n, k = w.shape
        blocks = -(-n // PANEL)
        padded = torch.zeros(blocks * PANEL, k) if n % PANEL else w
        if n % PANEL:
            padded[:n] = w
        self.panels = padded.reshape(blocks, PANEL, k).transpose(1, 2).contiguous()
        self.out_features, self.in_features = n, k
        self.nbytes = self.panels.numel() * 4

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.out_features, self.in_features))

    def __call__(self, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features).to(torch.float32).contiguous()
        y = torch.empty(x2.shape[0], self.out_features)
        library().f32_panel_mm(x2.shape[0], self.out_features, self.in_features, ptr(x2), ptr(self.panels), ptr(y))
        if bias is not None:
            y += bias
        return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def lookup(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` of the weight (an embedding's lookup): down one lane of their panels."""
        ids = ids.long()
        return self.panels[ids // PANEL, :, ids % PANEL].to(dtype)

    def dequantize(self) -> torch.Tensor:
        """The weight [N, K] as a plain tensor (a copy)."""
        return self.panels.transpose(1, 2).reshape(-1, self.in_features)[:self.out_features].clone()


def pack(w, model_dtype: torch.dtype, f32_panels: bool = False):
    """A weight in the form its kernel wants: a float16 tensor in a model that computes in
    another dtype (--quantization fp16) -> PackedF16; Groups -> Groups.packed() (int4:
    Int4x16, its kernel's layout); a float32 CPU tensor -> PackedF32 where `f32_panels`
    (the runner's choice: where the native kernels load); a float tensor otherwise as it
    is."""
    if isinstance(w, torch.Tensor) and w.dtype == torch.float16 and model_dtype != torch.float16:
        return PackedF16(w)
    if f32_panels and isinstance(w, torch.Tensor) and w.dtype == torch.float32 and w.device.type == "cpu":
        return PackedF32(w)
    return w if isinstance(w, torch.Tensor) else w.packed()


def linear(x: torch.Tensor, w, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """F.linear for a float weight; the weight's own kernel otherwise (PackedF16, Groups)."""
    if isinstance(w, torch.Tensor):
        return F.linear(x, w, bias)
    return w(x, bias)
