"""Write a Hugging Face checkpoint folder as a GGUF file, the way llama.cpp's
convert_hf_to_gguf.py does, for the GGUF tests.

What it does like the converter: `general.architecture` 'llama' for Llama and
Mistral (Mistral adds `attention.sliding_window`), Q/K rows permuted for those two,
Llama 3 rope scaling as a `rope_freqs.weight` tensor of divisors, 1-D tensors kept
F32, tokenizer metadata from tokenizer.json (tokens, token types, merges via
gguf.SpecialVocab, which also writes the special ids, add_bos flag and chat template).

`quantize_q4_k` / `quantize_q5_k` / `quantize_q6_k` are plain (not llama.cpp's optimised) quantizers:
the gguf package can only dequantize K-quants. Their blocks are laid out as
`gguf.quants` reads them; tests check the round trip before trusting them.
"""
from __future__ import annotations

import json
import math
import os

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file

from ferroxmp.checkpoint.gguf_weights import gguf_name, permute_qk

QK_K = 256
ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}


def _fp16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def _k_scales_and_values(w: np.ndarray, levels: int) -> tuple:
    """Q4_K / Q5_K's shared part: x ~ d*sc_j*q - dmin*m_j per 32-value sub-block j, q in
    0..levels, sc/m 6-bit packed in 12 bytes. Returns (d, dmin, scales, q [blocks, 8, 32])."""
    x = w.astype(np.float32).reshape(-1, 8, 32)
    lo = np.minimum(x.min(axis=2), 0.0)
    scale, mins = (x.max(axis=2) - lo) / levels, -lo
    d = _fp16(scale.max(axis=1) / 63.0)
    dmin = _fp16(mins.max(axis=1) / 63.0)
    df, dminf = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    sc = np.clip(np.round(np.divide(scale, df, out=np.zeros_like(scale), where=df > 0)), 0, 63).astype(np.uint8)
    m = np.clip(np.round(np.divide(mins, dminf, out=np.zeros_like(mins), where=dminf > 0)), 0, 63).astype(np.uint8)
    step = (df * sc)[:, :, None]
    q = np.divide(x + (dminf * m)[:, :, None], step, out=np.zeros_like(x), where=step > 0)
    q = np.clip(np.round(q), 0, levels).astype(np.uint8)
    scales = np.zeros((x.shape[0], 12), dtype=np.uint8)
    scales[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    scales[:, 4:8] = (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)
    return d, dmin, scales, q


def _nibbles(q: np.ndarray) -> np.ndarray:
    """Sub-blocks 2i and 2i+1 as the low and high nibbles of 32 bytes each (128 bytes)."""
    q = (q & 15).reshape(-1, 4, 2, 32)
    return (q[:, :, 0, :] | (q[:, :, 1, :] << 4)).reshape(-1, 128)


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """x ~ d*sc_j*q - dmin*m_j per 32-value sub-block j, q in 0..15, sc/m 6-bit."""
    d, dmin, scales, q = _k_scales_and_values(w, 15)
    blocks = np.concatenate([d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), scales,
                             _nibbles(q)], axis=1)
    return blocks.reshape(w.shape[0], -1)


def quantize_q5_k(w: np.ndarray) -> np.ndarray:
    """Q4_K with q in 0..31: the fifth bit of sub-block j's value l is bit j of qh[l]."""
    d, dmin, scales, q = _k_scales_and_values(w, 31)
    qh = np.zeros((q.shape[0], 32), dtype=np.uint8)
    for j in range(8):
        qh |= (q[:, j, :] >> 4) << j
    blocks = np.concatenate([d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), scales,
                             qh, _nibbles(q)], axis=1)
    return blocks.reshape(w.shape[0], -1)


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    """x ~ d*sc_j*(q - 32) per 16-value sub-block j, q in 0..63, sc int8."""
    x = w.astype(np.float32).reshape(-1, 16, 16)
    scale = np.abs(x).max(axis=2) / 31.0
    d = _fp16(scale.max(axis=1) / 127.0)
    df = d.astype(np.float32)[:, None]
    sc = np.clip(np.round(np.divide(scale, df, out=np.zeros_like(scale), where=df > 0)), -128, 127).astype(np.int8)
    step = (df * sc)[:, :, None]
    q = np.clip(np.round(np.divide(x, step, out=np.zeros_like(x), where=step > 0)) + 32, 0, 63).astype(np.uint8)
    q = q.reshape(-1, 8, 32)
    low, high = q & 15, q >> 4
    low = low.reshape(-1, 2, 2, 64)
    ql = (low[:, :, 0, :] | (low[:, :, 1, :] << 4)).reshape(-1, 128)
    high = high.reshape(-1, 2, 4, 32)
    qh = (high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)).reshape(-1, 64)
    blocks = np.concatenate([ql, qh, sc.view(np.uint8), d.view(np.uint8).reshape(-1, 2)], axis=1)
    return blocks.reshape(w.shape[0], -1)


def encode_tensor(w: np.ndarray, qtype: Q) -> tuple[np.ndarray, Q]:
    if w.ndim == 1 or qtype == Q.F32:
        return w.astype(np.float32), Q.F32
    if qtype == Q.F16:
        return w.astype(np.float16), Q.F16
    if qtype == Q.Q4_K:
        return quantize_q4_k(w), qtype
    if qtype == Q.Q5_K:
        return quantize_q5_k(w), qtype
    if qtype == Q.Q6_K:
        return quantize_q6_k(w), qtype
    return gguf.quants.quantize(w.astype(np.float32), qtype), qtype


