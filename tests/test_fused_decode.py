"""The fused step (quant/fused_decode.c): up to 16 tokens (decoding rows, a short prompt's
prefill, a speculative verify: each token a row at its own position) through every
layer in one native call, against the eager torch path on the same weights.

Oracle: the same runner with --disable-fused-decode (the eager path, which test_quant
checks layer by layer against the dequantized float weights and test_default_model
against transformers). The fused step sums in another order, so logits are compared
within a bound (float32 rounding over a few thousand terms, amplified by 2-4 layers:
1e-4 of the logits' scale) and greedy tokens must be equal. The K/V it writes are
checked by what later steps read: a row that sits out a step leaves the decode mirror
and is refilled from the pool (so a missing pool write would change its tokens), and a
mixed step (a prefill beside a decoding row: eager) reads back from the pool the K/V
the fused steps wrote (with float32 weights, its rows through the same panels' kernel,
whose rows round alike at any row count).
"""
from __future__ import annotations

import pytest
import torch

from ferroxmp.gpu_worker.quant.fused_decode import FUSED_ROWS, FusedDecode
from ferroxmp.gpu_worker.quant.packed import PackedF32
from ferroxmp.protocol import RowStep, SamplingParams, unpack_ids

GREEDY = SamplingParams(temperature=0.0)
# (rows, the LM head in the call) of each fused call in _drive: every step of at most 16
# tokens, i.e. the prefills of p0 (11 tokens) and p2 (5) as well as the decode steps; the
# mixed step (34 tokens) eager. A decode step's logits come from its call (every token
# samples); a prefill's from lm_head after it (only its last token does).
FUSED_CALLS = [(11, False)] + [(1, True)] * 7 + [(2, True)] * 3 + [(5, False)] + [(3, True)] * 3


def _drive(h) -> tuple[list[int], list[torch.Tensor], list[int]]:
    """Row 0 alone: prefill, 6 decode steps; row 1's prefill beside row 0's decode (a
    mixed step: eager); row 1's decode alone (row 0 sits out: it leaves the mirror); then
    both decode together for 3 steps (row 0 refilled from the pool), and with row 2 (a
    new prompt, prefilled alone) three rows for 3 steps. Returns the tokens, each step's
    logits, and the rows of each fused call."""
    p0, p1, p2 = [5, 9, 300, 17, 4, 77, 12, 801, 3, 3, 64], list(range(40, 73)), [8, 1, 2, 500, 9]
    calls = []
    if h.runner.model.fused_decode is not None:
        inner = h.runner.model.fused_decode.fn
        h.runner.model.fused_decode.fn = lambda *a: calls.append((a[1].value, a[-2] is not None)) or inner(*a)
    out = {0: [], 1: [], 2: []}
    logits = []

    def step(new, rows):
        steps = [RowStep(r, 0, len(p), True) if r in new else RowStep(r, len(p) + len(out[r]) - 1, 1, True)
                 for r, p in rows]
        res = h.run([h.new_row(r, new[r]) for r in new], steps)
        assert res.error is None and not res.row_errors, (res.error, res.row_errors)
        for r, t in zip(unpack_ids(res.rows).tolist(), unpack_ids(res.tokens).tolist()):
            out[r].append(t)
        logits.append(h.runner.last_logits.clone())

    step({0: p0}, [(0, p0)])
    for _ in range(6):
        step({}, [(0, p0)])
    step({1: p1}, [(0, p0), (1, p1)])
    step({}, [(1, p1)])
    for _ in range(3):
        step({}, [(0, p0), (1, p1)])
    step({2: p2}, [(2, p2)])
    for _ in range(3):
        step({}, [(0, p0), (1, p1), (2, p2)])
    return out[0] + out[1] + out[2], logits, calls


@pytest.mark.parametrize("shape,mode", [("llama", "int4"), ("qwen2", "int8"), ("qwen3", "int4"), ("qwen3", "int8"),
                                        ("qwen2", "none"), ("qwen3", "none")])
