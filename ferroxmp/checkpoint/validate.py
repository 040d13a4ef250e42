"""Checkpoint validation: a file is checked whole before any weight is used.

Job: `validate_checkpoint(path)` for `ferroxmp serve` (before any process starts) and
`validated_folder` / `validated_gguf` for the loader (every process that reads a
config): the config's fields (limits.check_config), every tensor's shape against the
geometry (hidden size, heads, kv heads, head_dim, intermediate size, layers, vocab),
the tokenizer's size against the embedding rows, and where the tensor bytes lie
(GGUF: gguf_file checks offsets; Hugging Face: the safetensors headers are read and
checked, no tensor data is loaded).

Invariants:
- Every refusal is a CheckpointError naming the file and the field, one line.
- A checkpoint that passes has every tensor the model takes, in the shape it takes,
  and no layer beyond num_hidden_layers (a file that lies about its layer count would
  otherwise serve a truncated model); the embedding has a row for every token id.
- Nothing here imports torch: the supervisor runs it before any child starts.
"""
from __future__ import annotations

import json
import math
import os
import re
import struct
from typing import Any, Optional

from .limits import CheckpointError, bad, check_config

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_ST_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8}
_FLOATS = ("F64", "F32", "F16", "BF16")
_IGNORED = ("rotary_emb.inv_freq",)  # buffers older checkpoints saved; recomputed from the config
MAX_HEADER = 100 << 20  # safetensors' own limit on a header


def expected_shapes(raw: dict) -> tuple[dict[str, tuple], set[str]]:
    """(shape of every tensor the model may read, the names it must find) for a config
    dict that passed check_config."""
    h, nh, inter, v = raw["hidden_size"], raw["num_attention_heads"], raw["intermediate_size"], raw["vocab_size"]
    nkv = raw.get("num_key_value_heads") or nh
    hd = raw.get("head_dim") or h // nh
    arch = raw["architectures"][0]
    shapes: dict[str, tuple] = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,),
                                "lm_head.weight": (v, h)}
    need = {"model.embed_tokens.weight", "model.norm.weight"}
    if not raw.get("tie_word_embeddings", False):
        need.add("lm_head.weight")
    bias = "qkv" if arch == "Qwen2ForCausalLM" else ("qkvo" if raw.get("attention_bias") else "")
    for i in range(raw["num_hidden_layers"]):
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        layer = {f"model.layers.{i}.input_layernorm.weight": (h,),
                 f"model.layers.{i}.post_attention_layernorm.weight": (h,),
                 a + "q_proj.weight": (nh * hd, h), a + "k_proj.weight": (nkv * hd, h),
                 a + "v_proj.weight": (nkv * hd, h), a + "o_proj.weight": (h, nh * hd),
                 m + "gate_proj.weight": (inter, h), m + "up_proj.weight": (inter, h),
                 m + "down_proj.weight": (h, inter)}
        need |= set(layer)
        biases = {a + "q_proj.bias": (nh * hd,), a + "k_proj.bias": (nkv * hd,), a + "v_proj.bias": (nkv * hd,),
                  a + "o_proj.bias": (h,)}
        need |= {a + f"{p}_proj.bias" for p in bias}
        layer.update({k: s for k, s in biases.items() if k.split(".")[-2][0] in bias})
        if arch == "Qwen3ForCausalLM":
            layer.update({a + "q_norm.weight": (hd,), a + "k_norm.weight": (hd,)})
            need |= {a + "q_norm.weight", a + "k_norm.weight"}
        shapes.update(layer)
    return shapes, need


class _Same(dict):
    def get(self, name, default=None):  # a name as the file spells it: Hugging Face names as they are
        return name


