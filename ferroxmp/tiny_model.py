"""Random-weight Hugging Face checkpoints with a real (locally trained) tokenizer.

Job: write a checkpoint folder that `transformers` and ferroxmp's loader both read
(config.json, model.safetensors, generation_config.json, tokenizer.json,
tokenizer_config.json, chat_template.jinja) without touching the network.

Invariants:
- Deterministic: the same (shape, seed) on the same Python gives the same bytes. The
  tokenizer is a byte-level BPE trained on this interpreter's stdlib sources (present on
  every machine), so any UTF-8 text round-trips.
- Special tokens are ids 0..2: <|endoftext|>, <|im_start|>, <|im_end|>; EOS ids are
  im_end and endoftext.
- Weights use std 1/sqrt(fan_in) (embeddings std 1) so every layer moves the residual
  stream as much as the embedding does: greedy output depends on the context and is not
  one repeated token, and argmax ties are vanishingly unlikely.
- No transformers import: `ferroxmp serve` builds its demo model with this module.
"""
from __future__ import annotations

import functools
import glob
import json
import os
import shutil
import sysconfig
import tempfile
import zlib
from typing import Optional

import torch
from safetensors.torch import save_file

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ENDOFTEXT, IM_START, IM_END = 0, 1, 2
EOS_TOKEN_IDS = [IM_END, ENDOFTEXT]
DEMO_VERSION = "demo-v1"
PRETOKENIZE_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                     r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['content'] is string -%}{%- set text = message['content'] -%}"
    "{%- else -%}{%- set text = message['content'] | selectattr('type', 'equalto', 'text')"
    " | map(attribute='text') | join('') -%}{%- endif -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + text + '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)

_TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=128, max_position_embeddings=4096, dtype="float32", vocab=1000)

# shape -> (architecture, model_type, overrides on _TINY)
SHAPES: dict[str, tuple[str, str, dict]] = {
    "llama": ("LlamaForCausalLM", "llama", dict(
        rope_theta=10000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 512})),
    "qwen2": ("Qwen2ForCausalLM", "qwen2", dict(tie_word_embeddings=True, rope_theta=1000000.0)),
    "qwen3": ("Qwen3ForCausalLM", "qwen3", dict(head_dim=32, rope_theta=1000000.0)),
    "mistral": ("MistralForCausalLM", "mistral", dict(sliding_window=64, rope_theta=10000.0)),
    "smol-135m": ("LlamaForCausalLM", "llama", dict(
        hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
        intermediate_size=1536, max_position_embeddings=8192, dtype="bfloat16", vocab=8192,
        rope_theta=100000.0)),
    "demo": ("LlamaForCausalLM", "llama", dict(
        hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
        intermediate_size=512, vocab=2048, rope_theta=10000.0)),
}
TINY_SHAPES = ("llama", "qwen2", "qwen3", "mistral")


def _training_text(max_bytes: int = 3_000_000) -> list[str]:
    """Stdlib sources in sorted order: local, deterministic, plenty of English prose."""
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
    texts, total = [], 0
    for path in files:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
        texts.append(text)
        total += len(text)
        if total >= max_bytes:
            break
    if not texts:  # a stripped interpreter: fall back to our own sources
        texts = [open(p, encoding="utf-8").read()
                 for p in sorted(glob.glob(os.path.join(os.path.dirname(__file__), "**", "*.py"),
                                           recursive=True))]
    return texts


