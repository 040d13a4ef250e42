"""--kv-cache-dtype float16: a float32 model's KV pool stores float16 (CPU).

Oracles:
- the bytes: a layer-0 K/V depends only on the token and the layer's weights, so what a
  float16 pool holds there must be, to the bit, the float32 run's K/V rounded to float16
  (torch's round-to-nearest-even), for the eager prefill's writes and for the fused
  decode step's (fused_decode.c's own conversion);
- what attention reads: a decode step (over the decode mirror) gives the logits a cold
  prefill of the same tokens (over the pool) gives, within float32 rounding, which holds
  only if the step's own K/V are rounded before the mirror takes them;
- the answers: fed the same tokens (teacher forcing), every step's logits stay within
  float16 rounding of the float32 pool's, and the greedy continuations of fused and eager
  steps are equal;
- the server: the same --kv-cache-gb holds twice the tokens, /server_info says so, and
  a chat answer is the float32 pool's; --deterministic and a wider-than-model pool are
  refused at start with the flag's name.
"""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from serverproc import greedy_ids, serving

from ferroxmp.gpu_worker.kv.pool import check_cache_dtype
from ferroxmp.gpu_worker.loader import load_config
from ferroxmp.protocol import RowStep, unpack_ids

PROMPT = [5, 9, 300, 17, 4, 77, 12, 801, 3, 3, 64, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51]


def _prefill(h, tokens: list[int], chunk: int) -> torch.Tensor:
    """Row 0's prompt in chunks of `chunk` tokens; the logits of its last position."""
    h.run([h.new_row(0, tokens)], [])
    for at in range(0, len(tokens), chunk):
        n = min(chunk, len(tokens) - at)
        res = h.run([], [RowStep(0, at, n, at + n == len(tokens))])
        assert res.error is None and not res.row_errors, (res.error, res.row_errors)
    return h.runner.last_logits[-1].clone()


def _decode(h, n: int, forced: list[int] | None = None) -> tuple[list[int], list[torch.Tensor]]:
    """After _prefill: n decode steps of row 0. Returns the token each step was fed (the
    one sampled before it) and each step's logits. With `forced`, step i is fed forced[i]
    whatever the row sampled (teacher forcing: both runs see the same inputs)."""
    fed, logits = [], []
    tokens = h.runner.rows[0].tokens
    for i in range(n):
        if forced is not None:
            tokens.array[-1] = forced[i]  # a view of the row's buffer: the step reads it
        fed.append(int(tokens[-1]))
        res = h.run([], [RowStep(0, len(tokens) - 1, 1, True)])
        assert res.error is None and not res.row_errors, (res.error, res.row_errors)
        logits.append(h.runner.last_logits[-1].clone())
    return fed, logits


def _slots(h, n: int) -> torch.Tensor:
    ps = h.page_size
    pages = torch.arange(h.pages_per_row)  # row 0 owns pages [0, pages_per_row)
    return (pages[:, None] * ps + torch.arange(ps)[None, :]).reshape(-1)[:n]


@pytest.mark.parametrize("shape,mode", [("llama", "none"), ("qwen3", "int4")])
def test_a_float16_pool_holds_the_float32_runs_layer0_kv_rounded_to_the_bit(tiny_models, make_harness, shape, mode):
    """Prefill (eager) and decode steps (fused: fused_decode.c's conversion) write layer 0."""
    a = make_harness(tiny_models[shape], page_size=4, max_rows=2, pages_per_row=16, quantization=mode)
    b = make_harness(tiny_models[shape], page_size=4, max_rows=2, pages_per_row=16, quantization=mode,
                     kv_cache_dtype="float16")
    assert a.runner.kv.dtype == torch.float32 and b.runner.kv.dtype == torch.float16
    assert b.runner.model.fused_decode is not None
    _prefill(a, PROMPT, 64)
    _prefill(b, PROMPT, 64)
    want, _ = _decode(a, 5)
    calls = []
    inner = b.runner.model.fused_decode.fn
    b.runner.model.fused_decode.fn = lambda *x: calls.append(x[1].value) or inner(*x)
    _decode(b, 5, want)
    assert calls == [1] * 5  # the decode steps ran fused
    slots = _slots(a, len(PROMPT) + 5)  # the prompt's K/V and the 5 fed tokens'
    for name in ("k", "v"):
        full = getattr(a.runner.kv, name)[0].index_select(1, slots)
        half = getattr(b.runner.kv, name)[0].index_select(1, slots)
        assert half.dtype == torch.float16
        assert torch.equal(half, full.to(torch.float16)), name


@pytest.mark.parametrize("fused", [True, False])
def test_a_decode_step_over_a_float16_pool_reads_what_a_cold_prefill_reads(tiny_models, make_harness, fused):
    """A decode step attends over its own new K/V beside the earlier ones (the eager path:
    in the decode mirror, filled from the pool; the fused step: the pool's pages); a
    prefill of the same tokens reads them all back from the pool.
    Equal within float32 rounding (~5e-7 measured; bound 1e-5) only if the step's own
    K/V were rounded to float16 before the mirror took them (unrounded: ~5e-5)."""
    kw = dict(page_size=4, max_rows=2, pages_per_row=16, quantization="none", kv_cache_dtype="float16",
              fused_decode=fused)
    warm = make_harness(tiny_models["llama"], **kw)
    assert (warm.runner.model.fused_decode is not None) == fused
    _prefill(warm, PROMPT, 64)
    fed, logits = _decode(warm, 4)
    for i in range(4):
        cold = make_harness(tiny_models["llama"], **kw)
        want = _prefill(cold, PROMPT + fed[:i + 1], 64)
        cold.close()
        assert (logits[i] - want).abs().max() <= 1e-5 * want.abs().max(), (i, (logits[i] - want).abs().max())


