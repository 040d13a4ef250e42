"""A GGUF file's metadata as the config.json dict a Hugging Face folder would carry.

Job: map `general.architecture` and the `{arch}.*` keys onto the Hugging Face names
the worker's loader reads, so both checkpoint kinds go through one ModelConfig path;
refuse, by name, an architecture, tensor type or rope variant ferroxmp cannot run.

Invariants:
- An unsupported architecture or tensor type raises GGUFUnsupported naming it, before
  any tensor is read.
- Llama 3 rope scaling travels in GGUF as `rope_freqs.weight` (one divisor per
  frequency, llama.cpp's converter writes no parameters); it is turned back into
  llama3 parameters only if those parameters reproduce every divisor.
- Floats stored as float32 come back as the shortest decimal that rounds to the same
  float32 (1e-06, not 9.99999997e-07), as in the config.json they came from.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np
from gguf import GGMLQuantizationType as Q

from .gguf_file import GGUFError, GGUFFile
# GGUFUnsupported lives in limits.py so gguf_weights can raise it without importing
# this module (which imports gguf_weights): no import cycle. Re-exported here.
from .gguf_weights import CONFIG_TENSORS, dequantize, hf_name
from .limits import INT_LIMITS, CheckpointError, GGUFUnsupported, bad, float_field, int_field, is_int  # noqa: F401

# general.architecture -> (HF architecture, model_type); 'llama' with a sliding window is Mistral
ARCHITECTURES = {"llama": ("LlamaForCausalLM", "llama"), "mistral": ("MistralForCausalLM", "mistral"),
                 "qwen2": ("Qwen2ForCausalLM", "qwen2"), "qwen3": ("Qwen3ForCausalLM", "qwen3")}
# Tensor types whose dequantization the tests check against the source weights.
TENSOR_TYPES = (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K)
_TORCH_DTYPE = {Q.F32: "float32", Q.F16: "float16", Q.BF16: "bfloat16"}


def _f32(x: Any) -> float:
    return float(str(np.float32(x)))


def check_supported(g: GGUFFile) -> None:
    arch = g.architecture
    if arch not in ARCHITECTURES:
        raise GGUFUnsupported(f"{g.path}: general.architecture {arch!r} is not supported; ferroxmp runs "
                              f"{', '.join(ARCHITECTURES)}", "general.architecture")
    allowed = {int(t) for t in TENSOR_TYPES}
    for info in g.tensors.values():
        if info.name not in CONFIG_TENSORS:
            try:
                hf_name(info.name)  # refuses a tensor ferroxmp's models have no place for
            except GGUFUnsupported as e:
                raise GGUFUnsupported(f"{g.path}: {e}", f"tensor {info.name!r}") from None
        if info.type_id not in allowed:
            raise GGUFUnsupported(f"{g.path}: tensor {info.name!r} has type {info.type_name}, which ferroxmp "
                                  f"does not dequantize; supported: {', '.join(t.name for t in TENSOR_TYPES)}",
                                  f"tensor {info.name!r}")


def weights_dtype(g: GGUFFile) -> str:
    """The serving dtype `--dtype auto` picks: the matrices' own float type, or float32
    for quantized files (their dequantized values are exact in float32)."""
    kinds = {Q(i.type_id) for i in g.tensors.values() if len(i.dims) >= 2}
    if len(kinds) == 1 and next(iter(kinds)) in _TORCH_DTYPE:
        return _TORCH_DTYPE[next(iter(kinds))]
    return "float32"


def _llama3_factors(inv: np.ndarray, factor: float, lo: float, hi: float, old_ctx: float) -> np.ndarray:
    """The divisors llama.cpp's converter writes for Llama 3 rope scaling."""
    wavelen = 2 * math.pi / inv
    smooth = (old_ctx / wavelen - lo) / (hi - lo)
    mid = 1.0 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < old_ctx / hi, 1.0, np.where(wavelen > old_ctx / lo, factor, mid))