@functools.lru_cache(maxsize=4)
def train_tokenizer(vocab_size: int) -> str:
    """A byte-level BPE tokenizer as tokenizer.json text (cached per process)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    # The Qwen2-style pipeline (NFC, split digits, byte level): transformers' Qwen2Tokenizer
    # rebuilds exactly this pipeline from the vocab, so every loader agrees on the ids.
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  min_frequency=2, show_progress=False)
    tok.train_from_iterator(_training_text(), trainer=trainer)
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == [ENDOFTEXT, IM_START, IM_END]
    return tok.to_str()


def _config(shape: str, vocab_size: int) -> dict:
    arch, model_type, over = SHAPES[shape]
    p = {**_TINY, **over}
    cfg = {
        "architectures": [arch], "model_type": model_type,
        "hidden_size": p["hidden_size"], "num_hidden_layers": p["num_hidden_layers"],
        "num_attention_heads": p["num_attention_heads"],
        "num_key_value_heads": p["num_key_value_heads"],
        "intermediate_size": p["intermediate_size"],
        "max_position_embeddings": p["max_position_embeddings"],
        "vocab_size": vocab_size, "hidden_act": "silu", "rms_norm_eps": 1e-6,
        "rope_theta": p["rope_theta"], "tie_word_embeddings": p.get("tie_word_embeddings", False),
        "torch_dtype": p["dtype"], "bos_token_id": ENDOFTEXT, "eos_token_id": EOS_TOKEN_IDS,
        "pad_token_id": ENDOFTEXT, "attention_bias": False, "use_cache": True,
    }
    if "rope_scaling" in p:
        cfg["rope_scaling"] = p["rope_scaling"]
    if "head_dim" in p:
        cfg["head_dim"] = p["head_dim"]
    if model_type == "mistral":
        cfg["sliding_window"] = p["sliding_window"]
    if model_type == "qwen2":
        cfg.update(use_sliding_window=False, sliding_window=None, max_window_layers=p["num_hidden_layers"])
    if model_type == "qwen3":
        cfg.update(use_sliding_window=False, sliding_window=None)
    return cfg


def _weights(shape: str, cfg: dict, seed: int) -> dict[str, torch.Tensor]:
    # Mix the shape into the seed so shapes with equal tensor sizes differ.
    g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(shape.encode()))
    h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = cfg.get("head_dim", h // cfg["num_attention_heads"])
    q_out, kv_out = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    dtype = getattr(torch, cfg["torch_dtype"])

    def rand(*shape: int, std: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * std).to(dtype)

    def linear(out_f: int, in_f: int, gain: float = 1.0) -> torch.Tensor:
        return rand(out_f, in_f, std=gain * in_f ** -0.5)

    def norm(n: int) -> torch.Tensor:
        return (1.0 + torch.randn(n, generator=g) * 0.1).to(dtype)

    if cfg["tie_word_embeddings"]:
        # A tied lm_head reads the embedding: rows of equal norm so no token wins for
        # its norm alone, small so logits stay ~N(0, 1), and a larger gain on the layers
        # that write the residual stream so each token's self-similarity does not win.
        e = torch.randn(v, h, generator=g)
        embed, gain = (e / e.norm(dim=1, keepdim=True)).to(dtype), 4.0
    else:
        embed, gain = rand(v, h, std=1.0), 1.0
    w = {"model.embed_tokens.weight": embed}
    for i in range(cfg["num_hidden_layers"]):
        pre = f"model.layers.{i}."
        w[pre + "input_layernorm.weight"] = norm(h)
        w[pre + "post_attention_layernorm.weight"] = norm(h)
        for name, out_f in (("q_proj", q_out), ("k_proj", kv_out), ("v_proj", kv_out)):
            w[pre + f"self_attn.{name}.weight"] = linear(out_f, h)
            if cfg["model_type"] == "qwen2":
                w[pre + f"self_attn.{name}.bias"] = rand(out_f, std=0.1)
        w[pre + "self_attn.o_proj.weight"] = linear(h, q_out, gain)
        if cfg["model_type"] == "qwen3":
            w[pre + "self_attn.q_norm.weight"] = norm(hd)
            w[pre + "self_attn.k_norm.weight"] = norm(hd)
        w[pre + "mlp.gate_proj.weight"] = linear(inter, h)
        w[pre + "mlp.up_proj.weight"] = linear(inter, h)
        w[pre + "mlp.down_proj.weight"] = linear(h, inter, gain)
    w["model.norm.weight"] = norm(h)
    if not cfg["tie_word_embeddings"]:
        w["lm_head.weight"] = linear(v, h)
    return w


def _write_json(path: str, obj: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")


def build_model(shape: str, out_dir: str, seed: int = 0, dtype: Optional[str] = None) -> str:
    """Write a random-weight checkpoint of `shape` into `out_dir`; returns `out_dir`.
    `dtype` overrides the shape's own (the same draw, cast: benchmarks on CPUs without
    native bf16 matmul run the smol-135m shape in float32)."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; choose one of {sorted(SHAPES)}")
    vocab_target = {**_TINY, **SHAPES[shape][2]}["vocab"]
    tok_json = train_tokenizer(vocab_target)
    vocab_size = len(json.loads(tok_json)["model"]["vocab"])
    vocab_size = max(vocab_size, len(SPECIAL_TOKENS))
    cfg = _config(shape, vocab_size)
    if dtype is not None:
        cfg["torch_dtype"] = dtype
    os.makedirs(out_dir, exist_ok=True)
    _write_json(os.path.join(out_dir, "config.json"), cfg)
    save_file(_weights(shape, cfg, seed), os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    _write_json(os.path.join(out_dir, "generation_config.json"), {
        "bos_token_id": ENDOFTEXT, "eos_token_id": EOS_TOKEN_IDS, "pad_token_id": ENDOFTEXT})
    with open(os.path.join(out_dir, "tokenizer.json"), "w", encoding="utf-8") as f:
        f.write(tok_json)
    _write_json(os.path.join(out_dir, "tokenizer_config.json"), {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None,
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": None,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "model_max_length": cfg["max_position_embeddings"], "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE})
    with open(os.path.join(out_dir, "chat_template.jinja"), "w", encoding="utf-8") as f:
        f.write(CHAT_TEMPLATE)
    return out_dir


# A reasoning model's template (Qwen3-style): the reply opens a think block, unless
# chat_template_kwargs says enable_thinking: false, which closes it empty.
REASONING_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') + '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}{{ '<think>\\n\\n</think>\\n\\n' }}"
    "{%- else -%}{{ '<think>\\n' }}{%- endif -%}{%- endif -%}")


