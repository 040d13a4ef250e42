"""The one-call decode step (quant/one_row.c): a single decoding row through every layer
natively, against the eager torch path on the same weights.

Oracle: the same runner with --disable-fused-decode (the eager path, which test_quant
checks layer by layer against the dequantized float weights and test_default_model
against transformers). The fused step sums in another order, so logits are compared
within a bound (float32 rounding over a few thousand terms, amplified by 2-4 layers:
1e-4 of the logits' scale) and greedy tokens must be equal. The K/V it writes are
checked by what later steps read: a row that sits out a step leaves the decode mirror
and is refilled from the pool (so a missing pool write would change its tokens), and a
batched step reads the mirror the fused steps wrote (with float32 weights, its two rows
through f32_mm: small_rows_linear, against torch's GEMM in the eager runner).
"""
from __future__ import annotations

import pytest
import torch

from ferroxmp.gpu_worker.quant.one_row import OneRowDecode
from ferroxmp.gpu_worker.quant.packed import linear, small_rows_linear
from ferroxmp.protocol import RowStep, SamplingParams, unpack_ids

GREEDY = SamplingParams(temperature=0.0)


def _drive(h) -> tuple[list[int], list[torch.Tensor], int]:
    """Row 0 alone: prefill, 6 single-row decode steps; row 1's prefill and one decode
    step alone (row 0 sits out: it leaves the mirror); then both decode together for 4
    steps (row 0 refilled from the pool). Returns the tokens, each step's logits, and the
    one-row calls made."""
    p0, p1 = [5, 9, 300, 17, 4, 77, 12, 801, 3, 3, 64], list(range(40, 73))
    calls = []
    if h.runner.model.one_row is not None:
        inner = h.runner.model.one_row.fn
        h.runner.model.one_row.fn = lambda *a: calls.append(1) or inner(*a)
    toks, logits = [], []

    def step(new, steps):
        res = h.run(new, steps)
        assert res.error is None and not res.row_errors, (res.error, res.row_errors)
        got = dict(zip(unpack_ids(res.rows).tolist(), unpack_ids(res.tokens).tolist()))
        logits.append(h.runner.last_logits.clone())
        return got

    out0 = [step([h.new_row(0, p0)], [RowStep(0, 0, len(p0), True)])[0]]
    for _ in range(6):
        out0.append(step([], [RowStep(0, len(p0) + len(out0) - 1, 1, True)])[0])
    out1 = [step([h.new_row(1, p1)], [RowStep(1, 0, len(p1), True)])[1]]
    out1.append(step([], [RowStep(1, len(p1), 1, True)])[1])
    for _ in range(4):
        got = step([], [RowStep(0, len(p0) + len(out0) - 1, 1, True), RowStep(1, len(p1) + len(out1) - 1, 1, True)])
        out0.append(got[0])
        out1.append(got[1])
    return out0 + out1, logits, len(calls)


@pytest.mark.parametrize("shape,mode", [("llama", "int4"), ("qwen2", "int8"), ("qwen3", "int4"), ("qwen3", "int8"),
                                        ("qwen2", "none"), ("qwen3", "none")])
def test_a_single_decoding_row_in_one_call_gives_the_eager_steps_tokens_and_logits(tiny_models, make_harness,
                                                                                    shape, mode):
    """llama (GQA), qwen2 (q/k/v biases), qwen3 (q/k norms); int4, int8 and float32
    weights (each kernel beside each optional part)."""
    fused = make_harness(tiny_models[shape], page_size=4, max_rows=2, pages_per_row=64, quantization=mode)
    assert fused.runner.model.one_row is not None
    eager = make_harness(tiny_models[shape], page_size=4, max_rows=2, pages_per_row=64, quantization=mode,
                         fused_decode=False)
    assert eager.runner.model.one_row is None
    if mode == "none":  # the two rows' steps: f32_mm against torch's GEMM
        assert fused.runner.model.linear is small_rows_linear and eager.runner.model.linear is linear
    got, got_logits, calls = _drive(fused)
    want, want_logits, _ = _drive(eager)
    assert calls == 7, "the single-row steps did not take the one-call path"
    for g, w in zip(got_logits, want_logits):
        assert (g - w).abs().max() <= 1e-4 * w.abs().max(), (g - w).abs().max()
    assert got == want