def _rope_from_freqs(g: GGUFFile, head_dim: int, theta: float) -> Optional[dict]:
    """llama3 rope parameters that reproduce `rope_freqs.weight`. llama3's own low/high
    frequency factors (1, 4) are assumed; the original context follows from any divisor
    between 1 and the factor, or from the gap between the unscaled and scaled ones."""
    factors = dequantize(g, "rope_freqs.weight").astype(np.float64).reshape(-1)
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if len(factors) != len(inv) or not np.all(np.isfinite(factors) & (factors >= 1.0)):
        seen = f"{len(factors)} divisors" + (f" in [{factors.min():g}, {factors.max():g}]" if len(factors) else "")
        raise bad(g.path, "rope_freqs.weight", seen, f"{len(inv)} divisors (head dim / 2), each finite and >= 1")
    if np.all(factors == 1.0):
        return None
    factor, lo, hi = float(factors.max()), 1.0, 4.0
    mid = (factors > 1.0) & (factors < factor)
    if mid.any():
        s = (1.0 / factors[mid][0] - 1.0 / factor) / (1.0 - 1.0 / factor)
        old_ctx = round(2 * math.pi * ((hi - lo) * s + lo) / inv[mid][0])
    else:  # any context between hi * (longest unscaled wavelength) and the shortest scaled one
        wl = 2 * math.pi / inv
        old_ctx = math.floor(wl[factors == factor].min())
    candidate = {"rope_type": "llama3", "factor": factor, "low_freq_factor": lo, "high_freq_factor": hi,
                 "original_max_position_embeddings": int(old_ctx)}
    if not 1 <= old_ctx <= INT_LIMITS["max_position_embeddings"][1] or not np.allclose(
            _llama3_factors(inv, factor, lo, hi, old_ctx), factors, rtol=1e-5, atol=0):
        raise GGUFUnsupported(f"{g.path}: rope_freqs.weight does not follow Llama 3 rope scaling "
                              "(low/high frequency factors 1 and 4); ferroxmp cannot reproduce it", "rope_freqs.weight")
    return candidate


def _rope_scaling(g: GGUFFile, head_dim: int, theta: float) -> Optional[dict]:
    kind = g.arch_key("rope.scaling.type")
    if kind in (None, "none"):
        return _rope_from_freqs(g, head_dim, theta) if "rope_freqs.weight" in g.tensors else None
    if kind == "linear":
        return {"rope_type": "linear", "factor": _float(g, "rope.scaling.factor", None, 1e6)}
    raise GGUFUnsupported(f"{g.path}: {g.architecture}.rope.scaling.type {kind!r} is not supported; ferroxmp "
                          "implements linear and Llama 3 (rope_freqs.weight)", f"{g.architecture}.rope.scaling.type")


def _int(g: GGUFFile, suffix: str, hf: str, default: Any = None) -> Optional[int]:
    """`{arch}.suffix` as an int within the bounds of its config.json twin `hf`."""
    key = f"{g.architecture}.{suffix}"
    v = g.metadata.get(key, default)
    return None if v is None else int_field(g.path, key, v, *INT_LIMITS[hf])


def _float(g: GGUFFile, suffix: str, default: float, hi: float) -> float:
    key = f"{g.architecture}.{suffix}"
    return _f32(float_field(g.path, key, g.metadata.get(key, default), 0.0, hi))


_TOKEN_IDS = ("bos", "eos", "unknown", "padding", "seperator", "cls", "mask", "eot", "eom")


def check_tokenizer_metadata(g: GGUFFile) -> None:
    """Types and ranges of the tokenizer.ggml.* keys the tokenizer builder reads, so a
    hostile file is refused by field name instead of failing inside `tokenizers`."""
    tokens = g.get("tokenizer.ggml.tokens")
    if tokens is None:
        return  # build_tokenizer refuses a file without a tokenizer, by name
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise bad(g.path, "tokenizer.ggml.tokens", tokens, "a non-empty array of strings")
    types = g.get("tokenizer.ggml.token_type")
    if types is not None and (not isinstance(types, list) or len(types) != len(tokens)
                              or not all(is_int(t) for t in types)):
        seen = f"{len(types)} items" if isinstance(types, list) else type(types).__name__
        raise bad(g.path, "tokenizer.ggml.token_type", seen, f"an array of {len(tokens)} integers (one per token)")
    merges = g.get("tokenizer.ggml.merges")
    if merges is not None and (not isinstance(merges, list)
                               or not all(isinstance(m, str) and " " in m for m in merges)):
        raise bad(g.path, "tokenizer.ggml.merges", merges, "an array of 'left right' strings")
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.chat_template"):
        if g.get(key) is not None and not isinstance(g.get(key), str):
            raise bad(g.path, key, g.get(key), "a string")
    for name in _TOKEN_IDS:
        key = f"tokenizer.ggml.{name}_token_id"
        if g.get(key) is not None:
            int_field(g.path, key, g.get(key), 0, len(tokens) - 1)
    for key in ("tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_eos_token"):
        if g.get(key) is not None and not isinstance(g.get(key), bool):
            raise bad(g.path, key, g.get(key), "true or false")


