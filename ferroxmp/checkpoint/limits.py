"""What a checkpoint's config fields may hold, and the one error that names a bad one.

Job: `CheckpointError` (every refusal of a checkpoint file is one: GGUFError,
GGUFUnsupported and the loader's UnsupportedModel derive from it) and `check_config`,
the type / range / consistency check of a config.json dict (a folder's, or the one
gguf_config builds from GGUF metadata), run before anything divides by, allocates from
or loops over a field.

Invariants:
- A CheckpointError's message is ONE line: the file, the field, the value found (cut
  to 80 characters) and what was expected; `.field` holds the field's name.
- The bounds are far above any published model (they only stop absurd values: 10^9
  layers, a 10^12-token context) and every geometry field is also checked against the
  tensors (validate.py), so an in-range lie is caught there.
- Booleans are not integers here (JSON `true` is no head count).
"""
from __future__ import annotations

import math
from typing import Any, Optional

# field -> (lowest, highest) for the integer fields of a config.json
INT_LIMITS = {
    "hidden_size": (1, 1 << 16), "num_hidden_layers": (1, 1024), "num_attention_heads": (1, 1024),
    "num_key_value_heads": (1, 1024), "head_dim": (2, 1024), "intermediate_size": (1, 1 << 20),
    "vocab_size": (1, 1 << 22), "max_position_embeddings": (1, 1 << 24), "sliding_window": (1, 1 << 24),
}


class CheckpointError(ValueError):
    """A checkpoint file ferroxmp refuses; `field` names what is wrong (None: the file itself)."""

    def __init__(self, message: str, field: Optional[str] = None):
        super().__init__(" ".join(str(message).splitlines()))
        self.field = field


class GGUFUnsupported(CheckpointError):
    """The GGUF file asks for something ferroxmp does not implement; the message names it."""


def show(value: Any) -> str:
    """A value as one short line, for an error message."""
    text = repr(value)
    text = " ".join(text.split())
    return text if len(text) <= 80 else text[:77] + "..."


def bad(path: str, field: str, got: Any, expected: str) -> CheckpointError:
    return CheckpointError(f"{path}: {field} is {show(got)}; expected {expected}", field)


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def int_field(path: str, field: str, v: Any, lo: int, hi: int) -> int:
    if not is_int(v) or not lo <= v <= hi:
        raise bad(path, field, v, f"an integer in [{lo}, {hi}]")
    return v


def float_field(path: str, field: str, v: Any, lo: float, hi: float, lo_open: bool = True) -> float:
    """A finite number in (lo, hi] (or [lo, hi] with lo_open=False)."""
    ok = (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
          and (v > lo if lo_open else v >= lo) and v <= hi)
    if not ok:
        raise bad(path, field, v, f"a number in {'(' if lo_open else '['}{lo:g}, {hi:g}]")
    return float(v)


def _rope(path: str, key: str, rope: Any) -> None:
    if rope is None:
        return
    if not isinstance(rope, dict):
        raise bad(path, key, rope, "an object or null")
    kind = rope.get("rope_type", rope.get("type", "default"))
    if not isinstance(kind, str) or not kind:
        raise bad(path, f"{key}.rope_type", kind, "a rope type name (default, linear, llama3, ...)")
    if rope.get("rope_theta") is not None:
        float_field(path, f"{key}.rope_theta", rope["rope_theta"], 0.0, 1e12)
    if kind in ("linear", "llama3"):
        # >= 1, as transformers validates it: a factor near 0 divides the frequencies into inf
        float_field(path, f"{key}.factor", rope.get("factor"), 1.0, 1e6, lo_open=False)
    if kind == "llama3":  # the smoothing divides by high - low: they must differ
        lo = float_field(path, f"{key}.low_freq_factor", rope.get("low_freq_factor"), 0.0, 1e6)
        float_field(path, f"{key}.high_freq_factor", rope.get("high_freq_factor"), lo, 1e6)
        int_field(path, f"{key}.original_max_position_embeddings",
                  rope.get("original_max_position_embeddings"), 1, INT_LIMITS["max_position_embeddings"][1])


def check_config(raw: Any, path: str) -> None:
    """Types, ranges and the geometry's own consistency; raises CheckpointError."""
    if not isinstance(raw, dict):
        raise bad(path, "config", type(raw).__name__, "a JSON object")
    archs = raw.get("architectures")
    if not isinstance(archs, list) or not archs or not all(isinstance(a, str) for a in archs):
        raise bad(path, "architectures", archs, "a non-empty list of names")
    for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size"):
        int_field(path, name, raw.get(name), *INT_LIMITS[name])
    for name in ("num_key_value_heads", "head_dim", "max_position_embeddings", "sliding_window"):
        if raw.get(name) is not None:
            int_field(path, name, raw[name], *INT_LIMITS[name])
    hidden, heads = raw["hidden_size"], raw["num_attention_heads"]
    kv = raw.get("num_key_value_heads") or heads
    if kv > heads or heads % kv:
        raise bad(path, "num_key_value_heads", kv, f"a divisor of num_attention_heads ({heads})")
    if raw.get("head_dim") is None and hidden % heads:
        raise bad(path, "num_attention_heads", heads, f"a divisor of hidden_size ({hidden}) when head_dim is absent")
    head_dim = raw.get("head_dim") or hidden // heads
    if head_dim % 2:
        raise bad(path, "head_dim", head_dim, "an even number (rotary embeddings pair dimensions)")
    for name in ("max_position_embeddings", "rms_norm_eps", "rope_theta"):  # absent: a default; null: no
        if name in raw and raw[name] is None:
            raise bad(path, name, None, "a number (or no such key, for the default)")
    if raw.get("rms_norm_eps") is not None:
        float_field(path, "rms_norm_eps", raw["rms_norm_eps"], 0.0, 1.0)
    if raw.get("rope_theta") is not None:
        float_field(path, "rope_theta", raw["rope_theta"], 0.0, 1e12)
    for name in ("bos_token_id", "pad_token_id", "eos_token_id"):
        ids = raw.get(name)
        ids = ids if isinstance(ids, list) and name == "eos_token_id" else [ids]
        if not all(i is None or (is_int(i) and 0 <= i < raw["vocab_size"]) for i in ids):
            raise bad(path, name, raw[name], f"a token id in [0, {raw['vocab_size'] - 1}] (vocab_size)"
                      + (" or a list of them" if name == "eos_token_id" else ""))
    rope_key = "rope_scaling" if raw.get("rope_scaling") else "rope_parameters"
    _rope(path, rope_key, raw.get(rope_key))
    for name in ("tie_word_embeddings", "attention_bias", "use_sliding_window", "use_cache", "mlp_bias"):
        if name in raw and not isinstance(raw[name], bool) and not (name == "use_sliding_window" and raw[name] is None):
            raise bad(path, name, raw[name], "true or false")
    dtype = raw.get("torch_dtype") or raw.get("dtype")
    if dtype is not None and not isinstance(dtype, str):  # which names are served: loader.resolve_dtype
        raise bad(path, "torch_dtype", dtype, "a dtype name")