@pytest.mark.parametrize("fused", [True, False])
def test_float16_kv_answers_stay_within_float16_rounding_of_float32_kv(tiny_models, make_harness, fused):
    a = make_harness(tiny_models["llama"], page_size=4, max_rows=2, pages_per_row=16, quantization="none",
                     fused_decode=fused)
    b = make_harness(tiny_models["llama"], page_size=4, max_rows=2, pages_per_row=16, quantization="none",
                     fused_decode=fused, kv_cache_dtype="float16")
    assert (b.runner.model.fused_decode is not None) == fused
    la, lb = _prefill(a, PROMPT, 64), _prefill(b, PROMPT, 64)
    want, wl = _decode(a, 12)
    _, gl = _decode(b, 12, want)
    # K/V carry float16's relative rounding (2^-11); through a few layers of attention the
    # logits move by a small multiple of it, far below the 1e-2 a wrong read would give.
    for w, g in zip([la] + wl, [lb] + gl):
        assert (g - w).abs().max() <= 5e-3 * w.abs().max(), (g - w).abs().max()
        assert (g - w).abs().max() > 0  # the pool really stored float16
    assert [int(w.argmax()) for w in [la] + wl] == [int(g.argmax()) for g in [lb] + gl]


def test_fused_and_eager_steps_over_a_float16_pool_give_the_same_tokens(tiny_models, make_harness):
    a = make_harness(tiny_models["qwen2"], page_size=4, max_rows=2, pages_per_row=16, quantization="int8",
                     kv_cache_dtype="float16")
    b = make_harness(tiny_models["qwen2"], page_size=4, max_rows=2, pages_per_row=16, quantization="int8",
                     kv_cache_dtype="float16", fused_decode=False)
    _prefill(a, PROMPT, 64)
    _prefill(b, PROMPT, 64)
    got, gl = _decode(a, 10)
    want, wl = _decode(b, 10)
    assert got == want
    for g, w in zip(gl, wl):
        assert (g - w).abs().max() <= 1e-4 * w.abs().max()


def test_kv_cache_dtype_is_refused_where_nothing_stores_it(tiny_models):
    cpu = torch.device("cpu")
    cfg = load_config(tiny_models["llama"], "float32", "float16")
    assert cfg.cache_dtype == torch.float16 and cfg.kv_bytes_per_token() * 2 == load_config(
        tiny_models["llama"], "float32").kv_bytes_per_token()
    check_cache_dtype(cfg, cpu)
    with pytest.raises(ValueError, match="--kv-cache-dtype float16 .*--deterministic"):
        check_cache_dtype(cfg, cpu, deterministic=True)
    with pytest.raises(ValueError, match="--kv-cache-dtype float16 .*CUDA"):
        check_cache_dtype(cfg, torch.device("cuda"))
    wide = load_config(tiny_models["llama"], "bfloat16", "float32")
    with pytest.raises(ValueError, match="--kv-cache-dtype float32 .*not narrower"):
        check_cache_dtype(wide, cpu)
    with pytest.raises(ValueError, match="--kv-cache-dtype float16 .*not narrower than the model's bfloat16"):
        check_cache_dtype(load_config(tiny_models["llama"], "bfloat16", "float16"), cpu)
    assert load_config(tiny_models["llama"], "float32", "float32").kv_dtype is None  # the model's own: auto


def test_a_server_with_a_float16_kv_cache_holds_twice_the_tokens_and_answers_as_the_runner_does(
        tiny_models, make_harness):
    prompts = {0: [5, 6, 7, 8, 9, 10, 11], 1: list(range(20, 45))}
    h = make_harness(tiny_models["llama"], page_size=16, kv_cache_dtype="float16")
    want, _ = h.generate(prompts, 8)
    h.close()
    infos = {}
    for dtype in ("auto", "float16"):
        with serving(tiny_models["llama"], "--kv-cache-dtype", dtype, "--kv-cache-gb", "0.01") as srv:
            infos[dtype] = srv.info["worker_info"]["memory"]
            if dtype == "float16":
                got = greedy_ids(srv, prompts, 8)
    assert got == want
    assert infos["auto"]["kv_dtype"] == "float32" and infos["float16"]["kv_dtype"] == "float16"
    # the same budget (whole pages of 16 tokens below it), twice the tokens
    assert 0 <= infos["float16"]["kv_tokens"] - 2 * infos["auto"]["kv_tokens"] < 2 * 16
    for info in infos.values():
        per_token = info["kv_bytes"] // info["kv_tokens"]
        assert 0.01 * 2**30 - 16 * per_token < info["kv_bytes"] <= 0.01 * 2**30


def test_deterministic_with_a_float16_kv_cache_is_refused_at_start(tiny_models):
    r = subprocess.run([sys.executable, "-m", "ferroxmp.cli", "serve", "--model", tiny_models["llama"],
                        "--port", "1", "--kv-cache-dtype", "float16", "--deterministic", "--kv-pages", "64"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "--kv-cache-dtype float16 is not supported with --deterministic" in r.stdout + r.stderr
