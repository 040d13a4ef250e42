"""Weights kept compressed (ferroxmp/gpu_worker/quant/): each GGUF type, loaded as fp16
or int8, against the dequantized float32 reference, layer by layer; the byte accounting;
tensor-parallel shards; the flags that refuse a compressed mode.

Oracles: `load_weights(..., quantization="none")` (the float32 path every other test
trusts) and F.linear over the very values the kernel holds. Tolerances come from the
arithmetic, not from what the code happened to print:
- fp16: the loader must hold exactly `reference.half()`; FBGEMM's fp16 GEMM then only
  reorders a float32 sum, so |y - F.linear(x, w16.float())| <= 8 * K * 2^-24 * (|x| @ |w|^T)
  (the standard gamma_K bound on a float32 dot product, with slack 8).
- int8: round-to-nearest per row, so |w_int8 - w| <= scale / 2 element-wise; FBGEMM also
  rounds the activations to a 7-bit grid over [min(x, 0), max(x, 0)] (reduce_range), so
  |y - F.linear(x, w_int8)| <= (step / 2) * sum_k |w_int8| per output, step = range / 127.
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
from ferroxmp.gpu_worker.quant import Int8Rows, PackedF16, PackedInt8, resolve_mode, should_quantize
from ferroxmp.gpu_worker.quant.policy import QuantizationRefused
from ferroxmp.gpu_worker.tp import Shard
from gguf_writer import write_gguf

pytestmark = pytest.mark.timeout(300)
CPU = torch.device("cpu")
TYPES = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q6_K]  # Q5_K: the test writer has no packer


@pytest.fixture(scope="module")
def gguf_of(tiny_models, tmp_path_factory):
    """qtype -> a GGUF written from a tiny checkpoint (K-quants need rows of 256: demo)."""
    from ferroxmp.tiny_model import build_model as build_tiny
    root = tmp_path_factory.mktemp("quant")
    made: dict = {}

    def make(qtype: Q) -> str:
        if qtype not in made:
            shape = "demo" if qtype in (Q.Q4_K, Q.Q6_K) else "llama"
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


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_each_gguf_type_kept_as_int8_stays_within_half_a_step_of_its_dequantized_weights(gguf_of, qtype):
    """Per row, |int8 * scale - w| <= scale / 2 (a scale from the wrong row, or one
    computed after slicing, breaks it), and FBGEMM's product stays inside the activation
    rounding bound of F.linear over the same int8 weights."""
    path = gguf_of(qtype)
    ref = load_weights(path, CPU, torch.float32, quantization="none")
    got = load_weights(path, CPU, torch.float32, quantization="int8")
    for name, w in ref.items():
        if not should_quantize(name):
            continue
        rows = got[name]
        assert isinstance(rows, Int8Rows) and rows.q.dtype == torch.int8, name
        deq = rows.dequantize()
        # 1e-5: float32 rounding of w / scale and of q * scale at an exact half-step tie
        assert ((deq - w).abs() <= rows.scale[:, None] / 2 * (1 + 1e-5) + 1e-12).all(), name
        x = _x(w.shape[1])
        step = (x.max().clamp(min=0) - x.min().clamp(max=0)) / 127
        bound = step / 2 * deq.abs().sum(1)[None, :] * 1.01 + 1e-5
        assert ((PackedInt8(rows)(x) - F.linear(x, deq)).abs() <= bound).all(), name
        ids = torch.tensor([0, 3, w.shape[0] - 1])
        assert torch.equal(rows.lookup(ids, torch.float32), deq[ids]), name  # the embedding path


@pytest.mark.parametrize("mode", ["none", "fp16", "int8"])
def test_the_reported_weight_bytes_equal_the_bytes_of_the_tensors_the_model_holds(gguf_of, mode):
    """Three counts must agree: the header-only estimate that sizes memory before loading
    (weight_bytes), the model's own report (/server_info), and the bytes of the loaded
    tensors themselves plus the tied head's packed copy. A head packed twice, an embedding
    counted in float32 or scales left out all show up as a difference."""
    path = gguf_of(Q.Q8_0)
    cfg = load_config(path)
    loaded = load_weights(path, CPU, cfg.dtype, quantization=mode)

    def nbytes(t) -> int:
        if isinstance(t, Int8Rows):
            return t.q.numel() + 4 * t.scale.numel()
        return t.numel() * t.element_size()
    direct = sum(nbytes(t) for t in loaded.values())
    tied = "lm_head.weight" not in loaded
    if tied and mode != "none":  # FBGEMM holds its own copy of a tied head
        direct += nbytes(loaded["model.embed_tokens.weight"])
    model = build_model(cfg, loaded, CPU)
    assert sum(model.weight_bytes().values()) == direct == weight_bytes(path, cfg.dtype, mode)
    if mode == "int8":
        assert weight_bytes(path, cfg.dtype, "int8") < weight_bytes(path, cfg.dtype, "none") / 2


def test_a_compressed_tensor_parallel_shard_holds_exactly_tp1s_values(gguf_of):
    """Each weight is quantized whole and then cut, so rank r's int8 values AND row
    scales are tp=1's, sliced (quantizing a column slice would give o_proj/down_proj
    other scales, and tp=2 other answers than tp=1)."""
    path = gguf_of(Q.Q4_1)
    cfg = load_config(path)
    full = load_weights(path, CPU, cfg.dtype, quantization="int8")
    for rank in range(2):
        shard = Shard(cfg, rank, 2)
        part = load_weights(path, CPU, cfg.dtype, select=shard.index, quantization="int8")
        assert part.keys() <= full.keys()
        for name, t in part.items():
            index = shard.index(name, tuple(full[name].shape))
            want = full[name][index] if index else full[name]
            if isinstance(t, Int8Rows):
                assert torch.equal(t.q, want.q) and torch.equal(t.scale, want.scale), (rank, name)
            else:
                assert torch.equal(t, want), (rank, name)


def test_compressed_modes_are_refused_by_name_where_they_cannot_run(tiny_models, gguf_of):
    """--deterministic promises batch-invariant bits and CUDA has no FBGEMM: an explicit
    fp16/int8 there is refused naming the flag; auto quietly stays float; a Hugging Face
    folder and a float GGUF stay float under auto."""
    for mode in ("fp16", "int8"):
        with pytest.raises(ValueError, match="--quantization"):
            ServerArgs(quantization=mode, deterministic=True).validate()
        with pytest.raises(QuantizationRefused, match="CPU only"):
            resolve_mode(mode, gguf_of(Q.Q8_0), torch.device("cuda"))
    assert resolve_mode("auto", gguf_of(Q.Q8_0), CPU) == "fp16"
    assert resolve_mode("auto", gguf_of(Q.Q8_0), CPU, deterministic=True) == "none"
    assert resolve_mode("auto", gguf_of(Q.Q8_0), torch.device("cuda")) == "none"
    assert resolve_mode("auto", tiny_models["llama"], CPU) == "none"
    assert resolve_mode("int8", tiny_models["llama"], CPU) == "int8"
    assert resolve_mode("auto", write_gguf(tiny_models["llama"], str(gguf_of(Q.Q8_0)) + ".f32.gguf", Q.F32),
                        CPU) == "none"


@pytest.mark.parametrize("mode", ["fp16", "int8"])
def test_a_hugging_face_folder_is_compressed_on_request_whole_and_by_shard(tiny_models, mode):
    """--quantization on a safetensors folder: the same values as the float load narrowed
    (fp16: exactly .half(); int8: within scale/2 per element), a --tp shard equal to the
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
            assert ((t.dequantize() - w).abs() <= t.scale[:, None] / 2 * (1 + 1e-5) + 1e-12).all(), name
        index = shard.index(name, tuple(w.shape))
        if index is None:
            assert name not in part
            continue
        want = t[index] if index else t
        if isinstance(want, Int8Rows):
            assert torch.equal(part[name].q, want.q) and torch.equal(part[name].scale, want.scale), name
        else:
            assert torch.equal(part[name], want), name
    model = build_model(cfg, got, CPU)
    assert sum(model.weight_bytes().values()) == weight_bytes(folder, cfg.dtype, mode)
