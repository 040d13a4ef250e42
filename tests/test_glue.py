"""RowGlue (ferroxmp/gpu_worker/quant/glue.py): an eager step's RMSNorm, RoPE and SiLU-mul as
native row loops for a float32 model on CPU.

Oracles: models/llama.py's torch formulas on the same inputs (each op within float32
rounding: the loops sum in another order and take e^x from a polynomial within 2 ulp),
and the same runner with `model.glue = None` (logits of a prefill and decode steps within
1e-5 of their scale, the same greedy tokens) on the tiny Llama (llama3 RoPE scaling),
Qwen2 (q/k/v biases) and Qwen3 (q/k RMSNorm: strided rows) checkpoints.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ferroxmp.gpu_worker.quant.glue import RowGlue

pytestmark = pytest.mark.timeout(300)
EPS = 2.0 ** -23  # float32's relative rounding, with a factor 2 of slack per operation


def _glue(d: int = 64, positions: int = 512) -> RowGlue:
    g = torch.Generator().manual_seed(0)
    return RowGlue(torch.randn(positions, d, generator=g), torch.randn(positions, d, generator=g))


def test_rms_norm_matches_torch_on_contiguous_and_strided_rows():
    glue = _glue()
    g = torch.Generator().manual_seed(1)
    w = torch.randn(576, generator=g)
    for rows in (1, 3, 16, 40):
        x = torch.randn(rows, 576, generator=g) * 7
        want = w * F.rms_norm(x, (576,), eps=1e-5)
        assert (glue.rms(x, w, 1e-5) - want).abs().max() <= 8 * EPS * want.abs().max()
    qkv = torch.randn(20, 9 * 64 + 2 * 3 * 64, generator=g)
    q = qkv[:, :576].view(20, 9, 64)  # Qwen3's q norm: rows of a head, strided by the qkv width
    w64 = torch.randn(64, generator=g)
    want = w64 * F.rms_norm(q, (64,), eps=1e-6)
    got = glue.rms(q, w64, 1e-6)
    assert got.shape == q.shape and (got - want).abs().max() <= 8 * EPS * want.abs().max()


def test_rope_in_place_matches_torch_and_touches_only_its_heads():
    glue = _glue()
    g = torch.Generator().manual_seed(2)
    qkv = torch.randn(12, 9 * 64 + 2 * 3 * 64, generator=g)
    before = qkv.clone()
    pos = torch.tensor([0, 1, 5, 7, 100, 3, 511, 2, 9, 64, 65, 300])
    k = qkv[:, 576:768].view(12, 3, 64)
    cos, sin = glue.cos[pos][:, None], glue.sin[pos][:, None]
    kk = before[:, 576:768].view(12, 3, 64)
    want = kk * cos + torch.cat([-kk[..., 32:], kk[..., :32]], dim=-1) * sin
    out = glue.rope_(k, pos)
    assert out.data_ptr() == k.data_ptr()
    bound = 4 * EPS * (kk.abs() * cos.abs() + torch.cat([kk[..., 32:], kk[..., :32]], -1).abs() * sin.abs())
    assert ((k - want).abs() <= bound + 1e-30).all()
    assert torch.equal(qkv[:, :576], before[:, :576]) and torch.equal(qkv[:, 768:], before[:, 768:])


def test_silu_mul_matches_torch():
    glue = _glue()
    g = torch.Generator().manual_seed(3)
    for rows in (1, 5, 33):
        gu = torch.randn(rows, 2 * 1536, generator=g) * 6
        gu[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # e^x's range ends and the sign at 0
        want = F.silu(gu[:, :1536]) * gu[:, 1536:]
        got = glue.silu_mul(gu)
        assert ((got - want).abs() <= 8 * EPS * want.abs() + 1e-30).all(), rows


@pytest.mark.parametrize("shape", ["llama", "qwen2", "qwen3"])
def test_the_runner_with_glue_answers_what_torchs_ops_answer(tiny_models, make_harness, shape):
    """A chunked prefill (chunks of 7: rows at many positions) and 6 decode steps of 3 rows,
    every step eager (the fused step set aside), so the glue serves both."""
    prompts = {0: list(range(5, 30)), 1: [7, 300, 17, 4, 999, 123, 64, 3, 8], 2: list(range(400, 420))}
    runs = {}
    for native in (True, False):
        h = make_harness(tiny_models[shape], quantization="none", max_rows=3, pages_per_row=16)
        assert h.runner.model.glue is not None
        h.runner.model.fused_decode = None  # every step eager: the glue's rows are prefill and decode
        if not native:
            h.runner.model.glue = None
        runs[native] = h.generate(prompts, 6, chunk=7)
        h.close()
    (tok_n, log_n), (tok_t, log_t) = runs[True], runs[False]
    assert tok_n == tok_t
    for r in prompts:
        for a, b in zip(log_n[r], log_t[r]):
            assert (a - b).abs().max() <= 1e-5 * b.abs().max()


def test_the_glue_is_off_where_torchs_ops_must_run(tiny_models, make_harness):
    assert make_harness(tiny_models["llama"], quantization="none", deterministic=True).runner.model.glue is None
    assert make_harness(tiny_models["llama"], quantization="none", fused_decode=False).runner.model.glue is None
    assert make_harness(tiny_models["llama"], quantization="none", dtype="bfloat16").runner.model.glue is None
