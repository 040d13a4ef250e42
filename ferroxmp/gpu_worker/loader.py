"""Read a checkpoint: a Hugging Face folder (config.json -> ModelConfig, safetensors ->
tensors) or a GGUF file (metadata -> the same config dict, dequantized tensors under the
same names; see ferroxmp/checkpoint/).

Job: turn the files on disk into plain values the model module needs, and refuse what
ferroxmp cannot run with a message naming the problem and the alternatives.

Invariants:
- `ModelConfig` is complete and checked: head_dim * heads is the q width, heads is a
  multiple of kv_heads, rope type is one we implement.
- Weights come back with checkpoint names, on the requested device and dtype.
- EOS ids = generation_config.json's eos_token_id (int or list) + tokenizer_config's
  eos token (+ config.json's eos_token_id), deduplicated, in that order; for GGUF,
  llama.cpp's end-of-generation set (eos, eot, eom, end-marking control tokens).
- Loading that takes longer than a second shows a progress bar on stderr.
"""
from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from tqdm import tqdm

from ferroxmp.checkpoint import is_gguf
from ferroxmp.checkpoint.limits import CheckpointError, check_config, is_int
from ferroxmp.config import read_json as _read_json
from ferroxmp.heap import release_freed_memory

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear")
MODEL_TYPES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
               "Qwen3ForCausalLM": "qwen3"}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class UnsupportedModel(CheckpointError):
    """The checkpoint asks for something ferroxmp does not implement (`field` names it)."""