def check_shapes(raw: dict, found: dict[str, tuple], path: str, shown: Optional[dict] = None) -> None:
    """`found` (checkpoint name -> shape) against what the config says; `shown.get(name)`
    is the name the file uses (GGUF's), for the message."""
    shown = shown or _Same()
    want, need = expected_shapes(raw)
    layers = raw["num_hidden_layers"]
    for name, shape in found.items():
        m = _LAYER.match(name)
        if m and int(m.group(1)) >= layers:
            raise bad(path, "num_hidden_layers", layers, f"more than {m.group(1)}: the file holds "
                      f"{shown.get(name, name)}")
        if name in want and tuple(shape) != want[name]:
            raise bad(path, f"{shown.get(name, name)} shape", list(shape), f"{list(want[name])} from the config "
                      f"(hidden {raw['hidden_size']}, heads {raw['num_attention_heads']}, kv heads "
                      f"{raw.get('num_key_value_heads') or raw['num_attention_heads']}, head_dim "
                      f"{raw.get('head_dim') or raw['hidden_size'] // raw['num_attention_heads']}, intermediate "
                      f"{raw['intermediate_size']}, vocab {raw['vocab_size']})")
        if name.endswith(".bias") and name not in want:
            raise bad(path, "attention_bias", raw.get("attention_bias", False),
                      f"true: the file holds {shown.get(name, name)}")
        if name not in want and not name.endswith(_IGNORED):
            raise CheckpointError(f"{path}: tensor {shown.get(name, name)} is not one "
                                  f"{raw['architectures'][0]} reads; expected only its tensors (a wrong "
                                  "architecture or a different model?)", shown.get(name, name))
    if raw.get("tie_word_embeddings") and "lm_head.weight" in found:  # which head? loaders disagree
        raise bad(path, "tie_word_embeddings", True, "false: the file holds its own lm_head.weight (a tied "
                  "model reads the embedding as its head)")
    missing = sorted(need - set(found), key=lambda n: (len(n), n))
    if missing:
        name = missing[0]
        raise CheckpointError(f"{path}: tensor {shown.get(name, name)} is missing; expected shape "
                              f"{list(want[name])} ({len(missing)} tensors missing in all)", shown.get(name, name))


def _safetensors_header(file: str) -> dict[str, Any]:
    """One safetensors file's header, every entry checked against the file's size."""
    size = os.path.getsize(file)
    with open(file, "rb") as f:
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if not 2 <= n <= min(MAX_HEADER, size - 8):
            raise bad(file, "header length", n, f"2 to {min(MAX_HEADER, max(size - 8, 0))} bytes (truncated file?)")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, ValueError) as e:
            raise bad(file, "header", str(e), "a JSON object") from None
    if not isinstance(header, dict):
        raise bad(file, "header", type(header).__name__, "a JSON object")
    data = size - 8 - n
    out = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        ok = (isinstance(e, dict) and e.get("dtype") in _ST_ITEMSIZE and isinstance(e.get("shape"), list)
              and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in e["shape"])
              and isinstance(e.get("data_offsets"), list) and len(e["data_offsets"]) == 2
              and all(isinstance(d, int) and not isinstance(d, bool) for d in e["data_offsets"]))
        if not ok:
            raise bad(file, f"tensor {name!r}", e, "{dtype, shape, data_offsets}")
        start, end = e["data_offsets"]
        nbytes = math.prod(e["shape"]) * _ST_ITEMSIZE[e["dtype"]]
        if not 0 <= start <= end <= data or end - start != nbytes:
            raise bad(file, f"tensor {name!r} data_offsets", [start, end],
                      f"{nbytes} bytes inside the {data} bytes of data (truncated file?)")
        if e["dtype"] not in _FLOATS:
            raise bad(file, f"tensor {name!r} dtype", e["dtype"], f"one of {', '.join(_FLOATS)}")
        out[name] = tuple(e["shape"])
    return out