def llama3_rope_freqs(cfg: dict) -> np.ndarray:
    """The converter's divisors for Llama 3 rope scaling (one per rotary frequency)."""
    sc, dim = cfg["rope_scaling"], cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    freqs = 1.0 / (cfg["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, lo, hi = sc["factor"], sc["low_freq_factor"], sc["high_freq_factor"]
    old = sc["original_max_position_embeddings"]
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < old / hi:
            out.append(1.0)
        elif wavelen > old / lo:
            out.append(factor)
        else:
            smooth = (old / wavelen - lo) / (hi - lo)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _tokens(folder: str, vocab_size: int) -> tuple[list[str], list[int]]:
    with open(os.path.join(folder, "tokenizer.json"), encoding="utf-8") as f:
        tj = json.load(f)
    by_id = {i: (t, gguf.TokenType.NORMAL) for t, i in tj["model"]["vocab"].items()}
    for a in tj.get("added_tokens", []):
        by_id[a["id"]] = (a["content"], gguf.TokenType.CONTROL if a["special"] else gguf.TokenType.USER_DEFINED)
    tokens, types = [], []
    for i in range(vocab_size):
        t, ty = by_id.get(i, (f"[PAD{i}]", gguf.TokenType.UNUSED))
        tokens.append(t)
        types.append(int(ty))
    return tokens, types


def write_gguf(folder: str, out_path: str, qtype: Q = Q.F32, pre: str = "qwen2", arch: str = "",
               permute: bool = True, replace: dict | None = None) -> str:
    """`folder` (a tiny checkpoint) as a GGUF file whose matrices are `qtype`.
    Test knobs: `arch` overrides general.architecture, `permute=False` skips the Q/K
    permutation, `replace` = {gguf name: (raw array, type)} swaps in a tensor as is."""
    with open(os.path.join(folder, "config.json")) as f:
        cfg = json.load(f)
    arch = arch or ARCH[cfg["model_type"]]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    w = gguf.GGUFWriter(out_path, arch)
    w.add_name(os.path.basename(folder))
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    if cfg["model_type"] == "mistral" and cfg.get("sliding_window"):
        w.add_sliding_window(cfg["sliding_window"])
    tokens, types = _tokens(folder, cfg["vocab_size"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    gguf.SpecialVocab(folder, load_merges=True, n_vocab=len(tokens)).add_to_gguf(w)
    if (cfg.get("rope_scaling") or {}).get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_rope_freqs(cfg))
    permute = permute and arch == "llama"
    for name, t in load_file(os.path.join(folder, "model.safetensors")).items():
        t = t.float().numpy()
        if permute and name.endswith(("q_proj.weight", "q_proj.bias")):
            t = permute_qk(t, heads)
        elif permute and name.endswith(("k_proj.weight", "k_proj.bias")):
            t = permute_qk(t, kv)
        data, kind = (replace or {}).get(gguf_name(name)) or encode_tensor(t, qtype)
        w.add_tensor(gguf_name(name), data, raw_dtype=None if kind in (Q.F32, Q.F16) else kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out_path


# ---- header layout, for the checkpoint fuzzer -------------------------------------

_FMT = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def header_fields(path: str, max_items: int = 3) -> list[tuple[str, int, str]]:
    """(label, byte offset, struct format) of every structural field of a GGUF header:
    counts, string lengths, value types, array item types and lengths, scalar values,
    tensor n_dims / dims / type / offset. Walked independently of ferroxmp's reader (a
    second reading of the format, so the fuzzer does not inherit the reader's mistakes);
    of each array only the first `max_items` string lengths are listed."""
    import struct
    with open(path, "rb") as f:
        buf = f.read()
    out: list[tuple[str, int, str]] = []
    pos = 4

    def take(label: str, fmt: str, record: bool = True) -> int:
        nonlocal pos
        (v,) = struct.unpack_from(fmt, buf, pos)
        if record:
            out.append((label, pos, fmt))
        pos += struct.calcsize(fmt)
        return v

    def string(label: str, record: bool = True) -> str:
        nonlocal pos
        n = take(label + " length", "<Q", record)
        s = buf[pos:pos + n].decode("utf-8", "replace")
        pos += n
        return s

    take("version", "<I")
    n_tensors, n_kv = take("tensor_count", "<Q"), take("metadata_kv_count", "<Q")
    for _ in range(n_kv):
        key = string("key")
        vtype = take(f"{key} value type", "<I")
        if vtype == 8:
            string(key)
        elif vtype == 9:
            itype, count = take(f"{key} item type", "<I"), take(f"{key} count", "<Q")
            for i in range(count):
                if itype == 8:
                    string(f"{key}[{i}]", record=i < max_items)
                else:
                    take(f"{key}[{i}]", _FMT[itype], record=i < max_items)
        else:
            take(key, _FMT[vtype])
    for _ in range(n_tensors):
        name = string("tensor name")
        n_dims = take(f"{name} n_dims", "<I")
        for d in range(n_dims):
            take(f"{name} dim {d}", "<Q")
        take(f"{name} type", "<I")
        take(f"{name} offset", "<Q")
    return out