def hf_config(g: GGUFFile) -> dict[str, Any]:
    """The config.json equivalent of `g` (checked: refuses what ferroxmp cannot run)."""
    check_supported(g)
    check_tokenizer_metadata(g)
    arch, model_type = ARCHITECTURES[g.architecture]
    window = None if g.arch_key("attention.sliding_window") == 0 else _int(g, "attention.sliding_window",
                                                                           "sliding_window")
    if window and g.architecture == "llama":
        arch, model_type = ARCHITECTURES["mistral"]
    hidden = _int(g, "embedding_length", "hidden_size")
    heads = _int(g, "attention.head_count", "num_attention_heads")
    if hidden is None or heads is None:
        key = "embedding_length" if hidden is None else "attention.head_count"
        raise GGUFError(f"{g.path}: {g.architecture}.{key} is missing; expected an integer",
                        f"{g.architecture}.{key}")
    head_dim = _int(g, "attention.key_length", "head_dim")
    if head_dim is None:
        if hidden % heads:
            raise bad(g.path, f"{g.architecture}.attention.head_count", heads,
                      f"a divisor of {g.architecture}.embedding_length ({hidden}) when attention.key_length is absent")
        head_dim = hidden // heads
    value_dim = _int(g, "attention.value_length", "head_dim")
    if value_dim is not None and value_dim != head_dim:
        raise bad(g.path, f"{g.architecture}.attention.value_length", value_dim, f"{head_dim} (the key length)")
    rot = g.arch_key("rope.dimension_count")
    if rot is not None and rot != head_dim:
        if not is_int(rot):
            raise bad(g.path, f"{g.architecture}.rope.dimension_count", rot, f"{head_dim} (the head dim)")
        raise GGUFUnsupported(f"{g.path}: {g.architecture}.rope.dimension_count is {rot}; expected {head_dim}, "
                              "the head dim (partial rotary embedding is not supported)",
                              f"{g.architecture}.rope.dimension_count")
    theta = _float(g, "rope.freq_base", 10000.0, 1e12)
    embed = g.tensors.get("token_embd.weight")
    if embed is None:
        raise GGUFUnsupported(f"{g.path}: no token_embd.weight tensor", "token_embd.weight")
    layers, ffn = _int(g, "block_count", "num_hidden_layers"), _int(g, "feed_forward_length", "intermediate_size")
    for key, v in (("block_count", layers), ("feed_forward_length", ffn)):
        if v is None:
            raise GGUFError(f"{g.path}: {g.architecture}.{key} is missing; expected an integer",
                            f"{g.architecture}.{key}")
    return {
        "architectures": [arch], "model_type": model_type, "hidden_size": hidden,
        "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": _int(g, "attention.head_count_kv", "num_key_value_heads") or heads,
        "head_dim": head_dim, "intermediate_size": ffn, "vocab_size": embed.shape[0],
        "max_position_embeddings": _int(g, "context_length", "max_position_embeddings", 4096),
        "rms_norm_eps": _float(g, "attention.layer_norm_rms_epsilon", 1e-6, 1.0), "rope_theta": theta,
        "rope_scaling": _rope_scaling(g, head_dim, theta),
        "tie_word_embeddings": "output.weight" not in g.tensors,
        "attention_bias": "blk.0.attn_q.bias" in g.tensors,
        "sliding_window": window or None, "hidden_act": "silu",
        "torch_dtype": weights_dtype(g),
    }
