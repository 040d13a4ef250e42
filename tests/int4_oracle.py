"""What the int4 / int8 kernel (ferroxmp/gpu_worker/quant/int4x16.c) is specified to compute,
in float64 from the canonical Groups fields (not from the kernel's own layout): the
dequantized weight times the activations rounded per group of 32 to a grid of 2 * 32258
steps (held as two int8 digits),

    y = x' @ dequantize()^T,   x' = s_g * v,  s_g = max|x_g| / 32258,
    v = round_half_even(x * (32258 / max|x_g|))   (float32 operations, as the kernel;
    v = 0 where max|x_g| <= 1e-30, whose reciprocal would overflow).

`rounded_product` is that product; the kernel's float32 arithmetic stays within
`float_bound` of it (a float32 sum of n terms in any order is within n * 2^-24 of the sum
of their magnitudes; per group the integer dot, its two scalings and the m term, slack
4). `rounding_bound` bounds how far the specification is from the float product
x @ dequantize()^T: each activation moves by at most s_g / 2, so the difference is at
most sum_g s_g / 2 * sum|w|_g.
"""
from __future__ import annotations

import torch

GRID = 32258.0  # 127 * 254


def _grid(x: torch.Tensor):
    xg = x.float().reshape(x.shape[0], -1, 32)
    amax = xg.abs().amax(-1, keepdim=True)
    # tensor / tensor: rounded once, as C; a group below 1e-30 counts as zeros (int4x16.c's X16_TINY)
    inv = torch.where(amax > 1e-30, torch.full_like(amax, GRID) / amax, 0.0)
    return amax / GRID, torch.round(xg * inv)


def rounded_product(g, x: torch.Tensor) -> torch.Tensor:
    s, xq = _grid(x)
    return (xq.double() * s.double()).reshape(x.shape[0], -1) @ g.dequantize().double().T


def float_bound(g, x: torch.Tensor) -> torch.Tensor:
    s, xq = _grid(x)
    w = g.dequantize().double().abs()
    terms = (xq.double().abs() * s.double()).reshape(x.shape[0], -1) @ w.T
    return 4 * (g.shape[1] + 64) * 2.0 ** -24 * terms + 1e-30


def rounding_bound(g, x: torch.Tensor) -> torch.Tensor:
    s, _ = _grid(x)
    wsum = g.dequantize().double().abs().reshape(g.shape[0], -1, 32).sum(-1)
    return (s.double().squeeze(-1) / 2 * (1 + 1e-6)) @ wsum.T


def logit_noise(q_tokens: dict, q_logits: dict, f_tokens: dict, f_logits: dict) -> float:
    """The largest difference between a quantized run's logits and the float run's, over
    the steps where both had been given the same tokens (each row up to and including
    its first differing token): what the quantization itself moves a logit by."""
    worst = 0.0
    for r in f_tokens:
        for i, (a, b) in enumerate(zip(q_tokens[r], f_tokens[r])):
            worst = max(worst, float((q_logits[r][i] - f_logits[r][i]).abs().max()))
            if a != b:
                break
    return worst


def product_and_bound(g, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What Groups `g` (int4 or int8, or its packed form) must give for x, in float64 (the
    specification above: both formats go through int4x16.c), and how far the kernel's
    float32 arithmetic may be from it."""
    return rounded_product(g, x), float_bound(g, x)

