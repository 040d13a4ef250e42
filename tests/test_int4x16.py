"""Int4x16 / Int8x16 (ferroxmp/gpu_worker/quant/int4x16.py + int4x16.c), the layout and
kernel every int4 and int8 weight is multiplied by once the model is built.

Oracles: the canonical Groups the weight was made from (its own `dequantize`, by torch
from the GGUF-layout fields), and tests/int4_oracle.py, the kernel's specification (the
dequantized weight times activations rounded to a 16-bit grid per group of 32) computed
in float64 by torch. The kernel must be within float32 rounding of the specification
(int4_oracle.float_bound: a wrong lane, nibble, scale or digit is off by orders of
magnitude more), and the specification within its grid's rounding of the float product.
int8 values span -127..127: the kernel reads them as q + 128 (VNNI) or as |q| with the
sign moved onto the activation (AVX2, AVX-512 without VNNI; tests/test_quant.py runs
those builds), so rows of extreme values (+-127) are part of every case.
"""
from __future__ import annotations

import pytest
import torch

from ferroxmp.gpu_worker.quant import Groups, pack
from ferroxmp.gpu_worker.quant.int4x16 import Int4x16, Int8x16
from int4_oracle import float_bound, rounded_product, rounding_bound

pytestmark = pytest.mark.timeout(120)


PACKED = {"int4": Int4x16, "int8": Int8x16}


def _weight(rows: int, cols: int, seed: int = 0, fmt: str = "int4") -> Groups:
    g = Groups.quantize(torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)), fmt)
    if fmt == "int8":  # every row's first group at the extremes (+-127): the unsigned / sign paths' edges
        g.q[:, :32] = torch.where(torch.arange(32) % 2 == 0, 127, -127).to(torch.int8)
    return g


@pytest.mark.parametrize("fmt", ["int4", "int8"])
@pytest.mark.parametrize("rows", [16, 99, 160])
def test_the_layout_holds_the_groups_values_and_reads_rows_back(rows, fmt):
    """Blocks of 16 rows (99: a last block of 3 rows and 13 of zero padding) hold exactly
    the values the Groups dequantize to; the embedding's row lookup (native) returns them
    in any order; the bytes counted are the packed tensors' (padding included)."""
    g = _weight(rows, 320, fmt=fmt)
    p = PACKED[fmt].from_groups(g)
    ref = g.dequantize()
    assert p.shape == g.shape and p.format == fmt
    assert torch.equal(p.dequantize(), ref)
    ids = torch.tensor([rows - 1, 0, 17 % rows, 5, 5])
    assert torch.equal(p.lookup(ids, torch.float32), ref[ids])
    assert torch.equal(p.lookup(ids[None], torch.float32), ref[ids][None])  # [1, n] ids keep their shape
    blocks = -(-rows // 16)
    per_row = 320 // 2 + 2 * 2 * 320 // 32 if fmt == "int4" else 320 + 2 * 320 // 32
    assert p.nbytes == blocks * 16 * per_row


@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_the_kernel_computes_its_specification_at_every_row_count(fmt):
    """1-20 activation rows (every pass of 16 and its rest), 33, 64 and 100; rows with an
    outlier, a group of zeros (its scale is 0) and a row of zeros; a 99-row weight (the
    padded last block) and a 1536-wide one. The model's packed form (packed.pack) is the
    same object kind."""
    gen = torch.Generator().manual_seed(5)
    for g in (_weight(99, 320, 1, fmt), _weight(48, 1536, 2, fmt)):
        p = pack(g, torch.float32)
        assert type(p) is PACKED[fmt]
        k = g.shape[1]
        for m in list(range(1, 21)) + [33, 64, 100]:
            x = torch.randn(m, k, generator=gen) * 3
            x[0, 0] = 400.0            # a channel of the residual stream's size
            x[-1, 32:64] = 0.0         # a whole group of zeros
            if m > 2:
                x[1] = 0.0             # a row of zeros
            got = p(x).double()
            assert ((got - rounded_product(g, x)).abs() <= float_bound(g, x)).all(), m
            exact = x.double() @ g.dequantize().double().T
            assert ((rounded_product(g, x) - exact).abs() <= rounding_bound(g, x)).all(), m


@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_the_activation_grid_is_16_bits_not_8(fmt):
    """The error against the float product is the 16-bit grid's (1/64516 of each group's
    largest value per activation), far inside what an int8 grid (1/254) makes: the check
    that the two digits are both used. Measured on a weight and activations like a real
    layer's (normal values, one outlier channel)."""
    g = _weight(256, 576, 3, fmt)
    x = torch.randn(8, 576, generator=torch.Generator().manual_seed(4))
    x[:, 7] = 60.0
    exact = x.double() @ g.dequantize().double().T
    err = (pack(g, torch.float32)(x).double() - exact).abs().max()
    int8_scale = (x.abs().reshape(8, -1, 32).amax(-1).double() / 254) @ g.dequantize().double().abs().reshape(
        256, -1, 32).sum(-1).T
    assert err < 0.01 * float(int8_scale.max())


@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_bias_and_leading_dimensions_are_those_of_f_linear(fmt):
    g = _weight(40, 64, 6, fmt)
    x = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(7))
    b = torch.randn(40, generator=torch.Generator().manual_seed(8))
    p = pack(g, torch.float32)
    got = p(x, b)
    assert got.shape == (2, 3, 40)
    x2 = x.reshape(6, 64)
    bound = float_bound(g, x2) + 2.0 ** -23 * (rounded_product(g, x2).abs() + b.abs().double())  # + the bias's add
    assert ((got.reshape(6, 40).double() - b.double() - rounded_product(g, x2)).abs() <= bound).all()

