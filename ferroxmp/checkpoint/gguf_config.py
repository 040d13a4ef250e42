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

from .gguf_file import GGUFFile

# general.architecture -> (HF architecture, model_type); 'llama' with a sliding window is Mistral
ARCHITECTURES = {"llama": ("LlamaForCausalLM", "llama"), "mistral": ("MistralForCausalLM", "mistral"),
                 "qwen2": ("Qwen2ForCausalLM", "qwen2"), "qwen3": ("Qwen3ForCausalLM", "qwen3")}
# Tensor types whose dequantization the tests check against the source weights.
TENSOR_TYPES = (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q6_K)
_TORCH_DTYPE = {Q.F32: "float32", Q.F16: "float16", Q.BF16: "bfloat16"}


class GGUFUnsupported(ValueError):
    """The GGUF file asks for something ferroxmp does not implement; the message names it."""


def _f32(x: Any) -> float:
    return float(str(np.float32(x)))


def check_supported(g: GGUFFile) -> None:
    arch = g.architecture
    if arch not in ARCHITECTURES:
        raise GGUFUnsupported(f"{g.path}: GGUF architecture {arch!r} is not supported; ferroxmp runs "
                              f"{', '.join(ARCHITECTURES)}")
    from .gguf_weights import CONFIG_TENSORS, hf_name  # (gguf_weights imports this module)
    allowed = {int(t) for t in TENSOR_TYPES}
    for info in g.tensors.values():
        if info.name not in CONFIG_TENSORS:
            hf_name(info.name)  # refuses a tensor ferroxmp's models have no place for
        if info.type_id not in allowed:
            raise GGUFUnsupported(f"{g.path}: tensor {info.name!r} has type {info.type_name}, which ferroxmp "
                                  f"does not dequantize; supported: {', '.join(t.name for t in TENSOR_TYPES)}")


def permutes_qk(g: GGUFFile) -> bool:
    """llama.cpp's converter reorders Llama-family q/k rows for its interleaved rope;
    Qwen models keep the Hugging Face (half-split) order."""
    return g.architecture in ("llama", "mistral")


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
    from .gguf_weights import dequantize
    factors = dequantize(g, "rope_freqs.weight").astype(np.float64).reshape(-1)
    if np.all(factors == 1.0):
        return None
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
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
    if len(factors) != len(inv) or not np.allclose(_llama3_factors(inv, factor, lo, hi, old_ctx), factors,
                                                   rtol=1e-5, atol=0):
        raise GGUFUnsupported(f"{g.path}: rope_freqs.weight does not follow Llama 3 rope scaling "
                              "(low/high frequency factors 1 and 4); ferroxmp cannot reproduce it")
    return candidate


def _rope_scaling(g: GGUFFile, head_dim: int, theta: float) -> Optional[dict]:
    kind = g.arch_key("rope.scaling.type")
    if kind in (None, "none"):
        return _rope_from_freqs(g, head_dim, theta) if "rope_freqs.weight" in g.tensors else None
    if kind == "linear":
        return {"rope_type": "linear", "factor": _f32(g.arch_key("rope.scaling.factor"))}
    raise GGUFUnsupported(f"{g.path}: rope scaling {kind!r} is not supported; ferroxmp implements linear "
                          "and Llama 3 (rope_freqs.weight)")


def hf_config(g: GGUFFile) -> dict[str, Any]:
    """The config.json equivalent of `g` (checked: refuses what ferroxmp cannot run)."""
    check_supported(g)
    arch, model_type = ARCHITECTURES[g.architecture]
    window = g.arch_key("attention.sliding_window")
    if window and g.architecture == "llama":
        arch, model_type = ARCHITECTURES["mistral"]
    hidden, heads = int(g.arch_key("embedding_length")), int(g.arch_key("attention.head_count"))
    head_dim = int(g.arch_key("attention.key_length") or hidden // heads)
    rot = g.arch_key("rope.dimension_count")
    if rot is not None and int(rot) != head_dim:
        raise GGUFUnsupported(f"{g.path}: partial rotary embedding (rope.dimension_count {rot} of head "
                              f"dim {head_dim}) is not supported")
    theta = _f32(g.arch_key("rope.freq_base", 10000.0))
    embed = g.tensors.get("token_embd.weight")
    if embed is None:
        raise GGUFUnsupported(f"{g.path}: no token_embd.weight tensor")
    return {
        "architectures": [arch], "model_type": model_type, "hidden_size": hidden,
        "num_hidden_layers": int(g.arch_key("block_count")), "num_attention_heads": heads,
        "num_key_value_heads": int(g.arch_key("attention.head_count_kv") or heads), "head_dim": head_dim,
        "intermediate_size": int(g.arch_key("feed_forward_length")), "vocab_size": embed.shape[0],
        "max_position_embeddings": int(g.arch_key("context_length", 4096)),
        "rms_norm_eps": _f32(g.arch_key("attention.layer_norm_rms_epsilon", 1e-6)), "rope_theta": theta,
        "rope_scaling": _rope_scaling(g, head_dim, theta),
        "tie_word_embeddings": "output.weight" not in g.tensors,
        "sliding_window": int(window) if window else None, "hidden_act": "silu",
        "torch_dtype": weights_dtype(g),
    }