def make_reasoning_variant(src: str, out_dir: str) -> str:
    """A copy of the checkpoint `src` with REASONING_CHAT_TEMPLATE (chat_template.jinja wins)."""
    shutil.copytree(src, out_dir)
    with open(os.path.join(out_dir, "chat_template.jinja"), "w", encoding="utf-8") as f:
        f.write(REASONING_CHAT_TEMPLATE)
    return out_dir


def make_embedding_variant(src: str, out_dir: str, pooling: str = "last") -> str:
    """A copy of `src` dressed as a sentence-transformers embedding checkpoint (as
    Qwen3-Embedding is): modules.json + 1_Pooling/config.json asking for `pooling`
    ("last", "mean" or "cls")."""
    if out_dir != src:
        shutil.copytree(src, out_dir)
    write_pooling_config(out_dir, pooling)
    return out_dir


def write_pooling_config(path: str, pooling: str) -> None:
    _write_json(os.path.join(path, "modules.json"), [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}])
    os.makedirs(os.path.join(path, "1_Pooling"), exist_ok=True)
    _write_json(os.path.join(path, "1_Pooling", "config.json"), {
        "pooling_mode_cls_token": pooling == "cls", "pooling_mode_mean_tokens": pooling == "mean",
        "pooling_mode_lasttoken": pooling == "last"})


def cache_dir() -> str:
    return os.environ.get("FERROXMP_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "ferroxmp")


def ensure_demo_model() -> str:
    """The demo checkpoint, built once; concurrent callers never see a half-written folder
    (build into a temp dir in the same filesystem, then rename)."""
    root = cache_dir()
    final = os.path.join(root, DEMO_VERSION)
    if os.path.isfile(os.path.join(final, "model.safetensors")):
        return final
    os.makedirs(root, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=DEMO_VERSION + ".tmp-", dir=root)
    try:
        build_model("demo", tmp, seed=0)
        try:
            os.rename(tmp, final)
        except OSError:  # another process won the race: keep its copy
            if not os.path.isfile(os.path.join(final, "model.safetensors")):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
