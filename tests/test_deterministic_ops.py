"""Deterministic mode, op by op: which ops vary with the batch, and the fixes for them.

The measurement (issue 16: "measure which ops actually vary before changing them"):
`trace_ops` runs the real ModelRunner on one prompt alone and inside other batch mixes
and chunk splits, records every op's output per (row, position) and names the first op
whose bits differ. Default mode: F.linear at M = 1 / tail rows (fp32) and SDPA by chunk
(fp32, bf16) — see batch_invariant.py's docstring. Deterministic mode: none.
"""
from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ferroxmp.gpu_worker.attention import deterministic as attn_det
from ferroxmp.gpu_worker import runner as runner_mod
from ferroxmp.gpu_worker.attention import reference_attention
from ferroxmp.gpu_worker.attention.deterministic import DeterministicBackend
from ferroxmp.gpu_worker.batch_invariant import check_linear, invariant_linear
from ferroxmp.gpu_worker.kv.pool import KVPool
from ferroxmp.protocol import RowStep


def test_a_plain_matmul_gives_a_row_other_bits_in_another_batch_and_the_invariant_one_does_not():
    """The premise and the fix in one: on this CPU a float32 row multiplied alone (M=1)
    or in a tail tile differs from the same row in a full tile; called in fixed blocks of
    ROW_TILE rows it never does (padding M to a multiple of 4 was enough on an AMD EPYC, not
    on an Intel Xeon with AVX-512: the 576x1536 check below failed there at every M). If the
    first half stops holding (a new torch), the fix may be moot but the second half still
    has to hold."""
    torch.manual_seed(0)
    w, x = torch.randn(192, 64), torch.randn(67, 64)
    alone = torch.cat([F.linear(x[i:i + 1], w) for i in range(67)])
    assert not torch.equal(F.linear(x, w), alone), "plain F.linear was row-invariant here: re-measure"
    inv_alone = torch.cat([invariant_linear(x[i:i + 1], w) for i in range(67)])
    for m in (1, 2, 3, 5, 8, 33, 67):
        for off in (0, 1, 2):
            if off + m <= 67:
                assert torch.equal(invariant_linear(x[off:off + m], w), inv_alone[off:off + m]), (m, off)
    for dtype in (torch.float32, torch.bfloat16):
        check_linear(torch.randn(576, 1536).to(dtype), torch.randn(576).to(dtype))  # raises if not


def _pool(page_size=4, pages=64, dtype=torch.float32, kvh=2, dim=16):
    kv = KVPool(pages, page_size, 1, kvh, dim, dtype, torch.device("cpu"), layout="hnd")
    g = torch.Generator().manual_seed(1)
    kv.k.copy_(torch.randn(kv.k.shape, generator=g))
    kv.v.copy_(torch.randn(kv.v.shape, generator=g))
    return kv


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_deterministic_attention_matches_the_float64_reference(window, dtype):
    """Decode rows and chunks (from 0, on top of earlier positions, past the window),
    on shuffled pages: each query against the float64 definition."""
    ps, heads, kvh, dim = 4, 4, 2, 16
    kv = _pool(ps, 64, dtype, kvh, dim)
    table = np.full((4, 16), -1, np.int32)
    perm = np.random.default_rng(0).permutation(64)
    for r in range(4):
        table[r] = perm[r * 16:(r + 1) * 16]
    steps = [(0, 37, 1), (1, 5, 1), (2, 0, 19), (3, 22, 30)]  # decode rows first: internal == step order
    be = DeterministicBackend(kv, window, heads, tile_tokens=8)
    be.plan(steps, table)
    T = sum(s[2] for s in steps)
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(T, n, dim, generator=g).to(dtype) for n in (heads, kvh, kvh))
    out = be.forward(0, q, k, v)
    ref = reference_attention(q, kv.slots_view(0, "k"), kv.slots_view(0, "v"), steps, table, ps, window)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    err = (out.double() - ref).abs().max().item()
    assert err < tol, f"deterministic attention is off the reference by {err:g}"


# ---- the measurement: first op whose bits differ ---------------------------------------

OTHERS = {1: 5, 2: 33, 3: 17, 4: 3}
SCENARIOS = {  # name -> batches of (new rows, steps); row 0 is the traced prompt (40 tokens)
    "alone": [([0], [(0, 0, 40, True)])],
    "beside two others": [([0, 1, 2], [(1, 0, 5, True), (0, 0, 40, True), (2, 0, 33, True)])],
    "chunks of 13 and 27 beside a decode": [([0, 3], [(0, 0, 13, False), (3, 0, 17, True)]),
                                            ([], [(0, 13, 27, True), (3, 17, 1, True)])],
    "chunks of 16": [([0], [(0, 0, 16, False)]), ([], [(0, 16, 16, False)]), ([], [(0, 32, 8, True)])],
    "39 then one as a decode step": [([0, 4], [(0, 0, 39, False), (4, 0, 3, True)]),
                                     ([], [(0, 39, 1, True), (4, 3, 1, True)])],
}


