"""GGUF checkpoints: a GGUF file written from a tiny HF folder (as llama.cpp's converter
writes it: Q/K permuted, Llama 3 rope as rope_freqs, tokenizer in metadata) serves what
the folder serves.

Oracles: the HF folder itself, served by the same code through its safetensors and
tokenizer.json — exact for F32/F16/BF16 (the GGUF holds the same values), within a
stated logit tolerance for quantized types. The tolerances are checked to separate:
a GGUF whose Q/K rows were never permuted (a converter bug, or a reader that undoes
nothing) lands far outside them.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import requests
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file, save_file

from ferroxmp.checkpoint.gguf_config import GGUFUnsupported, hf_config
from ferroxmp.checkpoint.gguf_file import open_gguf
from ferroxmp.checkpoint.gguf_tokenizer import build_tokenizer
from ferroxmp.frontend.text.tokenizer import TextCodec
from ferroxmp.gpu_worker.loader import UnsupportedModel, load_config, load_weights
from gguf_writer import quantize_q4_k, quantize_q5_k, quantize_q6_k, write_gguf
from serverproc import ServerProcess

pytestmark = pytest.mark.timeout(300)
FLAGS = ("--page-size", "4", "--kv-pages", "512", "--max-running-requests", "8")
# Multilingual, code and whitespace: NFC-composable accents, CJK, emoji, digits, tabs,
# runs of spaces and newlines, contractions, special-token text.
TEXT = ("Ünïcödé: e\u0301 café naïve — 東京都 你好 안녕하세요 🙂👍🏽 ½ 1234567 3.14159\n\n\n"
        "def f(x, *args, **kw):\n\tif x  >=  10:\n\t\treturn x ** 2  # it's   fine\n    \n"
        "  They'll SAY 'WE'RE' done.\r\n\t \t<|im_start|>user\nhi<|im_end|>   \n")
PROMPTS = ["The river bends past the mill", "def add(a, b):\n    return", "héllo wörld — 你好"]


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("gguf")


def folder_in_dtype(src: str, dtype: str, out: str) -> str:
    """A copy of the tiny checkpoint `src` whose weights are stored in `dtype`."""
    if os.path.isdir(out):
        return out
    shutil.copytree(src, out)
    w = load_file(os.path.join(src, "model.safetensors"))
    save_file({k: v.to(getattr(torch, dtype)) for k, v in w.items()}, os.path.join(out, "model.safetensors"),
              metadata={"format": "pt"})
    with open(os.path.join(out, "config.json")) as f:
        cfg = json.load(f)
    cfg["torch_dtype"] = dtype
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f)
    return out


def test_the_k_quant_writers_round_trip_through_gguf_dequantize():
    """The test writer's own Q4_K / Q5_K / Q6_K packers (gguf can only unpack K-quants): a
    packing bug would make every K-quant comparison below meaningless, so pin that
    gguf's dequantizer reads back what was meant, within each format's step size."""
    from gguf.quants import dequantize
    w = np.random.default_rng(0).standard_normal((8, 512)).astype(np.float32)
    for qtype, pack, steps in ((Q.Q4_K, quantize_q4_k, 15), (Q.Q5_K, quantize_q5_k, 31), (Q.Q6_K, quantize_q6_k, 63)):
        back = dequantize(pack(w), qtype)
        step = (w.max() - w.min()) / steps
        assert back.shape == w.shape
        assert np.abs(back - w).max() < step, qtype.name


@pytest.mark.parametrize("shape", ["llama", "qwen2", "qwen3", "mistral"])
def test_an_f32_gguf_loads_the_same_config_and_bits_as_its_folder(tiny_models, gguf_dir, shape):
    """Config (incl. Llama 3 rope parameters recovered from rope_freqs, Mistral's window,
    Qwen2's tied embeddings, Qwen3's head_dim, EOS ids) and every weight bit-identical:
    a missed or doubled Q/K permutation, a wrong name map or a dropped bias fails here."""
    path = write_gguf(tiny_models[shape], str(gguf_dir / f"{shape}-f32.gguf"), Q.F32)
    assert load_config(path) == load_config(tiny_models[shape])
    want = load_weights(tiny_models[shape], torch.device("cpu"), torch.float32)
    got = load_weights(path, torch.device("cpu"), torch.float32)
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert torch.equal(got[name], t), name


def test_a_gguf_written_without_the_qk_permutation_does_not_load_as_its_folder(tiny_models, gguf_dir):
    """The negative control for the permutation: the reader really reorders rows
    (a reader that undid nothing would pass the bit test only if the writer also did nothing)."""
    path = write_gguf(tiny_models["llama"], str(gguf_dir / "llama-unpermuted.gguf"), Q.F32, permute=False)
    got = load_weights(path, torch.device("cpu"), torch.float32)
    want = load_weights(tiny_models["llama"], torch.device("cpu"), torch.float32)
    assert not torch.equal(got["model.layers.0.self_attn.q_proj.weight"], want["model.layers.0.self_attn.q_proj.weight"])
    assert torch.equal(got["model.layers.0.self_attn.v_proj.weight"], want["model.layers.0.self_attn.v_proj.weight"])


def test_the_tokenizer_from_gguf_metadata_encodes_like_tokenizer_json(tiny_models, gguf_dir):
    """Same ids for multilingual, code and whitespace-heavy text, same decode, same chat
    prompt: a wrong pre-tokenizer regex (digits, contractions, newlines), a missing NFC
    normalizer (e + combining accent), or special tokens not marked special would differ."""
    path = write_gguf(tiny_models["qwen3"], str(gguf_dir / "tok.gguf"), Q.F32)
    folder, gguf = TextCodec(tiny_models["qwen3"]), TextCodec(path)
    ids = folder.encode(TEXT)
    assert gguf.encode(TEXT) == ids
    assert gguf.decode(ids, skip_special_tokens=False) == folder.decode(ids, skip_special_tokens=False)
    assert gguf.decode(ids) == folder.decode(ids)
    assert [gguf.token_bytes(i) for i in ids] == [folder.token_bytes(i) for i in ids]
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": TEXT}]
    assert gguf.encode_chat(chat) == folder.encode_chat(chat)
    assert gguf.special_tokens["eos_token"] == folder.special_tokens["eos_token"]


def _greedy(srv: ServerProcess, model: str) -> list:
    """Greedy answers to a few prompts: token ids (native /generate), completion text and
    chat text with their token counts."""
    out = []
    for p in PROMPTS:
        ids = _codec(srv.info["args"]["model"]).encode(p)
        r = requests.post(srv.url + "/generate", json={"input_ids": ids, "sampling_params": {
            "max_tokens": 12, "temperature": 0, "ignore_eos": True}}, timeout=60)
        assert r.status_code == 200, r.text
        out.append(r.json()["output_ids"])
        r = requests.post(srv.url + "/v1/completions", json={
            "model": model, "prompt": p, "max_tokens": 12, "temperature": 0}, timeout=60)
        assert r.status_code == 200, r.text
        out.append((r.json()["choices"][0]["text"], r.json()["usage"]))
        r = requests.post(srv.url + "/v1/chat/completions", json={
            "model": model, "messages": [{"role": "user", "content": p}], "max_tokens": 12, "temperature": 0},
            timeout=60)
        assert r.status_code == 200, r.text
        out.append((r.json()["choices"][0]["message"]["content"], r.json()["usage"]))
    return out


_codecs: dict = {}


def _codec(path: str) -> TextCodec:
    if path not in _codecs:
        _codecs[path] = TextCodec(path)
    return _codecs[path]


@pytest.mark.parametrize("shape,dtype,qtype", [
    ("llama", "float32", Q.F32), ("mistral", "float32", Q.F32),
    ("qwen2", "float16", Q.F16), ("qwen3", "bfloat16", Q.BF16)])
def test_f32_f16_bf16_ggufs_serve_exactly_the_folders_greedy_tokens_over_http(tiny_models, gguf_dir, shape,
                                                                              dtype, qtype):
    """Two real servers, one on the folder (weights stored in `dtype`) and one on the GGUF
    written from it: the same token ids, completion and chat texts and usage. Tokenizer,
    chat template, EOS ids, config and weights all have to agree for this to hold."""
    folder = folder_in_dtype(tiny_models[shape], dtype, str(gguf_dir / f"{shape}-{dtype}"))
    path = write_gguf(folder, str(gguf_dir / f"{shape}-{qtype.name}.gguf"), qtype)
    answers = []
    for model in (folder, path):
        with ServerProcess(model, *FLAGS) as srv:
            name = srv.info.get("model") or requests.get(srv.url + "/v1/models", timeout=10).json()["data"][0]["id"]
            answers.append(_greedy(srv, name))
    assert answers[0] == answers[1]
    assert any(len(a) == 12 for a in answers[0][::3])  # ignore_eos: 12 tokens each


# Relative RMS logit error allowed, ||got - want|| / ||want - mean(want)|| at the last
# position of each prompt, about twice what random-weight tiny models measure (Q8_0 0.015,
# Q6_K 0.065, Q5_0/Q5_1 0.09-0.11, Q5_K 0.12, Q4_x 0.2-0.27 with the writer's plain K-quant packers).
# A file whose Q/K rows are in the wrong order measures 0.27-0.5.
QUANT_TOL = {Q.Q8_0: 0.03, Q.Q6_K: 0.12, Q.Q5_K: 0.25, Q.Q5_1: 0.17, Q.Q5_0: 0.2, Q.Q4_1: 0.35, Q.Q4_0: 0.4, Q.Q4_K: 0.45}


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm(dim=1) / (want - want.mean(dim=1, keepdim=True)).norm(dim=1)).max().item()


def _prefill_logits(make_harness, path: str, prompts: list[list[int]]) -> torch.Tensor:
    h = make_harness(path, max_rows=len(prompts), pages_per_row=16)
    _, logits = h.generate(dict(enumerate(prompts)), 1)
    return torch.stack([logits[r][0].float() for r in range(len(prompts))])


@pytest.mark.parametrize("qtype", list(QUANT_TOL), ids=lambda q: q.name)
def test_a_quantized_gguf_stays_within_the_stated_logit_tolerance_of_its_folder(tiny_models, gguf_dir,
                                                                              make_harness, qtype):
    """Quantized matrices change values, so logits are compared within a per-type bound
    (QUANT_TOL): a wrong block layout, scale or min, or a dequantization into the wrong
    row order lands far outside it. K-quants need rows of 256: the demo shape
    (hidden 256); the others use the tiny llama (rows of 64)."""
    from ferroxmp.tiny_model import build_model
    shape = "demo" if qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K) else "llama"
    folder = tiny_models.get(shape) or build_model(shape, str(gguf_dir / shape))
    tiny_models.setdefault(shape, folder)
    path = write_gguf(folder, str(gguf_dir / f"{shape}-{qtype.name}.gguf"), qtype)
    codec = TextCodec(folder)
    prompts = [codec.encode(p) for p in PROMPTS]
    want = _prefill_logits(make_harness, folder, prompts)
    got = _prefill_logits(make_harness, path, prompts)
    err = _rel_err(got, want)
    assert err < QUANT_TOL[qtype], f"{qtype.name}: relative logit error {err:.4f}"
    if qtype == Q.Q8_0:  # the bound separates: a file with Q/K rows out of order is far outside it
        bad = write_gguf(folder, str(gguf_dir / "llama-Q8_0-unpermuted.gguf"), qtype, permute=False)
        assert _rel_err(_prefill_logits(make_harness, bad, prompts), want) > 5 * QUANT_TOL[qtype]


def _serve_fails(path: str) -> str:
    """`ferroxmp serve --model path`: must exit non-zero at start-up; returns its output."""
    r = subprocess.run([sys.executable, "-m", "ferroxmp.cli", "serve", "--model", path, "--port", "1"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    return r.stdout + r.stderr


def test_an_unsupported_architecture_is_refused_by_name_at_start_up(tiny_models, gguf_dir):
    """general.architecture 'gemma2' is named in one error line and nothing starts."""
    path = write_gguf(tiny_models["qwen2"], str(gguf_dir / "gemma2.gguf"), Q.F32, arch="gemma2")
    with pytest.raises(GGUFUnsupported, match="'gemma2'"):
        hf_config(open_gguf(path))
    out = _serve_fails(path)
    assert "'gemma2' is not supported" in out
    assert "Traceback" not in out
    with pytest.raises(UnsupportedModel, match="gemma2"):
        load_config(path)


def test_an_unsupported_tensor_type_is_refused_by_name_at_start_up(tiny_models, gguf_dir):
    """A tensor in IQ4_NL (a type ferroxmp does not dequantize) is named with its type."""
    raw = np.random.default_rng(1).integers(0, 255, size=(64, 2 * 18), dtype=np.uint8)  # 64x64 in 32-blocks
    path = write_gguf(tiny_models["llama"], str(gguf_dir / "iq4.gguf"), Q.F32,
                      replace={"blk.1.attn_q.weight": (raw, Q.IQ4_NL)})
    with pytest.raises(GGUFUnsupported, match="'blk.1.attn_q.weight' has type IQ4_NL"):
        hf_config(open_gguf(path))
    out = _serve_fails(path)
    assert "IQ4_NL" in out and "blk.1.attn_q.weight" in out
    assert "Traceback" not in out


def test_an_unknown_pre_tokenizer_is_refused_by_name(tiny_models, gguf_dir):
    """A pre-tokenizer ferroxmp has no regex for is named, never replaced by a guess."""
    path = write_gguf(tiny_models["qwen2"], str(gguf_dir / "pre.gguf"), Q.F32, pre="chameleon")
    with pytest.raises(GGUFUnsupported, match="'chameleon'"):
        build_tokenizer(open_gguf(path))
    assert "'chameleon'" in _serve_fails(path)