def test_decoding_rows_in_one_call_give_the_eager_steps_tokens_and_logits(tiny_models, make_harness, shape, mode):
    """llama (GQA), qwen2 (q/k/v biases), qwen3 (q/k norms); int4, int8 and float32
    weights (each kernel beside each optional part)."""
    fused = make_harness(tiny_models[shape], page_size=4, max_rows=3, pages_per_row=64, quantization=mode)
    assert fused.runner.model.fused_decode is not None
    eager = make_harness(tiny_models[shape], page_size=4, max_rows=3, pages_per_row=64, quantization=mode,
                         fused_decode=False)
    assert eager.runner.model.fused_decode is None
    if mode == "none":  # float32 panels (any row count) against torch's F.linear on plain weights
        assert isinstance(fused.runner.model.layers[0].w_qkv, PackedF32)
        assert isinstance(eager.runner.model.layers[0].w_qkv, torch.Tensor)
    got, got_logits, calls = _drive(fused)
    want, want_logits, _ = _drive(eager)
    assert calls == FUSED_CALLS, f"the steps of <= 16 tokens did not all take the fused path: {calls}"
    for g, w in zip(got_logits, want_logits):
        assert (g - w).abs().max() <= 1e-4 * w.abs().max(), (g - w).abs().max()
    assert got == want


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "float16"])
def test_rows_whose_pages_are_scattered_over_the_pool_read_their_own(tiny_models, make_harness, kv_cache_dtype):
    """The fused step reads each row's K/V through its page list (as pages grown one at a
    time by concurrent rows are: row r's j-th page is j * rows + r), not as one run."""
    got = {}
    for fused in (True, False):
        h = make_harness(tiny_models["llama"], page_size=4, max_rows=3, pages_per_row=64, quantization="int8",
                         fused_decode=fused, kv_cache_dtype=kv_cache_dtype)
        for r in range(3):
            h.pool.set_row(r, [j * 3 + r for j in range(64)], 0)
        got[fused] = _drive(h)
    assert got[True][2] == FUSED_CALLS
    assert got[True][0] == got[False][0]
    for g, w in zip(got[True][1], got[False][1]):
        assert (g - w).abs().max() <= 1e-4 * w.abs().max(), (g - w).abs().max()


def test_past_fused_rows_a_decode_step_runs_eagerly_with_the_same_tokens(tiny_models, make_harness):
    """A step of more rows than the fused step takes (its limit lowered to 2 here; 16 in
    service) runs eagerly, and the tokens stay those of the eager runner."""
    assert FUSED_ROWS == 16
    fused = make_harness(tiny_models["qwen3"], page_size=4, max_rows=3, pages_per_row=64, quantization="int4")
    fused.runner.model.fused_decode.max_rows = 2
    eager = make_harness(tiny_models["qwen3"], page_size=4, max_rows=3, pages_per_row=64, quantization="int4",
                         fused_decode=False)
    got, _, calls = _drive(fused)
    want, _, _ = _drive(eager)
    assert calls == [(1, True)] * 7 + [(2, True)] * 3, calls  # the prefills and the three-row steps went eager
    assert got == want


