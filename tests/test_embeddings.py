"""POST /v1/embeddings: prefill-only rows through the real scheduler, against transformers.

The oracle is transformers' own forward of the same checkpoint in float32:
`last_hidden_state` (after the final norm), pooled as the checkpoint says, L2-normalized.
One module-scoped server serves a tiny Qwen3 checkpoint dressed as a decoder embedding
model (sentence-transformers modules.json + 1_Pooling/config.json asking for the last
token, as Qwen3-Embedding's does); mean and CLS pooling are checked on the worker itself
(RunnerHarness), chunked, against the same oracle.
"""
from __future__ import annotations

import base64
import os

import numpy as np
import pytest
import requests

from ferroxmp.frontend.openai.embeddings import resolve_pooling
from ferroxmp.protocol import RowStep, SamplingParams
from ferroxmp.tiny_model import make_embedding_variant, write_pooling_config
from serverproc import pages_leaked, serving

FLAGS = ("--page-size", "4", "--kv-pages", "1024", "--max-running-requests", "8", "--dtype", "float32",
         "--max-batch-tokens", "32")
TEXTS = ["The quick brown fox jumps over the lazy dog.",
         "def add(a, b):\n    return a + b\n",
         "A much longer passage, long enough to be prefilled in several chunks of at most thirty-two "
         "tokens each, so the vector comes from the last chunk's last position, not the first chunk's."]


@pytest.fixture(scope="module")
def embed_model(tiny_models, tmp_path_factory) -> str:
    return make_embedding_variant(tiny_models["qwen3"], str(tmp_path_factory.mktemp("embed") / "qwen3-embed"))


@pytest.fixture(scope="module")
def server(embed_model):
    with serving(embed_model, "--served-model-name", "embed", *FLAGS) as s:
        yield s