def trace_ops(harness, batches, prompts) -> dict:
    """{(op index in the forward, op name, row, position): output bits} for every op of
    every forward (linear, rms norm, attention), through the model's own hooks."""
    model, attn = harness.runner.model, harness.runner.attn
    rec, count = {}, [0]

    def put(name, out):
        step = attn.step
        i, count[0] = count[0], count[0] + 1
        if out.shape[0] == step.num_tokens:
            rows = np.repeat(step.rows, step.lengths)
            flat = out.detach().reshape(out.shape[0], -1)
            for t, (r, p) in enumerate(zip(rows, step.positions)):
                rec[(i, name, int(r), int(p))] = flat[t].clone()
        return out

    lin, rms, fwd, plan = model.linear, model._rms, attn.forward, attn.plan
    model.linear = lambda x, w, b=None: put(f"linear {tuple(w.shape)}", lin(x, w, b))
    model._rms = lambda x, w: put("rms_norm", rms(x, w))
    attn.forward = lambda layer, q, k, v: put("attention", fwd(layer, q, k, v))

    def plan_and_reset(*a, **kw):
        count[0] = 0
        return plan(*a, **kw)
    attn.plan = plan_and_reset
    for new, steps in batches:
        res = harness.run([harness.new_row(r, prompts[r]) for r in new], [RowStep(*s) for s in steps])
        assert res.error is None, res.error
    return rec


def first_difference(base: dict, other: dict):
    for key in sorted(base, key=lambda k: (k[0], k[3])):
        if key in other and not torch.equal(base[key], other[key]):
            return key[1], key[3], (base[key].float() - other[key].float()).abs().max().item()
    return None


@pytest.mark.parametrize("tiny_model,dtype", [("llama", "float32"), ("llama", "bfloat16"), ("qwen2", "float32"),
                                              ("qwen3", "bfloat16")], indirect=["tiny_model"])
def test_the_first_op_that_varies_is_found_and_deterministic_mode_removes_it(tiny_model, make_harness,
                                                                             monkeypatch, dtype):
    """Default mode: some batch mix or chunk split changes some op's bits for the same
    row and position (the measurement, printed with -s); the first such op is a matmul
    or attention, never a norm. Deterministic mode: no op of any mix differs at all."""
    g = torch.Generator().manual_seed(1)
    prompts = {0: torch.randint(3, 900, (40,), generator=g).tolist()}
    prompts.update({r: torch.randint(3, 900, (n,), generator=g).tolist() for r, n in OTHERS.items()})
    found = {}
    for det in (False, True):
        monkeypatch.setattr(attn_det, "TILE_TOKENS", 8)  # chunks span several tiles
        monkeypatch.setattr(runner_mod, "ModelRunner",
                            functools.partial(runner_mod.ModelRunner, dtype=dtype, deterministic=det))
        base = None
        for name, batches in SCENARIOS.items():
            # fused_decode=False: a fused decode step (quant/fused_decode.c) runs every
            # layer in one native call, past the per-op hooks this measurement reads.
            rec = trace_ops(make_harness(tiny_model, page_size=4, max_rows=8, pages_per_row=16, fused_decode=False),
                            batches, prompts)
            base = base or rec
            found[(det, name)] = first_difference(base, rec)
        monkeypatch.undo()
    for (det, name), diff in found.items():
        print(f"{dtype} {'deterministic' if det else 'default'}: {name}: first differing op {diff}")
    default = [d for (det, _), d in found.items() if not det and d is not None]
    assert default, "no op varied in default mode: the measurement (or the premise) is broken"
    assert all(d[0].startswith(("linear", "attention")) for d in default), default
    assert [d for (det, _), d in found.items() if det and d is not None] == []


def test_deterministic_with_tensor_parallel_ranks_is_refused_by_name():
    """The follower ranks build the default kernels: accepting --deterministic with
    --tp > 1 would promise bits it does not keep."""
    from ferroxmp.config import ServerArgs
    with pytest.raises(ValueError, match="--deterministic"):
        ServerArgs(deterministic=True, tp=2).validate()
    ServerArgs(deterministic=True).validate()