def folder_shapes(folder: str) -> dict[str, tuple]:
    """Every tensor's shape in a Hugging Face folder (single file or sharded)."""
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                wmap = json.load(f).get("weight_map")
        except (OSError, ValueError, AttributeError) as e:
            raise bad(index, "weight_map", str(e), "a JSON object mapping tensors to shard files") from None
        if not isinstance(wmap, dict) or not all(isinstance(s, str) for s in wmap.values()):
            raise bad(index, "weight_map", wmap, "an object mapping tensor names to shard file names")
        files = sorted(set(wmap.values()))
        for s in files:
            if os.path.basename(s) != s or not os.path.isfile(os.path.join(folder, s)):
                raise bad(index, "weight_map", s, "the name of a shard file in the same folder")
    elif os.path.isfile(os.path.join(folder, "model.safetensors")):
        files, wmap = ["model.safetensors"], None
    else:
        raise CheckpointError(f"{folder}: model.safetensors is missing; expected it or "
                              "model.safetensors.index.json", "model.safetensors")
    shapes: dict[str, tuple] = {}
    for s in files:
        for name, shape in _safetensors_header(os.path.join(folder, s)).items():
            if name in shapes or (wmap is not None and wmap.get(name) != s):
                raise bad(os.path.join(folder, s), f"tensor {name!r}", s, "each tensor once, in the shard the "
                          "index names")
            shapes[name] = shape
    return shapes


def _tokenizer_max_id(folder: str) -> Optional[int]:
    """The largest token id tokenizer.json defines (vocab and added tokens), if any."""
    path = os.path.join(folder, "tokenizer.json")
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            tok = json.load(f)
    except (OSError, ValueError) as e:
        raise bad(path, "tokenizer.json", str(e), "a JSON tokenizer") from None
    ids = []
    vocab = (tok.get("model") or {}).get("vocab") if isinstance(tok, dict) else None
    if isinstance(vocab, dict):
        ids += vocab.values()
    elif isinstance(vocab, list):  # unigram: [[piece, score], ...]
        ids.append(len(vocab) - 1)
    ids += [a.get("id") for a in (tok.get("added_tokens") or []) if isinstance(a, dict)]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise bad(path, "token ids", next(i for i in ids if not isinstance(i, int) or i < 0), "non-negative integers")
    return max(ids, default=None)


def validated_folder(folder: str, raw: dict) -> dict:
    """A Hugging Face folder's config.json dict `raw`, checked against its tensors and tokenizer."""
    path = os.path.join(folder, "config.json")
    check_config(raw, path)
    check_shapes(raw, folder_shapes(folder), path)
    top = _tokenizer_max_id(folder)
    if top is not None and top >= raw["vocab_size"]:
        raise bad(path, "vocab_size", raw["vocab_size"], f"more than {top}: tokenizer.json has token id {top}, "
                  f"and model.embed_tokens.weight needs a row for it")
    return raw


class _GGUFNames(dict):
    def get(self, name, default=None):  # a missing tensor by the name a GGUF file would give it
        from .gguf_weights import gguf_name
        return super().get(name) or gguf_name(name)


def validated_gguf(g) -> dict:
    """A GGUFFile's config dict (gguf_config.hf_config), checked against its tensors and tokens."""
    from .gguf_config import hf_config
    from .gguf_weights import CONFIG_TENSORS, hf_name
    raw = hf_config(g)
    check_config(raw, g.path)
    names = {hf_name(n): n for n in g.tensors if n not in CONFIG_TENSORS}
    check_shapes(raw, {h: g.tensors[n].shape for h, n in names.items()}, g.path, _GGUFNames(names))
    rows = raw["vocab_size"]
    declared = g.arch_key("vocab_size")
    if declared is not None and declared != rows:
        raise bad(g.path, f"{g.architecture}.vocab_size", declared, f"{rows} (token_embd.weight rows)")
    tokens = g.get("tokenizer.ggml.tokens")
    if isinstance(tokens, list) and len(tokens) > rows:
        raise bad(g.path, "tokenizer.ggml.tokens", f"{len(tokens)} tokens",
                  f"at most {rows}: token_embd.weight has a row per token")
    return raw


def validate_checkpoint(path: str) -> None:
    """Check a checkpoint (GGUF file or Hugging Face folder) whole; raises CheckpointError."""
    from . import is_gguf
    if is_gguf(path):
        from .gguf_file import open_gguf
        validated_gguf(open_gguf(path))
        return
    config = os.path.join(path, "config.json")
    if not os.path.isfile(config):
        raise CheckpointError(f"{path}: config.json is missing; expected a Hugging Face checkpoint folder "
                              "or a .gguf file", "config.json")
    try:
        with open(config, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, ValueError) as e:
        raise bad(config, "config.json", str(e), "a JSON object") from None
    validated_folder(path, raw)