@pytest.mark.parametrize("mode", ["none", "int4"])
def test_the_real_model_answers_the_same_in_one_call(make_harness, mode):
    """SmolLM2's Q4_1 GGUF dequantized to float32 (none) or as its file's own blocks (int4):
    one question decoded alone, 24 tokens, fused and eager: the same tokens. Float32: logits
    within 1e-4 of their scale. int4 rounds each group of activations to a grid of 1/32258
    of its largest value inside each matmul (int4x16.c): where the two paths' float sums
    differ in the last bit a value may round the other way, ~1e-4 of the logits' scale here,
    what the grid moves them by against float32 at all. So each step's difference must stay
    within twice int4's largest distance from the float32 path's logits (each path within
    that distance of float32)."""
    from ferroxmp.checkpoint.default_model import default_model_path
    from ferroxmp.frontend.text.tokenizer import TextCodec
    from int4_oracle import logit_noise
    path = default_model_path()
    prompt = TextCodec(path).encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    answers = {}
    for key in ((mode, True), (mode, False)) + ((("none", False),) if mode == "int4" else ()):
        h = make_harness(path, max_rows=1, pages_per_row=8, quantization=key[0], fused_decode=key[1])
        assert (h.runner.model.fused_decode is not None) == key[1]
        answers[key] = h.generate({0: prompt}, 24)
        h.close()
    (fused, fused_logits), (eager, eager_logits) = answers[(mode, True)], answers[(mode, False)]
    assert fused == eager
    noise = logit_noise(eager, eager_logits, *answers[("none", False)]) if mode == "int4" else 0.0
    for g, w in zip(fused_logits[0], eager_logits[0]):
        assert (g - w).abs().max() <= max(1e-4 * w.abs().max(), 2 * noise)


def test_where_it_cannot_run_the_step_stays_eager_and_says_why(tiny_models, make_harness):
    fp16 = make_harness(tiny_models["llama"], quantization="fp16")  # FBGEMM's packed float16
    assert fp16.runner.model.fused_decode is None
    assert "float32 panels" in FusedDecode.why_not(fp16.runner.model, fp16.runner.kv, fp16.runner.attn)
    bf16 = make_harness(tiny_models["llama"], quantization="none", dtype="bfloat16")
    assert bf16.runner.model.fused_decode is None
    assert "float32 panels" in FusedDecode.why_not(bf16.runner.model, bf16.runner.kv, bf16.runner.attn)
    det = make_harness(tiny_models["llama"], quantization="none", deterministic=True)
    assert det.runner.model.fused_decode is None
    assert "--deterministic" in FusedDecode.why_not(det.runner.model, det.runner.kv, det.runner.attn)
    window = make_harness(tiny_models["mistral"], quantization="int4")
    assert window.runner.model.fused_decode is None
    assert "sliding window" in FusedDecode.why_not(window.runner.model, window.runner.kv, window.runner.attn)


@pytest.mark.parametrize("fused", [True, False])
def test_an_idle_worker_gives_the_mirror_back_and_the_next_steps_are_unchanged(tiny_models, make_harness, fused):
    """runner.idle() (the worker calls it after a poll interval without work) drops the
    decode mirror's memory; the rows are refilled from the pool at the next step, so the
    tokens and the logits are those of a run that never went idle, to the bit. With the
    native kernels (fused=True) decode rows are read from the pool's pages and there is
    no mirror at all; idle() still releases the heap."""
    runs = {}
    for idle in (False, True):
        h = make_harness(tiny_models["llama"], page_size=4, max_rows=2, pages_per_row=64, quantization="none",
                         fused_decode=fused)
        p = [5, 9, 300, 17, 4, 77, 12]
        toks, logits = [], []
        for i in range(7):
            if idle and i == 4:
                mirror = h.runner.attn.mirror
                if fused:
                    assert mirror is None and h.runner.attn.page_decode is not None
                else:
                    assert mirror.k.numel() > 0 and mirror.held == {0: len(p) + 3}, "nothing to give back"
                h.runner.idle()
                assert fused or (mirror.k.numel() == 0 and not mirror.held)
            steps = [RowStep(0, 0, len(p), True)] if i == 0 else [RowStep(0, len(p) + i - 1, 1, True)]
            res = h.run([h.new_row(0, p)] if i == 0 else [], steps)
            assert res.error is None and not res.row_errors
            toks += unpack_ids(res.tokens).tolist()
            logits.append(h.runner.last_logits.clone())
        runs[idle] = toks, logits
        h.close()
    assert runs[True][0] == runs[False][0]
    assert all(torch.equal(a, b) for a, b in zip(runs[True][1], runs[False][1]))