@dataclass
class ModelConfig:
    architecture: str
    model_type: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Optional[dict[str, Any]]
    tie_word_embeddings: bool
    qk_norm: bool
    sliding_window: Optional[int]
    dtype: torch.dtype
    eos_token_ids: list[int] = field(default_factory=list)
    kv_dtype: Optional[torch.dtype] = None  # --kv-cache-dtype; None: the model's dtype

    @property
    def rope_type(self) -> str:
        return (self.rope_scaling or {}).get("rope_type") or (self.rope_scaling or {}).get("type") or "default"

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    @property
    def cache_dtype(self) -> torch.dtype:
        """What the KV pool stores: --kv-cache-dtype, else the model's dtype."""
        return self.kv_dtype or self.dtype

    @property
    def cache_dtype_name(self) -> str:
        return str(self.cache_dtype).removeprefix("torch.")

    def kv_bytes_per_token(self, dtype: Optional[torch.dtype] = None) -> int:
        itemsize = torch.empty((), dtype=dtype or self.cache_dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize

    def check_integrity(self) -> None:
        assert self.num_heads % self.num_kv_heads == 0, "heads must be a multiple of kv heads"
        assert self.head_dim % 2 == 0, "RoPE needs an even head_dim"
        assert self.sliding_window is None or self.sliding_window > 0
        assert self.rope_type in SUPPORTED_ROPE_TYPES



def _as_list(x: Any, where: str = "eos_token_id") -> list[int]:
    if x is None:
        return []
    ids = list(x) if isinstance(x, (list, tuple)) else [x]
    if not all(is_int(i) and i >= 0 for i in ids):
        raise UnsupportedModel(f"{where} is {x!r}; expected a token id or a list of them", where)
    return ids


def eos_token_ids(model_path: str, cfg: dict) -> list[int]:
    ids = _as_list(_read_json(os.path.join(model_path, "generation_config.json")).get("eos_token_id"),
                   os.path.join(model_path, "generation_config.json") + ": eos_token_id")
    tok_cfg = _read_json(os.path.join(model_path, "tokenizer_config.json"))
    eos = tok_cfg.get("eos_token")
    eos = eos.get("content") if isinstance(eos, dict) else eos
    if eos:
        vocab_id = _token_id(model_path, eos, tok_cfg)
        if vocab_id is not None:
            ids.append(vocab_id)
    ids += _as_list(cfg.get("eos_token_id"), os.path.join(model_path, "config.json") + ": eos_token_id")
    return list(dict.fromkeys(ids))


def _token_id(model_path: str, token: str, tok_cfg: dict) -> Optional[int]:
    for entry in (tok_cfg.get("added_tokens_decoder") or {}).items():
        if entry[1].get("content") == token:
            return int(entry[0])
    tok = _read_json(os.path.join(model_path, "tokenizer.json"))
    for added in tok.get("added_tokens", []):
        if added.get("content") == token:
            return int(added["id"])
    vocab = (tok.get("model") or {}).get("vocab")
    return vocab.get(token) if isinstance(vocab, dict) else None


def resolve_dtype(name: str, checkpoint: dict, cuda: Optional[bool] = None) -> torch.dtype:
    """--dtype `name`; auto: the checkpoint's dtype where the device computes it natively,
    float32 where a CPU would emulate bf16/fp16 (cpu_dtype.choose_dtype). `cuda` None:
    where torch puts the model by default (--device auto)."""
    from ferroxmp.gpu_worker.cpu_dtype import choose_dtype
    raw = checkpoint.get("torch_dtype") or checkpoint.get("dtype") or "float32"
    known = isinstance(raw, str) and raw in _DTYPES
    if name == "auto" and not known:
        raise UnsupportedModel(f"torch_dtype {raw!r} is not one of {sorted(_DTYPES)}; pass --dtype",
                               "torch_dtype")
    on_cuda = torch.cuda.is_available() if cuda is None else cuda
    return choose_dtype(None if name == "auto" else _DTYPES[name], _DTYPES[raw] if known else torch.float32,
                        on_cuda).dtype


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda was asked for but torch sees no CUDA device; use --device cpu")
    return torch.device(name)


def _gguf_config(model_path: str) -> tuple[dict, list[int]]:
    from ferroxmp.checkpoint.gguf_file import open_gguf
    from ferroxmp.checkpoint.gguf_tokenizer import eog_token_ids
    from ferroxmp.checkpoint.validate import validated_gguf
    try:
        g = open_gguf(model_path)
        return validated_gguf(g), eog_token_ids(g)
    except UnsupportedModel:
        raise
    except CheckpointError as e:
        raise UnsupportedModel(str(e), e.field) from None


def load_config(model_path: str, dtype: str = "auto", kv_cache_dtype: str = "auto") -> ModelConfig:
    """The checkpoint's config, validated whole against its tensors and tokenizer
    (checkpoint/validate.py) before anything is allocated from it. `kv_cache_dtype`
    (--kv-cache-dtype): what the KV pool stores, "auto" = the model's dtype."""
    cfg = _load_config(model_path, dtype)
    if kv_cache_dtype not in ("auto", cfg.dtype_name):
        cfg = dataclasses.replace(cfg, kv_dtype=getattr(torch, kv_cache_dtype))
    return cfg


def _load_config(model_path: str, dtype: str) -> ModelConfig:
    from ferroxmp.checkpoint.validate import validated_folder
    if is_gguf(model_path):
        raw, eos_ids = _gguf_config(model_path)
        where = model_path
    else:
        where = os.path.join(model_path, "config.json")
        try:
            raw = _read_json(where)
        except ValueError as e:
            raise UnsupportedModel(f"{where}: config.json is not JSON ({e})", "config.json") from None
        if not raw:
            raise UnsupportedModel(f"{model_path!r} has no config.json: not a Hugging Face checkpoint folder",
                                   "config.json")
        try:
            validated_folder(model_path, raw)
        except UnsupportedModel:
            raise
        except CheckpointError as e:
            raise UnsupportedModel(str(e), e.field) from None
        eos_ids = eos_token_ids(model_path, raw)
    return config_from_dict(raw, eos_ids, dtype, where)


def config_from_dict(raw: dict, eos_ids: list[int], dtype: str = "auto", path: str = "config") -> ModelConfig:
    """A config.json dict (a folder's, or one made from GGUF metadata) as a checked
    ModelConfig; `path` names the file in an error."""
    try:
        check_config(raw, path)
    except CheckpointError as e:
        raise UnsupportedModel(str(e), e.field) from None
    archs = raw.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise UnsupportedModel(f"architectures {archs or raw.get('model_type')!r} is not supported; "
                               f"ferroxmp runs {', '.join(SUPPORTED_ARCHITECTURES)}", "architectures")
    if raw.get("model_type") != MODEL_TYPES[arch]:  # transformers builds the model model_type names
        raise UnsupportedModel(f"{path}: model_type is {raw.get('model_type')!r}; expected {MODEL_TYPES[arch]!r} "
                               f"for {arch}", "model_type")
    heads = int(raw["num_attention_heads"])
    rope = dict(raw.get("rope_scaling") or raw.get("rope_parameters") or {})
    theta = float(raw.get("rope_theta") or rope.get("rope_theta") or 10000.0)
    rope.pop("rope_theta", None)
    model_type = raw.get("model_type", "")
    window = raw.get("sliding_window") if arch == "MistralForCausalLM" else None
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and raw.get("use_sliding_window"):
        raise UnsupportedModel(f"{arch} with use_sliding_window=true (per-layer windows) is not supported",
                               "use_sliding_window")
    cfg = ModelConfig(
        architecture=arch, model_type=model_type, hidden_size=int(raw["hidden_size"]),
        num_layers=int(raw["num_hidden_layers"]), num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or raw["hidden_size"] // heads),
        intermediate_size=int(raw["intermediate_size"]), vocab_size=int(raw["vocab_size"]),
        max_position_embeddings=int(raw.get("max_position_embeddings") or 4096),
        rms_norm_eps=float(raw.get("rms_norm_eps") or 1e-6), rope_theta=theta,
        rope_scaling=rope if rope.get("rope_type", rope.get("type", "default")) != "default" else None,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qk_norm=arch == "Qwen3ForCausalLM", sliding_window=int(window) if window else None,
        dtype=resolve_dtype(dtype, raw), eos_token_ids=eos_ids)
    if cfg.rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModel(f"rope_scaling type {cfg.rope_type!r} is not supported; ferroxmp implements "
                               f"{', '.join(SUPPORTED_ROPE_TYPES)}", "rope_scaling")
    if raw.get("hidden_act", "silu") != "silu":
        raise UnsupportedModel(f"hidden_act {raw['hidden_act']!r} is not supported (only silu)", "hidden_act")
    cfg.check_integrity()
    return cfg


def weight_files(model_path: str) -> list[str]:
    index = os.path.join(model_path, "model.safetensors.index.json")
    if os.path.isfile(index):
        shards = sorted(set(_read_json(index)["weight_map"].values()))
        return [os.path.join(model_path, s) for s in shards]
    single = os.path.join(model_path, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    raise UnsupportedModel(f"{model_path!r} holds neither model.safetensors nor model.safetensors.index.json")


def _progress(total: int, what: str) -> tqdm:
    # delay: a load that ends within a second prints nothing
    return tqdm(total=total, desc=what, unit="tensor", delay=1.0, mininterval=0.5, leave=False,
                file=sys.stderr, dynamic_ncols=True)


Select = Callable[[str, tuple], Optional[tuple]]


def _compress_then_select(name: str, t: torch.Tensor, fmt: str, select: Optional[Select]):
    """A weight held in groups (quant.Groups): quantized whole, then cut, so a
    tensor-parallel shard holds exactly tp=1's values."""
    from ferroxmp.gpu_worker.quant import Groups
    index = () if select is None else select(name, tuple(t.shape))
    if index is None:
        return None
    g = Groups.quantize(t, fmt)
    return g[index] if index else g


def _float_dtype(fmt: Optional[str], dtype: torch.dtype) -> torch.dtype:
    return torch.float16 if fmt == "fp16" else dtype


def load_weights(model_path: str, device: torch.device, dtype: torch.dtype,
                 select: Optional[Select] = None, quantization: str = "none") -> dict[str, Any]:
    """Every tensor, or with `select(name, shape)` -> a tuple of slices (() = whole,
    None = skip) only those parts: a tensor-parallel rank's shard (parallel/group.py). Safetensors
    slices are read from the file as slices; GGUF tensors are dequantized whole, then cut.
    quantization (a mode resolved by quant.resolve_mode) gives each tensor the format
    quant.target_format names: 'int4'/'int8' come back as quant.Groups (quantized whole,
    then cut; a GGUF's Q4_0/Q4_1/Q8_0 blocks as stored), 'fp16' as float16 tensors (the
    model packs them for FBGEMM)."""
    from ferroxmp.gpu_worker.quant import target_format
    if is_gguf(model_path):
        out = _load_gguf_weights(model_path, device, dtype, select, quantization)
        release_freed_memory()
        return out
    from safetensors import safe_open
    out: dict[str, Any] = {}
    for path in weight_files(model_path):
        with safe_open(path, framework="pt", device="cpu") as f:
            names = list(f.keys())
            with _progress(len(names), f"loading {os.path.basename(path)}") as bar:
                for name in names:
                    part = f.get_slice(name)
                    fmt = target_format(name, tuple(part.get_shape()), quantization)
                    if fmt in ("int4", "int8"):
                        t = _compress_then_select(name, f.get_tensor(name), fmt, select)
                    elif select is None:
                        t = f.get_tensor(name)
                    else:
                        index = select(name, tuple(part.get_shape()))
                        t = None if index is None else (part[index] if index else part[:])
                    if t is not None:
                        out[name] = t.to(device) if fmt in ("int4", "int8") else \
                            t.to(device=device, dtype=_float_dtype(fmt, dtype))
                    bar.update()
    if quantization != "none":
        release_freed_memory()
    return out


def _load_gguf_weights(model_path: str, device: torch.device, dtype: torch.dtype,
                       select: Optional[Select] = None, quantization: str = "none") -> dict[str, Any]:
    from ferroxmp.checkpoint.gguf_config import hf_config
    from ferroxmp.checkpoint.gguf_file import open_gguf
    from ferroxmp.checkpoint.gguf_weights import hf_name, row_order, weight, weight_names
    from ferroxmp.gpu_worker.quant import Groups, target_format
    from ferroxmp.gpu_worker.quant.policy import log_gguf_conversions, read_as_groups
    g = open_gguf(model_path)
    raw = hf_config(g)
    heads, kv_heads = raw["num_attention_heads"], raw["num_key_value_heads"]
    if quantization != "none":
        log_gguf_conversions(g, quantization)
    names = weight_names(g)
    for n in names:
        hf_name(n)  # refuse an unknown tensor before spending time on the others
    out: dict[str, Any] = {}
    with _progress(len(names), f"reading {os.path.basename(model_path)}") as bar:
        for n in names:
            name, info = hf_name(n), g.tensors[n]
            fmt = target_format(name, info.shape, quantization, info.type_name)
            bar.update()
            if read_as_groups(info.type_name, fmt):
                index = () if select is None else select(name, tuple(info.shape))
                if index is not None:
                    blocks = Groups.from_gguf(g.raw(n), info.type_name)
                    order = row_order(g, n, heads, kv_heads)
                    blocks = blocks if order is None else blocks[torch.from_numpy(order)]
                    out[name] = (blocks[index] if index else blocks).to(device)
                continue
            w = weight(g, n, heads, kv_heads)
            if fmt in ("int4", "int8"):
                t = _compress_then_select(name, torch.from_numpy(w), fmt, select)
                if t is not None:
                    out[name] = t.to(device)
                continue
            index = () if select is None else select(name, tuple(w.shape))
            if index is not None:
                w = w[index] if index else w
                w = w.copy() if not w.flags.writeable or index else w  # mapped read-only; a slice: own it
                out[name] = torch.from_numpy(w).to(device=device, dtype=_float_dtype(fmt, dtype))
    return out


def weight_bytes(model_path: str, dtype: torch.dtype, quantization: str = "none") -> int:
    """Bytes the weights will take (from the file headers, nothing loaded): each tensor in
    the format quant.target_format gives it (quant.policy.format_bytes), and under fp16 a
    head tied to the embedding a second copy (FBGEMM's packed one)."""
    from ferroxmp.gpu_worker.quant import target_format
    from ferroxmp.gpu_worker.quant.policy import format_bytes
    itemsize = torch.empty((), dtype=dtype).element_size()
    shapes: dict[str, tuple] = {}
    stored: dict[str, str] = {}
    if is_gguf(model_path):
        from ferroxmp.checkpoint.gguf_file import open_gguf
        from ferroxmp.checkpoint.gguf_weights import hf_name, weight_names
        g = open_gguf(model_path)
        for n in weight_names(g):
            shapes[hf_name(n)], stored[hf_name(n)] = g.tensors[n].shape, g.tensors[n].type_name
    else:
        from safetensors import safe_open
        for path in weight_files(model_path):
            with safe_open(path, framework="pt", device="cpu") as f:
                for name in f.keys():
                    shapes[name] = tuple(f.get_slice(name).get_shape())
    total = 0
    for name, shape in shapes.items():
        total += format_bytes(target_format(name, shape, quantization, stored.get(name)), shape, itemsize)
    head = "model.embed_tokens.weight"
    if quantization == "fp16" and "lm_head.weight" not in shapes and head in shapes:
        total += format_bytes("fp16", shapes[head], itemsize)  # the tied head's FBGEMM-packed copy
    return total
