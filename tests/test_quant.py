"""Weights kept compressed (ferroxmp/gpu_worker/quant/): each GGUF type, loaded as fp16,
int8 or int4, against the dequantized float32 reference, layer by layer; the byte
accounting; tensor-parallel shards; the flags that refuse a compressed mode.

Oracles: `load_weights(..., quantization="none")` (the float32 path every other test
trusts) and F.linear over the very values the kernel holds. Tolerances come from the
arithmetic, not from what the code happened to print:
- fp16: the loader must hold exactly `reference.half()`; FBGEMM's fp16 GEMM then only
  reorders a float32 sum, so |y - F.linear(x, w16.float())| <= 8 * K * 2^-24 * (|x| @ |w|^T)
  (the standard gamma_K bound on a float32 dot product, with slack 8).
- int4/int8 (groups of 32): a GGUF tensor read as stored (Q4_0/Q4_1 -> int4, Q8_0 ->
  int8) dequantizes to exactly gguf's own dequantization; one requantized holds each value
  within half its group's step d / 2. groups.c (int8) then sums float32 products in
  another order than F.linear over the dequantized weight: the same gamma_K bound as fp16
  (slack 16). int4x16.c multiplies by the activations rounded to a 16-bit grid per group
  of 32: tests/int4_oracle.py computes that product in float64 from the canonical fields,
  and the kernel must be within float32 rounding of it.
A wrong scale, zero point, row order or group layout breaks these by orders of magnitude.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q

from ferroxmp.config import ServerArgs
from ferroxmp.gpu_worker.loader import load_config, load_weights, weight_bytes
from ferroxmp.gpu_worker.models import build_model
from ferroxmp.gpu_worker.quant import Groups, PackedF16, pack, resolve_mode, should_quantize, target_format
from ferroxmp.gpu_worker.quant.policy import AS_STORED, AS_STORED_VALUES, QuantizationRefused
from ferroxmp.gpu_worker.parallel.group import Shard
from gguf_writer import write_gguf
from int4_oracle import product_and_bound

pytestmark = pytest.mark.timeout(300)
CPU = torch.device("cpu")
K_QUANTS = (Q.Q4_K, Q.Q5_K, Q.Q6_K)  # rows of 256 values: the demo shape
TYPES = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K]


@pytest.fixture(scope="module")
def gguf_of(tiny_models, tmp_path_factory):
    """qtype -> a GGUF written from a tiny checkpoint (K-quants need rows of 256: demo)."""
    from ferroxmp.tiny_model import build_model as build_tiny
    root = tmp_path_factory.mktemp("quant")
    made: dict = {}

    def make(qtype: Q) -> str:
        if qtype not in made:
            shape = "demo" if qtype in K_QUANTS else "llama"
            folder = tiny_models.get(shape) or build_tiny(shape, str(root / shape))
            tiny_models.setdefault(shape, folder)
            made[qtype] = write_gguf(folder, str(root / f"{shape}-{qtype.name}.gguf"), qtype)
        return made[qtype]
    return make


def _x(k: int, rows: int = 5) -> torch.Tensor:
    g = torch.Generator().manual_seed(k)
    x = torch.randn(rows, k, generator=g)
    x[0, 0] = 8.0  # an outlier, as real activations have: the activation grid must cover it
    return x


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_each_gguf_type_kept_as_fp16_equals_its_dequantized_weights_layer_by_layer(gguf_of, qtype):
    """A loader that kept the wrong tensor, un-permuted Q/K differently from the float path
    or widened through another dtype would not hold exactly reference.half(); a packing
    that transposed or misaligned the weight fails the matmul bound."""
    path = gguf_of(qtype)
    ref = load_weights(path, CPU, torch.float32, quantization="none")
    got = load_weights(path, CPU, torch.float32, quantization="fp16")
    assert sorted(got) == sorted(ref)
    checked = 0
    for name, w in ref.items():
        if not should_quantize(name):
            assert torch.equal(got[name], w), name  # norms stay float32, untouched
            continue
        assert got[name].dtype == torch.float16 and torch.equal(got[name], w.half()), name
        x = _x(w.shape[1])
        want = F.linear(x, got[name].float())
        bound = 8 * w.shape[1] * 2.0 ** -24 * (x.abs() @ w.abs().T) + 1e-30
        assert ((PackedF16(got[name])(x) - want).abs() <= bound).all(), name
        checked += 1
    assert checked >= 7  # every projection of a layer and the embedding were compared


def _step_bound(g: Groups) -> torch.Tensor:
    """Half of each group's step, per element ([rows, cols]): the rounding bound."""
    return (g.d.float() / 2).repeat_interleave(32, dim=1) * (1 + 1e-5) + 1e-12