def test_the_real_model_answers_the_same_in_one_call(make_harness):
    """SmolLM2's Q4_1 GGUF under int4 (its file's own blocks): one question decoded alone,
    24 tokens, fused and eager."""
    from ferroxmp.checkpoint.default_model import default_model_path
    from ferroxmp.frontend.text.tokenizer import TextCodec
    path = default_model_path()
    prompt = TextCodec(path).encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    answers = {}
    for fused in (True, False):
        h = make_harness(path, max_rows=1, pages_per_row=8, quantization="int4", fused_decode=fused)
        assert (h.runner.model.one_row is not None) == fused
        answers[fused], logits = h.generate({0: prompt}, 24)
        answers[fused] = (answers[fused][0], logits[0])
        h.close()
    assert answers[True][0] == answers[False][0]
    for g, w in zip(answers[True][1], answers[False][1]):
        assert (g - w).abs().max() <= 1e-4 * w.abs().max()


def test_where_it_cannot_run_the_step_stays_eager_and_says_why(tiny_models, make_harness):
    fp16 = make_harness(tiny_models["llama"], quantization="fp16")  # FBGEMM's packed float16
    assert fp16.runner.model.one_row is None
    assert "float32 rows" in OneRowDecode.why_not(fp16.runner.model, fp16.runner.kv, fp16.runner.attn)
    bf16 = make_harness(tiny_models["llama"], quantization="none", dtype="bfloat16")
    assert bf16.runner.model.one_row is None
    assert "float32 rows" in OneRowDecode.why_not(bf16.runner.model, bf16.runner.kv, bf16.runner.attn)
    det = make_harness(tiny_models["llama"], quantization="none", deterministic=True)
    assert det.runner.model.one_row is None
    assert "--deterministic" in OneRowDecode.why_not(det.runner.model, det.runner.kv, det.runner.attn)
    window = make_harness(tiny_models["mistral"], quantization="int4")  # a sliding window: no decode mirror
    assert window.runner.model.one_row is None
    assert "mirror" in OneRowDecode.why_not(window.runner.model, window.runner.kv, window.runner.attn)


def test_disable_fused_decode_is_a_flag_and_off_by_default():
    from ferroxmp.config import parse_server_args
    assert parse_server_args([]).disable_fused_decode is False
    assert parse_server_args(["--disable-fused-decode"]).disable_fused_decode is True


def test_the_avx2_build_gives_the_eager_steps_tokens_too(tiny_models, tmp_path):
    """On an AVX-512 machine the native build never runs one_row.c's AVX2 lanes (its dot,
    its exponential, its power of two): a haswell build in a subprocess (its own kernel
    cache) must pass the same comparison, on qwen3 (q/k norms) with int4 and float32
    weights."""
    import os
    from avx2_build import run_avx2
    tests = os.path.dirname(os.path.abspath(__file__))
    code = (f"import sys; sys.path.insert(0, {tests!r})\n"
            "from conftest import RunnerHarness\n"
            "from test_one_row import _drive\n"
            "bad = []\n"
            "for mode in ('int4', 'none'):\n"
            "    kw = dict(page_size=4, max_rows=2, pages_per_row=64, quantization=mode)\n"
            f"    f = RunnerHarness({tiny_models['qwen3']!r}, **kw)\n"
            f"    e = RunnerHarness({tiny_models['qwen3']!r}, fused_decode=False, **kw)\n"
            "    (g, gl, calls), (w, wl, _) = _drive(f), _drive(e)\n"
            "    if not (calls == 7 and g == w and all(bool((a - b).abs().max() <= 1e-4 * b.abs().max())\n"
            "                                          for a, b in zip(gl, wl))):\n"
            "        bad.append(f'{mode}: {calls} calls, {g} vs {w}')\n"
            "    f.close(); e.close()\n"
            "print(bad or 'ok')\n")
    out = run_avx2(code, tmp_path)
    assert out.endswith("ok"), out
