"""POST /tokenize and /detokenize (vLLM's shapes) on a key-gated server.

Oracles: transformers' tokenizer on the same checkpoint (encode, apply_chat_template,
decode) and the usage a chat completion reports for the same messages.
"""
from __future__ import annotations

import pytest
import requests

from serverproc import serving

transformers = pytest.importorskip("transformers")
KEY = "sk-tokenize-test"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "héllo wörld 🙂 <|im_end|>"}]


@pytest.fixture(scope="module")
def srv(tiny_models):
    with serving(tiny_models["llama"], "--page-size", "4", "--kv-pages", "256", "--api-key", KEY) as s:
        yield s


@pytest.fixture(scope="module")
def hf_tok(tiny_models):
    return transformers.AutoTokenizer.from_pretrained(tiny_models["llama"])


def post(srv, path, body, headers=None):
    return requests.post(srv.url + path, json=body, headers=srv.headers if headers is None else headers, timeout=60)


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_tokenize_a_prompt_equals_the_tokenizer(srv, hf_tok, add_special_tokens):
    text = "The river bends past the mill — 你好 🙂"
    r = post(srv, "/tokenize", {"prompt": text, "add_special_tokens": add_special_tokens, "model": "llama"})
    assert r.status_code == 200, r.text
    want = hf_tok(text, add_special_tokens=add_special_tokens)["input_ids"]
    ctx = requests.get(srv.url + "/v1/models", headers=srv.headers, timeout=30).json()["data"][0]["max_model_len"]
    assert r.json() == {"tokens": want, "count": len(want), "max_model_len": ctx}


def test_tokenize_messages_equals_the_chat_template_and_the_usage(srv, hf_tok):
    r = post(srv, "/tokenize", {"messages": MESSAGES})
    assert r.status_code == 200, r.text
    want = hf_tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert r.json()["tokens"] == list(want)
    usage = post(srv, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1}).json()["usage"]
    assert usage["prompt_tokens"] == r.json()["count"]


def test_detokenize_equals_the_tokenizers_decode(srv, hf_tok):
    ids = hf_tok("a <|im_end|> b ü", add_special_tokens=True)["input_ids"]
    r = post(srv, "/detokenize", {"tokens": ids})
    assert r.status_code == 200, r.text
    assert r.json() == {"prompt": hf_tok.decode(ids, skip_special_tokens=False)}


@pytest.mark.parametrize("path,body,param", [
    ("/tokenize", {"prompt": "x", "temperature": 1}, "temperature"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ("/detokenize", {"tokens": [1, 10 ** 6]}, "tokens"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
    ("/detokenize", {"tokens": [1], "model": "gpt-9"}, "model"),
])
def test_bad_bodies_are_4xx_naming_the_field(srv, path, body, param):
    r = post(srv, path, body)
    assert r.status_code in (400, 404), r.text
    assert r.json()["error"]["param"] == param


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize"])
def test_both_routes_need_the_api_key(srv, path):
    r = post(srv, path, {"prompt": "x", "tokens": [1]}, headers={})
    assert r.status_code == 401, r.text
