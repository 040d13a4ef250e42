"""int4 / int8 weights on CUDA (quant/triton_groups.py), run on CPU tensors under
TRITON_INTERPRET=1 against Groups.dequantize in float64.

The kernels read the canonical layout (a byte holds values j and j + 16 of its group;
float16 d and m per group): a swapped nibble order, a wrong group or row stride, a
missing min or a tile edge read past the weight's rows lands far outside the bounds,
which are the rounding the kernel is allowed: float32 accumulation (float32
activations), and the weight widened to the activations' dtype before the tensor-core
dot plus the output's own rounding (float16 / bfloat16). Skipped only where Triton
cannot be installed.
"""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: kernels run on CPU tensors

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="triton is not installable on this platform")
from gguf import GGMLQuantizationType as Q  # noqa: E402

from ferroxmp.gpu_worker.quant.groups import Groups  # noqa: E402

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("TRITON_INTERPRET was set to something else before this module", allow_module_level=True)

from ferroxmp.gpu_worker.quant import triton_groups  # noqa: E402

# Relative rounding the kernel may do per dtype, when it widens the weight to the
# activations' dtype and when it rounds the output: half an ulp on a GPU; a whole one for
# bfloat16, whose casts the interpreter truncates (numpy has no bfloat16).
ROUNDING = {torch.float32: 2.0 ** -24, torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -7}


def _weight(rows: int, cols: int, fmt: str, seed: int) -> Groups:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g)
    w[1, 7] = 25.0   # an outlier group: a wide d
    w[rows - 1, :32] = 0.0  # an all-zero group (d = 0) in the last row, past a tile edge
    return Groups.quantize(w, fmt)


def _excess(y: torch.Tensor, x: torch.Tensor, g: Groups) -> float:
    """How far |y - x @ w^T| goes past the rounding the kernel may do (<= 0: within): the
    weight and the output each rounded to x's dtype, float32 sums (a relative 2^-20 of
    sum |x||w|). A swapped nibble order, a missing min or a wrong stride costs ~10% of
    sum |x||w|, far past it."""
    w = g.dequantize(torch.float64)
    want = x.double() @ w.T
    size = x.double().abs() @ w.abs().T
    bound = size * (ROUNDING[x.dtype] + 2.0 ** -20) + want.abs() * ROUNDING[x.dtype]
    assert y.dtype == x.dtype and y.shape == want.shape
    return ((y.double() - want).abs() - bound).max().item()


def _check(y: torch.Tensor, x: torch.Tensor, g: Groups) -> None:
    excess = _excess(y, x, g)
    assert excess <= 0, f"worst error {excess:.3g} past the bound"


@pytest.mark.parametrize("fmt", ["int4", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m", [1, 5, 16, 17, 40, triton_groups.DEQUANT_ROWS + 6])
def test_groups_linear_equals_the_dequantized_weight_times_x(fmt, dtype, m):
    """Rows 1..64 through the tiled kernel (tiles of 16 rows, a partial one), more through
    the widened weight and a GEMM; 72 weight rows (a partial tile of 64), 3 groups."""
    g = _weight(72, 96, fmt, seed=m)
    x = torch.randn(m, 96, generator=torch.Generator().manual_seed(100 + m)).to(dtype)
    x[0, 3] = 12.0
    _check(triton_groups.groups_linear(x, g), x, g)


@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_a_bias_a_batch_shape_and_a_strided_input_are_handled(fmt):
    g = _weight(40, 64, fmt, seed=3)
    base = torch.randn(2, 3, 128, generator=torch.Generator().manual_seed(4))
    x = base[..., ::2]  # last dimension strided: the kernel must not read it as contiguous
    b = torch.randn(40, generator=torch.Generator().manual_seed(5))
    y = triton_groups.groups_linear(x, g, b)
    assert y.shape == (2, 3, 40)
    _check(y.reshape(6, 40) - b, x.reshape(6, 64), g)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_the_bound_sees_a_weight_read_in_the_wrong_layout(dtype):
    """The check can fail: the same kernel on a weight whose nibbles are swapped (values
    j and j + 16 exchanged), or whose min is dropped, lands past the bound."""
    g = _weight(72, 96, "int4", seed=9)
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(10)).to(dtype)
    swapped = Groups((g.q >> 4) | (g.q << 4), g.d, g.m)
    no_min = Groups(g.q, g.d, torch.zeros_like(g.m))
    for wrong in (swapped, no_min):
        assert _excess(triton_groups.groups_linear(x, wrong), x, g) > 0


@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_the_widened_weight_is_the_dequantized_one_exactly(fmt):
    g = _weight(70, 128, fmt, seed=6)
    assert torch.equal(triton_groups.dequantize(g, torch.float32), g.dequantize(torch.float32))


def test_a_model_on_the_triton_path_gives_the_dequantized_models_logits_and_tokens(tiny_models, tmp_path,
                                                                                monkeypatch, make_harness):
    """The whole model with Q4_1 / Q8_0 blocks held as Groups and multiplied by the Triton
    kernels (Groups.on_cpu patched off, so the runner keeps the canonical layout and calls
    the kernels on CPU tensors, as it would on a GPU): the fused qkv / gate-up, the
    embedding read row by row and the tied head through them. Same logits (float32
    rounding) and the same greedy tokens as the model whose weights were dequantized at
    load (--quantization none), prefill and decode."""
    from gguf_writer import write_gguf

    from ferroxmp.frontend.text.tokenizer import TextCodec
    codec = TextCodec(tiny_models["llama"])
    prompts = {0: codec.encode("The quick brown fox"), 1: codec.encode("jumps over the lazy dog, then")}
    for qtype in (Q.Q4_1, Q.Q8_0):
        path = write_gguf(tiny_models["llama"], str(tmp_path / f"llama-{qtype.name}.gguf"), qtype)
        want_tokens, want_logits = make_harness(path, max_rows=2, quantization="none").generate(prompts, 6)
        with monkeypatch.context() as p:
            p.setattr(Groups, "on_cpu", property(lambda self: False))
            calls = []
            real = triton_groups.groups_linear
            p.setattr(triton_groups, "groups_linear", lambda *a, **k: calls.append(1) or real(*a, **k))
            h = make_harness(path, max_rows=2, quantization="int4", fused_decode=False)
            assert isinstance(h.runner.model.lm_head, Groups)  # not repacked for the CPU kernel
            got_tokens, got_logits = h.generate(prompts, 6)
        assert calls, "the Triton kernels were never called"
        assert got_tokens == want_tokens, qtype.name
        for r in prompts:
            for a, b in zip(got_logits[r], want_logits[r]):
                assert torch.allclose(a.float(), b.float(), rtol=1e-4, atol=1e-4), (qtype.name, (a - b).abs().max())