def _scale_rounding_bound(g: Groups) -> torch.Tensor:
    """A value q * d + m whose d and m were rounded once to float16 (relative error 2^-11,
    1% slack for the float32 products on both sides) from exact float32 products."""
    per = lambda t: t.float().abs().repeat_interleave(32, dim=1)  # noqa: E731
    return (g.values().float() * per(g.d) + per(g.m)) * 2.0 ** -11 * 1.01 + 1e-7


def _check_matmul(g: Groups, deq: torch.Tensor, name: str) -> None:
    """The kernel at 1-90 rows (int8: one row; blocks of 3, 5, 8 + 5 and 5 x 8 rows; the
    widened path at 90, above DEQUANT_ROWS; int4: passes of 16 rows and a rest) against
    F.linear over the dequantized weight (int4: over the activations rounded as the kernel
    specifies), within float32 rounding. The model's packed form multiplies the same."""
    packed = pack(g, torch.float32)
    for rows in (1, 3, 5, 13, 40, 90):
        x = _x(deq.shape[1], rows)
        want, bound = product_and_bound(g, x)
        for form in (g, packed):
            assert ((form(x).double() - want).abs() <= bound).all(), (name, rows)


@pytest.mark.parametrize("mode", ["int4", "int8"])
@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_each_gguf_type_kept_in_groups_equals_or_rounds_its_dequantized_weights(gguf_of, qtype, mode):
    """Q4_0/Q4_1 under int4 and Q8_0 under both modes are read as stored: the same values
    as gguf's dequantization, bit for bit (a wrong nibble order, scale/min swap or Q/K row
    permutation breaks it); every other type is requantized within half a group step. The
    kernel's product, the embedding lookup and the tied head are checked on top."""
    path = gguf_of(qtype)
    ref = load_weights(path, CPU, torch.float32, quantization="none")
    got = load_weights(path, CPU, torch.float32, quantization=mode)
    checked = 0
    for name, w in ref.items():
        if not should_quantize(name):
            assert torch.equal(got[name], w), name
            continue
        g = got[name]
        want = target_format(name, tuple(w.shape), mode, qtype.name)
        assert isinstance(g, Groups) and g.format == want, name
        deq = g.dequantize()
        if AS_STORED.get(qtype.name) == want:
            assert torch.equal(deq, w), name
        elif AS_STORED_VALUES.get(qtype.name) == want:  # Q4_K: its q as stored, scales in float16
            assert ((deq - w).abs() <= _scale_rounding_bound(g)).all(), name
        else:
            assert ((deq - w).abs() <= _step_bound(g)).all(), name
        _check_matmul(g, deq, name)
        ids = torch.tensor([0, 3, w.shape[0] - 1])
        assert torch.equal(g.lookup(ids, torch.float32), deq[ids]), name  # the embedding path
        checked += 1
    assert checked >= 7


@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_a_weight_whose_rows_no_block_divides_multiplies_within_the_bound(fmt):
    """99 output rows: groups.c's blocks take 4 (AVX-512) or 1 weight rows at a time, so
    the last 3 rows take the tail path; int4x16's last block is 3 rows and 13 of padding."""
    g = Groups.quantize(torch.randn(99, 320, generator=torch.Generator().manual_seed(1)), fmt)
    _check_matmul(g, g.dequantize(), fmt)


