"""The loader reads what transformers reads: config flags per architecture, EOS ids,
dtype, sharded weights; and refuses what ferroxmp cannot run with a message that names it.

Oracles: transformers' own config classes (head_dim, rope parameters) and the single-file
checkpoint's tensors (for the sharded load).
"""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from ferroxmp.gpu_worker.kv.pool import KVPool, pages_for_budget
from ferroxmp.gpu_worker.loader import UnsupportedModel, load_config, load_weights, weight_bytes
from ferroxmp.tiny_model import EOS_TOKEN_IDS

transformers = pytest.importorskip("transformers")


def test_each_architecture_gets_its_flags(tiny_models):
    """The four flags that distinguish the architectures must be read, and the geometry
    must agree with transformers' config for the same folder."""
    c = {s: load_config(p) for s, p in tiny_models.items()}
    assert c["llama"].rope_type == "llama3" and c["llama"].rope_scaling["factor"] == 8.0
    assert c["qwen2"].tie_word_embeddings and not c["llama"].tie_word_embeddings
    assert c["qwen3"].qk_norm and c["qwen3"].head_dim == 32 and not c["qwen2"].qk_norm
    assert c["mistral"].sliding_window == 64 and c["qwen2"].sliding_window is None
    for shape, cfg in c.items():
        hf = transformers.AutoConfig.from_pretrained(tiny_models[shape])
        assert cfg.head_dim == getattr(hf, "head_dim", hf.hidden_size // hf.num_attention_heads)
        assert (cfg.num_kv_heads, cfg.vocab_size, cfg.dtype) == (hf.num_key_value_heads, hf.vocab_size, torch.float32)
        assert cfg.eos_token_ids == EOS_TOKEN_IDS
        assert cfg.rope_theta == hf.rope_parameters["rope_theta"]


def _copy(src: str, dst: str, **config_changes) -> str:
    shutil.copytree(src, dst)
    path = os.path.join(dst, "config.json")
    cfg = json.load(open(path))
    cfg.update(config_changes)
    json.dump(cfg, open(path, "w"))
    return dst


def test_an_unsupported_architecture_is_refused_by_name(tiny_models, tmp_path):
    path = _copy(tiny_models["llama"], str(tmp_path / "m"), architectures=["GPT2LMHeadModel"])
    with pytest.raises(UnsupportedModel, match="GPT2LMHeadModel.*LlamaForCausalLM"):
        load_config(path)
    with pytest.raises(UnsupportedModel, match="config.json"):
        load_config(str(tmp_path))


def test_an_unsupported_rope_type_is_refused(tiny_models, tmp_path):
    path = _copy(tiny_models["llama"], str(tmp_path / "m"), rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(UnsupportedModel, match="yarn"):
        load_config(path)


def test_eos_ids_merge_generation_config_and_the_tokenizer_eos(tiny_models, tmp_path):
    """An int eos_token_id in generation_config plus the tokenizer's eos token (im_end=2)."""
    path = _copy(tiny_models["qwen2"], str(tmp_path / "m"), eos_token_id=None)
    json.dump({"eos_token_id": 0}, open(os.path.join(path, "generation_config.json"), "w"))
    assert load_config(path).eos_token_ids == [0, 2]


def test_dtype_comes_from_the_checkpoint_unless_overridden(tiny_models):
    assert load_config(tiny_models["qwen3"]).dtype == torch.float32
    assert load_config(tiny_models["qwen3"], "bfloat16").dtype == torch.bfloat16


def test_sharded_weights_load_like_the_single_file(tiny_models, tmp_path):
    """Split the tensors over two shards with an index, drop the single file: the loaded
    tensors must be the same, by name, bit for bit."""
    src = tiny_models["qwen3"]
    dst = str(tmp_path / "sharded")
    shutil.copytree(src, dst)
    tensors = load_file(os.path.join(dst, "model.safetensors"))
    os.remove(os.path.join(dst, "model.safetensors"))
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for shard, keys in halves.items():
        save_file({k: tensors[k] for k in keys}, os.path.join(dst, shard))
    json.dump({"weight_map": {k: s for s, ks in halves.items() for k in ks}},
              open(os.path.join(dst, "model.safetensors.index.json"), "w"))
    got = load_weights(dst, torch.device("cpu"), torch.float32)
    assert sorted(got) == names
    assert all(torch.equal(got[k], tensors[k]) for k in names)
    assert weight_bytes(dst, torch.bfloat16) == sum(t.numel() for t in tensors.values()) * 2


def test_the_kv_budget_decides_the_page_count(tiny_models):
    """--kv-pages wins; otherwise kv_cache_gb / bytes per page (2 x layers x kv heads x
    head_dim x itemsize x page_size), and the pool tensors are that size."""
    cfg = load_config(tiny_models["llama"])
    cpu = torch.device("cpu")
    assert pages_for_budget(cfg, 16, 77, 2.0, 0.9, cpu) == 77
    per_page = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4 * 16
    n = pages_for_budget(cfg, 16, None, 0.01, 0.9, cpu)
    assert n == int(0.01 * 2**30 // per_page)
    pool = KVPool.for_model(cfg, n, 16, cpu)
    pool.check_integrity()
    assert pool.nbytes == n * per_page
    with pytest.raises(RuntimeError, match="kv-cache-gb"):
        pages_for_budget(cfg, 16, None, 1e-9, 0.9, cpu)
