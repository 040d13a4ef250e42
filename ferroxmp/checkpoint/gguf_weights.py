"""A GGUF file's tensors as Hugging Face-named float32 arrays.

Job: name mapping (blk.N.attn_q.weight -> model.layers.N.self_attn.q_proj.weight),
dequantization through `gguf.quants.dequantize`, and undoing the Q/K row permutation
llama.cpp's converter applies to Llama-family attention, so the worker's model sees
exactly what the Hugging Face folder would hold.

Invariants: `permute_qk` and `unpermute_qk` are inverses (the tests write GGUF files
with the first and read them with the second); a tensor name ferroxmp does not know
is refused by name rather than dropped; `rope_freqs.weight` is config, not a weight.
"""
from __future__ import annotations

import re
from typing import Optional

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as _dequantize

from .gguf_file import GGUFFile
from .limits import GGUFUnsupported

_TOP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}
_BLOCK = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
          "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
          "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
          "ffn_down": "mlp.down_proj"}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
CONFIG_TENSORS = ("rope_freqs.weight",)


def hf_name(gguf_name: str) -> str:
    if gguf_name in _TOP:
        return _TOP[gguf_name]
    m = _BLOCK_RE.match(gguf_name)
    if m and m.group(2) in _BLOCK:
        return f"model.layers.{m.group(1)}.{_BLOCK[m.group(2)]}.{m.group(3)}"
    raise GGUFUnsupported(f"tensor {gguf_name!r} is not one ferroxmp's models use")


def gguf_name(hf: str) -> str:
    """The inverse of hf_name (for writing GGUF files)."""
    for g, h in _TOP.items():
        if h == hf:
            return g
    m = re.match(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$", hf)
    inverse = {v: k for k, v in _BLOCK.items()}
    if not m or m.group(2) not in inverse:
        raise KeyError(f"no GGUF name for {hf!r}")
    return f"blk.{m.group(1)}.{inverse[m.group(2)]}.{m.group(3)}"


def permutes_qk(g: GGUFFile) -> bool:
    """llama.cpp's converter reorders Llama-family q/k rows for its interleaved rope;
    Qwen models keep the Hugging Face (half-split) order."""
    return g.architecture in ("llama", "mistral")


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's converter does to q/k rows: within each head, the half-split
    rotary pairs (i, i + d/2) become adjacent rows (2i, 2i + 1)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def dequantize(g: GGUFFile, name: str) -> np.ndarray:
    """Tensor `name` as float32, numpy order ([out, in] for a matrix)."""
    info = g.tensors[name]
    out = _dequantize(g.raw(name), GGMLQuantizationType(info.type_id))
    return np.asarray(out, dtype=np.float32).reshape(info.shape)


def weight_names(g: GGUFFile) -> list[str]:
    return [n for n in g.tensors if n not in CONFIG_TENSORS]


def row_order(g: GGUFFile, name: str, n_head: int, n_kv_head: int) -> Optional[np.ndarray]:
    """The order of tensor `name`'s rows in Hugging Face's layout (q/k rows of a file that
    permutes them), or None when the file's order is already it. A block-quantized
    tensor keeps its blocks (they lie within a row) and only its rows move."""
    if not permutes_qk(g):
        return None
    heads = n_head if name.endswith(("attn_q.weight", "attn_q.bias")) else \
        n_kv_head if name.endswith(("attn_k.weight", "attn_k.bias")) else None
    if heads is None:
        return None
    return unpermute_qk(np.arange(g.tensors[name].shape[0]), heads)


def weight(g: GGUFFile, name: str, n_head: int, n_kv_head: int) -> np.ndarray:
    """Tensor `name` as float32 in Hugging Face's row order."""
    w = dequantize(g, name)
    order = row_order(g, name, n_head, n_kv_head)
    return w if order is None else w[order]
