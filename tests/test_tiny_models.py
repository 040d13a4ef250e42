"""The tiny checkpoints are real Hugging Face checkpoints: transformers loads them, the
tokenizer round-trips any UTF-8 text and the special tokens, the chat template renders
ChatML, and the builder is deterministic.

The oracle is transformers itself (and the `tokenizers` library): if the folder
layout, config keys or tokenizer files drift, loading or the id comparison fails.
"""
from __future__ import annotations

import filecmp
import json
import os

import pytest
import torch

from ferroxmp.tiny_model import EOS_TOKEN_IDS, IM_END, IM_START, SHAPES, TINY_SHAPES, build_model

transformers = pytest.importorskip("transformers")

TEXTS = ["héllo wörld — 你好 🙂", "def f(x):\n\treturn x ** 2  # 12345\n", "  leading and trailing  ",
         "Ünïcödé\u00a0nbsp and emoji 👩‍👩‍👧 and 𝔘𝔫𝔦"]
ARCH = {s: SHAPES[s][0] for s in TINY_SHAPES}


@pytest.mark.parametrize("shape", TINY_SHAPES)
def test_transformers_loads_each_tiny_checkpoint_in_float32(tiny_models, shape):
    """A missing weight or a misnamed config key shows up as a load error or random
    re-initialisation warning: require the exact class, dtype and a finite forward."""
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_models[shape])
    assert type(model).__name__ == ARCH[shape]
    assert model.dtype == torch.float32
    with torch.no_grad():
        logits = model(torch.tensor([[5, 6, 7, 8]])).logits
    assert logits.shape == (1, 4, model.config.vocab_size)
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("shape", TINY_SHAPES)
def test_the_tokenizer_round_trips_utf8_and_agrees_with_the_tokenizers_library(tiny_models, shape):
    """Byte-level BPE must reproduce any text byte for byte; transformers (whatever class
    it picks for the model type) and the `tokenizers` library must give the same ids, or
    the server and the test oracle would feed the model different prompts."""
    from tokenizers import Tokenizer
    path = tiny_models[shape]
    hf = transformers.AutoTokenizer.from_pretrained(path)
    raw = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    for text in TEXTS:
        ids = hf(text, add_special_tokens=True).input_ids
        assert ids == raw.encode(text).ids
        assert hf.decode(ids) == text
        assert raw.decode(ids) == text


def test_special_tokens_are_single_ids_and_eos_is_im_end_and_endoftext(tiny_models):
    """Special tokens must never be split into bytes, and both EOS ids must be declared
    where loaders look (generation_config.json, tokenizer eos)."""
    path = tiny_models["qwen3"]
    tok = transformers.AutoTokenizer.from_pretrained(path)
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]
    ids = tok("<|im_start|>user\nhi<|im_end|>").input_ids
    assert ids[0] == IM_START and ids[-1] == IM_END
    assert tok.decode(ids, skip_special_tokens=True) == "user\nhi"
    assert tok.eos_token_id == IM_END
    gen = json.load(open(os.path.join(path, "generation_config.json")))
    assert gen["eos_token_id"] == EOS_TOKEN_IDS


def test_the_chat_template_renders_chatml_with_a_generation_prompt(tiny_models):
    """The template in tokenizer_config.json (and chat_template.jinja) must render ChatML
    exactly, including list-of-parts content and the assistant header."""
    tok = transformers.AutoTokenizer.from_pretrained(tiny_models["llama"])
    msgs = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "héllo "}, {"type": "text", "text": "🙂"}]}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n"
                    "<|im_start|>user\nhéllo 🙂<|im_end|>\n<|im_start|>assistant\n")
    no_prompt = tok.apply_chat_template(msgs[:1], tokenize=False, add_generation_prompt=False)
    assert no_prompt == "<|im_start|>system\nBe brief.<|im_end|>\n"
    ids = tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert ids == tok(text).input_ids


def test_greedy_output_of_a_tiny_model_is_not_one_repeated_token(tiny_models):
    """A degenerate random init (one token winning every step) would make every
    equality test against transformers pass trivially."""
    for shape in TINY_SHAPES:
        model = transformers.AutoModelForCausalLM.from_pretrained(tiny_models[shape])
        out = model.generate(torch.tensor([[40, 41, 42, 43, 44]]), max_new_tokens=24, do_sample=False,
                             min_new_tokens=24, pad_token_id=0)
        assert len(set(out[0, 5:].tolist())) >= 6, shape


def test_the_builder_is_deterministic(tmp_path, tiny_models):
    """Same shape and seed, same bytes; another seed, other weights."""
    a = build_model("qwen2", str(tmp_path / "a"), seed=0)
    c = build_model("qwen2", str(tmp_path / "c"), seed=1)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert filecmp.cmp(os.path.join(a, name), os.path.join(tiny_models["qwen2"], name), shallow=False)
    assert not filecmp.cmp(os.path.join(a, "model.safetensors"), os.path.join(c, "model.safetensors"),
                           shallow=False)


def test_the_demo_model_is_built_once_into_the_cache(tmp_path, monkeypatch):
    """ensure_demo_model must leave one complete folder and no temp dirs, and a second
    call must reuse it."""
    from ferroxmp.tiny_model import ensure_demo_model
    monkeypatch.setenv("FERROXMP_CACHE", str(tmp_path))
    path = ensure_demo_model()
    mtime = os.path.getmtime(os.path.join(path, "model.safetensors"))
    assert ensure_demo_model() == path
    assert os.path.getmtime(os.path.join(path, "model.safetensors")) == mtime
    assert os.listdir(tmp_path) == [os.path.basename(path)]
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    assert type(model).__name__ == "LlamaForCausalLM"