def _f32_bound(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """A float32 sum of K products in any order is within K * 2^-24 * sum|terms| of the
    exact sum (doubled for the bias and the final rounding)."""
    return 2 * (w.shape[1] + 1) * 2.0 ** -24 * (x.abs() @ w.abs().T + b.abs()).double()


def test_float32_panels_multiply_within_float_rounding_at_any_row_count():
    """PackedF32 (the runner's form of float32 weights on CPU): groups.c's panels at 1-300
    rows (one tile, several, a tile's tail; past 16 rows the work items of many rows; one
    and two rows over several panels at once, and the panels left over), against the
    float64 product; weights whose rows 32 does not divide (a zero-padded last panel, also
    inside a one-row item of three panels) and a K that no vector width divides. Its lookup and dequantize give the
    weight's own values, to the bit."""
    from ferroxmp.gpu_worker.quant.packed import PackedF32
    g = torch.Generator().manual_seed(3)
    for n, k in ((99, 320), (64, 96), (33, 100), (95, 72), (200, 64)):
        w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
        p = PackedF32(w)
        assert p.shape == w.shape and torch.equal(p.dequantize(), w)
        ids = torch.tensor([0, 31, 32, n - 1])
        assert torch.equal(p.lookup(ids, torch.float32), w[ids])
        for rows in (1, 2, 3, 5, 8, 11, 12, 13, 16, 17, 64, 300):
            x = torch.randn(rows, k, generator=g)
            exact = F.linear(x.double(), w.double(), b.double())
            for bias in (b, None):
                got = p(x, bias).double() + (b if bias is None else 0)
                assert ((got - exact).abs() <= _f32_bound(x, w, b)).all(), (n, k, rows)


def test_a_float32_row_rounds_alike_whatever_rows_share_its_call():
    """Each output of the panels' kernel is one chain of multiply-adds over k in every path
    (the tiles of 1-12 rows, the work items past 16 rows), so a row's result does not
    depend on the other rows or their number, to the bit: a speculative verify rounds as
    the one-token steps do, and a decode batch as each row alone."""
    from ferroxmp.gpu_worker.quant.packed import PackedF32
    g = torch.Generator().manual_seed(5)
    for n in (99, 95):  # one row's items of 3 panels: one left over; none, the last zero-padded
        p = PackedF32(torch.randn(n, 320, generator=g))
        x = torch.randn(200, 320, generator=g) * torch.logspace(-3, 3, 200)[:, None]
        alone = torch.cat([p(x[i:i + 1].contiguous()) for i in range(200)])
        for rows in (2, 3, 5, 6, 7, 12, 13, 16, 17, 48, 49, 193, 200):
            for start in (0, 200 - rows):
                assert torch.equal(p(x[start:start + rows].contiguous()), alone[start:start + rows]), (rows, start)


@pytest.mark.parametrize("march", ["haswell", "skylake-avx512"])
def test_the_avx2_build_of_the_kernels_computes_what_the_native_one_does(tmp_path, march):
    """On an AVX-512 VNNI machine the native build runs neither the AVX2 code (haswell)
    nor int4x16's AVX-512 path without VNNI (skylake-avx512); such a build in a subprocess
    (its own cache) must meet the same bounds at 1, 3, 13, 17 and 40 rows, on a weight of
    99 rows (not a multiple of the rows a block takes); float32 panels too, to the bit."""
    from avx2_build import run_avx2
    code = ("import torch, torch.nn.functional as F\n"
            "from ferroxmp.gpu_worker.quant import Groups\n"
            "from ferroxmp.gpu_worker.quant.packed import PackedF32\n"
            "from int4_oracle import product_and_bound\n"
            "torch.manual_seed(0)\n"
            "for fmt in ('int4', 'int8'):\n"
            "    g = Groups.quantize(torch.randn(99, 320), fmt)\n"
            "    for rows in (1, 3, 13, 17, 40):\n"
            "        x = torch.randn(rows, 320)\n"
            "        want, bound = product_and_bound(g, x)\n"
            "        assert ((g(x).double() - want).abs() <= bound).all(), (fmt, rows)\n"
            "w, b = torch.randn(99, 320), torch.randn(99)\n"
            "xs, ys = [torch.randn(rows, 320) for rows in (1, 3, 13, 17, 40)], []\n"
            "for x in xs:\n"
            "    ys.append(PackedF32(w)(x, b))\n"
            "    err = (ys[-1].double() - F.linear(x.double(), w.double(), b.double())).abs()\n"
            "    bound = 2 * 321 * 2.0 ** -24 * (x.abs() @ w.abs().T + b.abs()).double()\n"
            "    assert (err <= bound).all(), ('float32', x.shape[0])\n"
            f"torch.save((w, b, xs, ys), {str(tmp_path / 'f32.pt')!r})\n"
            "print('ok')\n")
    out = run_avx2(code, tmp_path, march)
    assert out == "ok", out
    # float32 panels: one FMA chain per output in either build, so the same bits as this one
    from ferroxmp.gpu_worker.quant.packed import PackedF32
    w, b, xs, ys = torch.load(tmp_path / "f32.pt")
    for x, y in zip(xs, ys):
        assert torch.equal(PackedF32(w)(x, b), y), x.shape[0]


def test_groups_cut_and_fused_hold_the_same_values_and_a_cut_inside_a_group_is_refused():
    g = Groups.quantize(torch.randn(96, 128), "int4")
    deq = g.dequantize()
    assert torch.equal(g[10:50, 32:96].dequantize(), deq[10:50, 32:96])
    order = torch.randperm(96)
    assert torch.equal(g[order].dequantize(), deq[order])
    from ferroxmp.gpu_worker.quant import cat_rows
    assert torch.equal(cat_rows([g[:40], g[40:]]).dequantize(), deq)
    assert torch.equal(g.pad_rows(3).dequantize()[96:], torch.zeros(3, 128))
    with pytest.raises(ValueError, match="cut a group"):
        g[:, 16:48]
    with pytest.raises(TypeError):
        cat_rows([g, Groups.quantize(torch.randn(4, 128), "int8")])


@pytest.mark.parametrize("mode", ["none", "fp16", "int8", "int4"])
def test_the_reported_weight_bytes_equal_the_bytes_of_the_tensors_the_model_holds(gguf_of, mode):
    """Three counts must agree: the header-only estimate that sizes memory before loading
    (weight_bytes), the model's own report (/server_info), and the bytes of the loaded
    tensors themselves plus the tied head's packed copy. A head packed twice, an embedding
    counted in float32 or scales left out all show up as a difference."""
    path = gguf_of(Q.Q8_0)
    cfg = load_config(path)
    loaded = load_weights(path, CPU, cfg.dtype, quantization=mode)

    def nbytes(t) -> int:
        if isinstance(t, Groups):  # int4: two values a byte; float16 d (and m) per group of 32;
            rows = -(-t.shape[0] // 16) * 16  # held in blocks of 16 rows, the last padded
            return rows * t.shape[1] // (2 if t.format == "int4" else 1) + \
                rows * t.shape[1] // 32 * (4 if t.format == "int4" else 2)
        return t.numel() * t.element_size()
    direct = sum(nbytes(t) for t in loaded.values())
    tied = "lm_head.weight" not in loaded
    if tied and mode == "fp16":  # FBGEMM holds its own copy of a tied head; Groups are shared
        direct += nbytes(loaded["model.embed_tokens.weight"])
    model = build_model(cfg, loaded, CPU)
    assert sum(model.weight_bytes().values()) == direct == weight_bytes(path, cfg.dtype, mode)
    if mode in ("int8", "int4"):
        assert weight_bytes(path, cfg.dtype, mode) < weight_bytes(path, cfg.dtype, "none") / 3  # Q8_0 stays int8


def test_a_compressed_tensor_parallel_shard_holds_exactly_tp1s_values(gguf_of):
    """Each weight is quantized whole (or read as stored) and then cut, so rank r's values
    AND group scales are tp=1's, sliced (quantizing a slice alone would give other
    scales, and tp=2 other answers than tp=1)."""
    path = gguf_of(Q.Q4_1)
    cfg = load_config(path)
    for mode in ("int8", "int4"):
        _same_shards(path, cfg, mode)


def _same_shards(path, cfg, mode):
    full = load_weights(path, CPU, cfg.dtype, quantization=mode)
    for rank in range(2):
        shard = Shard(cfg, rank, 2)
        part = load_weights(path, CPU, cfg.dtype, select=shard.index, quantization=mode)
        assert part.keys() <= full.keys()
        for name, t in part.items():
            index = shard.index(name, tuple(full[name].shape))
            want = full[name][index] if index else full[name]
            _assert_same(t, want, (mode, rank, name))


def _assert_same(t, want, what) -> None:
    if isinstance(want, Groups):
        assert isinstance(t, Groups) and torch.equal(t.q, want.q) and torch.equal(t.d, want.d), what
        assert (t.m is None and want.m is None) or torch.equal(t.m, want.m), what
    else:
        assert torch.equal(t, want), what


def test_compressed_modes_are_refused_by_name_where_they_cannot_run(tiny_models, gguf_of):
    """--deterministic promises batch-invariant bits and CUDA has no FBGEMM: an explicit
    fp16/int8/int4 there is refused naming the flag (on CUDA only fp16, and int4/int8 only
    without Triton, and any of them on another GPU type); auto quietly stays float; a
    Hugging Face folder and a float GGUF stay float under auto."""
    for mode in ("fp16", "int8", "int4"):
        with pytest.raises(ValueError, match="--quantization"):
            ServerArgs(quantization=mode, deterministic=True).validate()
        with pytest.raises(QuantizationRefused, match="no kernel on mps"):
            resolve_mode(mode, gguf_of(Q.Q8_0), torch.device("mps"))
    with pytest.raises(QuantizationRefused, match="no kernel on cuda"):
        resolve_mode("fp16", gguf_of(Q.Q8_0), torch.device("cuda"))
    with pytest.raises(ValueError, match="--quantization"):
        ServerArgs(quantization="fp16", device="cuda").validate()
    for mode in ("int8", "int4"):  # the Triton kernels (tests/test_triton_groups.py)
        ServerArgs(quantization=mode, device="cuda").validate()
        assert resolve_mode(mode, gguf_of(Q.Q8_0), torch.device("cuda")) == mode
    from ferroxmp.gpu_worker.quant.native import available
    assert resolve_mode("auto", gguf_of(Q.Q8_0), CPU) == ("int4" if available() is None else "fp16")
    assert resolve_mode("auto", gguf_of(Q.Q8_0), CPU, deterministic=True) == "none"
    assert resolve_mode("auto", gguf_of(Q.Q8_0), torch.device("cuda")) == "none"
    assert resolve_mode("auto", tiny_models["llama"], CPU) == "none"
    assert resolve_mode("int8", tiny_models["llama"], CPU) == "int8"
    assert resolve_mode("int4", tiny_models["llama"], CPU) == "int4"
    assert resolve_mode("auto", write_gguf(tiny_models["llama"], str(gguf_of(Q.Q8_0)) + ".f32.gguf", Q.F32),
                        CPU) == "none"


@pytest.mark.parametrize("mode", ["fp16", "int8", "int4"])
def test_a_hugging_face_folder_is_compressed_on_request_whole_and_by_shard(tiny_models, mode):
    """--quantization on a safetensors folder: the same values as the float load narrowed
    (fp16: exactly .half(); int8/int4: within half a group step per element; int4 keeps
    the embedding and head int8), a --tp shard equal to the
    whole tensor's slice, and the header estimate equal to the loaded bytes (untied head)."""
    folder = tiny_models["qwen2"]
    cfg = load_config(folder)
    ref = load_weights(folder, CPU, torch.float32, quantization="none")
    got = load_weights(folder, CPU, torch.float32, quantization=mode)
    shard = Shard(cfg, 1, 2)
    part = load_weights(folder, CPU, torch.float32, select=shard.index, quantization=mode)
    for name, w in ref.items():
        t = got[name]
        if not should_quantize(name):
            assert torch.equal(t, w), name
        elif mode == "fp16":
            assert t.dtype == torch.float16 and torch.equal(t, w.half()), name
        else:
            assert t.format == ("int8" if mode == "int8" or name.endswith(("embed_tokens.weight", "lm_head.weight"))
                                else "int4"), name
            assert ((t.dequantize() - w).abs() <= _step_bound(t)).all(), name
        index = shard.index(name, tuple(w.shape))
        if index is None:
            assert name not in part
            continue
        _assert_same(part[name], t[index] if index else t, name)
    model = build_model(cfg, got, CPU)
    assert sum(model.weight_bytes().values()) == weight_bytes(folder, cfg.dtype, mode)