def _oracle(path: str, ids_list: list[list[int]], mode: str = "last") -> list[np.ndarray]:
    import torch
    from transformers import AutoModel
    model = AutoModel.from_pretrained(path, torch_dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for ids in ids_list:
            h = model(torch.tensor([ids])).last_hidden_state[0]
            v = {"last": h[-1], "mean": h.mean(0), "cls": h[0]}[mode].numpy()
            out.append(v / np.linalg.norm(v))
    return out


def _ids(url: str, text: str) -> list[int]:
    return requests.post(url + "/tokenize", json={"prompt": text}).json()["tokens"]


def _cos(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def test_the_openai_sdk_gets_last_token_embeddings_equal_to_transformers(server, embed_model):
    """Pins the whole path (prefill-only rows, chunked; the final norm; last-token pooling
    read from modules.json): a missing norm, a wrong position or a mean would fall far
    below cosine 0.9999 on random weights. The SDK asks for base64 by default."""
    from openai import OpenAI
    client = OpenAI(base_url=server.url + "/v1", api_key="x")
    res = client.embeddings.create(model="embed", input=TEXTS)
    ids = [_ids(server.url, t) for t in TEXTS]
    assert len(ids[2]) > 64  # several chunks of --max-batch-tokens 32
    want = _oracle(embed_model, ids)
    assert [d.index for d in res.data] == [0, 1, 2]
    for d, w in zip(res.data, want):
        assert abs(np.linalg.norm(d.embedding) - 1) < 1e-5
        assert _cos(d.embedding, w) >= 0.9999
    assert res.usage.prompt_tokens == sum(map(len, ids)) == res.usage.total_tokens
    floats = client.embeddings.create(model="embed", input=TEXTS[0], encoding_format="float")
    np.testing.assert_allclose(floats.data[0].embedding, res.data[0].embedding, atol=1e-5)


def test_token_id_inputs_and_dimensions_truncate_then_renormalize(server, embed_model):
    """`dimensions` must keep the first d components of the unnormalized vector and
    renormalize: normalizing before truncating gives a vector of norm < 1, and a wrong
    slice a low cosine."""
    ids = _ids(server.url, TEXTS[1])
    r = requests.post(server.url + "/v1/embeddings", json={"input": [ids, ids[:5]], "dimensions": 16})
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    for d, w in zip(data, _oracle(embed_model, [ids, ids[:5]])):
        v = np.asarray(d["embedding"])
        assert len(v) == 16 and abs(np.linalg.norm(v) - 1) < 1e-5
        assert _cos(v, w[:16]) >= 0.9999
    b = requests.post(server.url + "/v1/embeddings", json={"input": ids, "encoding_format": "base64"}).json()
    v = np.frombuffer(base64.b64decode(b["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(v, _oracle(embed_model, [ids])[0], atol=2e-4)


def test_a_repeated_input_hits_the_cache_gives_the_same_vector_and_holds_no_pages(server):
    """Embedding rows publish their prefix like any row (a later chat request on the same
    text adopts it) and end holding nothing: the accounting invariant must hold when idle."""
    text = TEXTS[2] + " again"
    a = requests.post(server.url + "/v1/embeddings", json={"input": text}).json()["data"][0]["embedding"]
    b = requests.post(server.url + "/v1/embeddings", json={"input": text}).json()["data"][0]["embedding"]
    assert _cos(a, b) >= 0.99999
    gen = requests.post(server.url + "/v1/completions",
                        json={"prompt": text, "max_tokens": 1, "temperature": 0}).json()
    assert gen["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert pages_leaked(server.url) == 0


def test_the_frontend_and_supervisor_serve_without_numpy(server):
    """numpy is ~10 MB resident a process (issue 30's memory target): after a chat stream,
    a completion and embeddings in both encodings, the frontend and the supervisor must
    still not have its library mapped (a request-time import would put it back)."""
    ids = _ids(server.url, TEXTS[0])
    for body in ({"input": TEXTS[0]}, {"input": [ids], "encoding_format": "base64", "dimensions": 8}):
        assert requests.post(server.url + "/v1/embeddings", json=body).status_code == 200
    r = requests.post(server.url + "/v1/chat/completions", stream=True, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True})
    assert r.status_code == 200 and b"[DONE]" in r.content
    assert requests.post(server.url + "/v1/completions", json={"prompt": ids, "max_tokens": 2}).status_code == 200
    procs = server.info["processes"]
    for name in ("frontend", "supervisor", "scheduler"):
        with open(f"/proc/{procs[name]}/maps") as f:
            has_numpy = "_multiarray_umath" in f.read()
        assert has_numpy == (name == "scheduler"), name  # the scheduler's page table is numpy


@pytest.mark.parametrize("body,param", [
    ({"input": "x", "pooling": "mean"}, "pooling"),
    ({}, "input"),
    ({"input": []}, "input"),
    ({"input": ["ok", ""]}, "input[1]"),
    ({"input": [1, -1]}, "input"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "x", "dimensions": 100000}, "dimensions"),
    ({"input": "x", "dimensions": 0}, "dimensions"),
    ({"input": "too long"}, "input"),
])
def test_bad_embedding_requests_get_a_400_naming_the_field(server, body, param):
    """Each bad field must be refused with OpenAI's error shape naming it, not computed."""
    if body == {"input": "too long"}:  # a whole context of tokens: no room for the row's one step
        body = {"input": [5] * server.info["worker_info"]["max_model_len"]}
    r = requests.post(server.url + "/v1/embeddings", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


@pytest.mark.parametrize("mode", ["mean", "cls", "last"])
def test_the_worker_pools_chunked_prompts_like_transformers(make_harness, tiny_models, mode):
    """Pooling inside the worker over a prompt prefilled in 3 chunks: a mean that forgot a
    chunk, or divided by the wrong count, or a CLS taken from a later chunk, fails the
    cosine bound against transformers' full forward."""
    path = tiny_models["qwen3"]
    h = make_harness(path, dtype="float32")
    ids = list(range(5, 47))
    p = SamplingParams(max_tokens=1, temperature=0.0, pooling=mode)
    res = [h.run([h.new_row(0, ids, p)], [RowStep(0, 0, 16, False)]),
           h.run([], [RowStep(0, 16, 16, False)]),
           h.run([], [RowStep(0, 32, len(ids) - 32, True)])]
    assert not res[0].embeddings and not res[1].embeddings
    v = np.frombuffer(res[2].embeddings[0], dtype="<f4")
    assert _cos(v, _oracle(path, [ids], mode)[0]) >= 0.9999


def test_pooling_comes_from_the_flag_then_the_checkpoint_then_last(tmp_path):
    """--pooling wins; else a sentence-transformers Pooling config; else last token."""
    path = str(tmp_path)
    assert resolve_pooling(path) == "last"
    write_pooling_config(path, "mean")
    assert resolve_pooling(path) == "mean"
    assert resolve_pooling(path, "cls") == "cls"
    assert resolve_pooling(os.path.join(path, "model.gguf")) == "last"