def test_disable_fused_decode_is_a_flag_and_off_by_default():
    from ferroxmp.config import parse_server_args
    assert parse_server_args([]).disable_fused_decode is False
    assert parse_server_args(["--disable-fused-decode"]).disable_fused_decode is True


def test_the_avx2_build_gives_the_eager_steps_tokens_too(tiny_models, tmp_path):
    """On an AVX-512 machine the native build never runs fused_decode.c's AVX2 lanes (its dot,
    its exponential, its power of two): a haswell build in a subprocess (its own kernel
    cache) must pass the same comparison, on qwen3 (q/k norms) with int4 and float32
    weights."""
    import os
    from avx2_build import run_avx2
    tests = os.path.dirname(os.path.abspath(__file__))
    code = (f"import sys; sys.path.insert(0, {tests!r})\n"
            "from conftest import RunnerHarness\n"
            "from test_fused_decode import FUSED_CALLS, _drive\n"
            "bad = []\n"
            "for mode in ('int4', 'none'):\n"
            "    kw = dict(page_size=4, max_rows=3, pages_per_row=64, quantization=mode)\n"
            f"    f = RunnerHarness({tiny_models['qwen3']!r}, **kw)\n"
            f"    e = RunnerHarness({tiny_models['qwen3']!r}, fused_decode=False, **kw)\n"
            "    (g, gl, calls), (w, wl, _) = _drive(f), _drive(e)\n"
            "    if not (calls == FUSED_CALLS and g == w and all(\n"
            "            bool((a - b).abs().max() <= 1e-4 * b.abs().max()) for a, b in zip(gl, wl))):\n"
            "        bad.append(f'{mode}: {calls} calls, {g} vs {w}')\n"
            "    f.close(); e.close()\n"
            "print(bad or 'ok')\n")
    out = run_avx2(code, tmp_path)
    assert out.endswith("ok"), out


_ARGMAX_CASES = (
    "import ctypes, numpy as np\n"
    "from ferroxmp.gpu_worker.quant.native import library\n"
    "def cases():\n"
    "    x = np.random.default_rng(0).standard_normal((8, 4099)).astype(np.float32)\n"
    "    x[1, 7] = x[1, 4000] = np.nan\n"  # the first NaN
    "    x[2, 3] = x[2, 9] = x[2, 4098] = 1e3\n"  # the first of equal maxima
    "    x[3] = 0.0\n"
    "    x[4, -1] = np.inf\n"  # past the last whole vector
    "    x[5] = -np.inf\n"
    "    x[6, 4098] = np.nan\n"  # a NaN only in the tail
    "    x[7, 15] = 50.0; x[7, 16] = 50.0\n"  # equal maxima in two vectors
    "    for n in (4099, 4096, 31, 1):\n"
    "        yield np.ascontiguousarray(x[:, :n])\n"
    "def check():\n"
    "    bad = []\n"
    "    for a in cases():\n"
    "        top = np.zeros(a.shape[0], np.int64)\n"
    "        library().rows_argmax(a.shape[0], a.shape[1], a.ctypes.data_as(ctypes.c_void_p),\n"
    "                              top.ctypes.data_as(ctypes.c_void_p))\n"
    "        if top.tolist() != a.argmax(axis=-1).tolist():\n"
    "            bad.append((a.shape, top.tolist(), a.argmax(axis=-1).tolist()))\n"
    "    return bad\n")


def test_the_native_argmax_picks_what_numpy_picks(tmp_path):
    """The fused step's argmax (rows_argmax, the sampler's answer for greedy rows) against
    numpy's: the first of equal maxima, the first NaN, a maximum or NaN past the last whole
    vector, rows of -inf; in this machine's build and in an AVX2 (haswell) one."""
    from avx2_build import run_avx2
    scope: dict = {}
    exec(_ARGMAX_CASES, scope)
    assert scope["check"]() == []
    out = run_avx2(_ARGMAX_CASES + "print(check() or 'ok')\n", tmp_path)
    assert out.endswith("ok"), out
