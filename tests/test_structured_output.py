"""Structured output through the whole server: response_format (json_object,
json_schema), regex and ebnf, on a random-weight tiny checkpoint.

Oracles: jsonschema (and json.loads) on what comes back, `re.fullmatch` for regex and
EBNF, the unconstrained request run alone for the one that shares batches with
constrained ones, and the openai SDK's own parser for `beta.chat.completions.parse`.
Random weights know no JSON: only the mask can make these pass, and finish_reason
must be "stop" (EOS where the grammar accepts), never "length".
"""
from __future__ import annotations

import json
import time
import re
from concurrent.futures import ThreadPoolExecutor

import openai
import pydantic
import pytest
import requests

from serverproc import ServerProcess, serving

jsonschema = pytest.importorskip("jsonschema")
pytestmark = pytest.mark.timeout(300)

FLAGS = ("--page-size", "4", "--kv-pages", "4096", "--max-running-requests", "16")
SCHEMA = {"type": "object",
          "properties": {"city": {"type": "string", "maxLength": 8},
                         "population": {"type": "integer", "minimum": 0, "maximum": 10 ** 7},
                         "rivers": {"type": "array", "items": {"enum": ["Seine", "Loire", "Rhone"]},
                                    "maxItems": 3},
                         "capital": {"type": "boolean"}},
          "required": ["city", "population", "rivers", "capital"], "additionalProperties": False}
RF = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}
CHAT = {"model": "llama", "messages": [{"role": "user", "content": "Describe a city as JSON."}], "max_tokens": 1500}


@pytest.fixture(scope="module")
def srv(tiny_models):
    with serving(tiny_models["llama"], *FLAGS) as s:
        yield s


def post(srv, path, body):
    return requests.post(srv.url + path, json=body, headers=srv.headers, timeout=240)


@pytest.mark.parametrize("temperature,seed", [(0.0, None), (1.0, 1), (1.0, 2), (1.0, 3)])
def test_chat_json_schema_output_always_validates_and_stops(srv, temperature, seed):
    """Greedy and sampled: every choice (n=2, one matcher per row) parses, validates and
    ends with EOS, not by running out of tokens."""
    r = post(srv, "/v1/chat/completions", {**CHAT, "response_format": RF, "temperature": temperature,
                                          "seed": seed, "n": 2})
    assert r.status_code == 200, r.text
    for ch in r.json()["choices"]:
        assert ch["finish_reason"] == "stop", ch
        jsonschema.validate(json.loads(ch["message"]["content"]), SCHEMA)


def test_completions_json_object_is_a_json_object(srv, tiny_models):
    """json_object: any object, on the completions endpoint too. Random weights would
    wander through an unbounded object for thousands of tokens, so a logit_bias (+4 on
    tokens holding a quote or a closing brace) shortens it; the grammar decides where
    they may appear."""
    from ferroxmp.frontend.text.tokenizer import TextCodec
    codec = TextCodec(tiny_models["llama"])
    bias = {str(t): 4 for t in range(codec.vocab_size)
            if not codec.is_special(t) and set(codec.token_text(t)) & set('"}')}
    r = post(srv, "/v1/completions", {"model": "llama", "prompt": "{", "max_tokens": 1500, "temperature": 1.0,
                                      "seed": 5, "n": 2, "logit_bias": bias,
                                      "response_format": {"type": "json_object"}})
    assert r.status_code == 200, r.text
    for ch in r.json()["choices"]:
        assert ch["finish_reason"] == "stop", ch
        assert isinstance(json.loads(ch["text"]), dict)


@pytest.mark.parametrize("field,spec,pattern", [
    ("regex", r"[A-Z][a-z]{1,5} (is|was) [0-9]{1,3}", r"[A-Z][a-z]{1,5} (is|was) [0-9]{1,3}"),
    ("ebnf", 'root ::= "answer: " ("yes" | "no") "."', r"answer: (yes|no)\."),
])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_regex_and_ebnf_constrain_completions(srv, field, spec, pattern, temperature):
    r = post(srv, "/v1/completions", {"model": "llama", "prompt": "x", "max_tokens": 200, "temperature": temperature,
                                      "seed": 9, field: spec})
    assert r.status_code == 200, r.text
    ch = r.json()["choices"][0]
    assert ch["finish_reason"] == "stop" and re.fullmatch(pattern, ch["text"]), ch


def test_streamed_json_schema_deltas_join_into_valid_json(srv):
    with requests.post(srv.url + "/v1/chat/completions", json={**CHAT, "response_format": RF, "stream": True,
                                                              "temperature": 1.0, "seed": 4},
                       headers=srv.headers, stream=True, timeout=240) as r:
        assert r.status_code == 200
        text, reason = "", None
        for line in r.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            ch = json.loads(line[6:])["choices"][0]
            text += ch["delta"].get("content") or ""
            reason = ch.get("finish_reason") or reason
    assert reason == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)


def test_unconstrained_requests_sharing_batches_with_constrained_ones_are_unchanged(srv):
    """The mask is per row: a plain greedy request must give the same text whether or not
    constrained rows share its batches."""
    plain = {"model": "llama", "prompt": "The river bends", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    alone = post(srv, "/v1/completions", plain).json()["choices"][0]["text"]
    with ThreadPoolExecutor(6) as ex:
        futs = [ex.submit(post, srv, "/v1/chat/completions", {**CHAT, "response_format": RF, "temperature": 1.0,
                                                              "seed": s}) for s in range(4)]
        mixed = [ex.submit(post, srv, "/v1/completions", plain) for _ in range(2)]
        for f in futs:
            ch = f.result().json()["choices"][0]
            jsonschema.validate(json.loads(ch["message"]["content"]), SCHEMA)
        assert [m.result().json()["choices"][0]["text"] for m in mixed] == [alone, alone]


@pytest.mark.parametrize("change,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}}, "response_format.json_schema.name"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"regex": "(unclosed"}, "regex"),
    ({"ebnf": "root ::= undefined_rule"}, "ebnf"),
    ({"regex": "a", "ebnf": 'root ::= "a"'}, "ebnf"),
    ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos"),
])
def test_an_invalid_grammar_is_a_400_naming_it(srv, change, param):
    r = post(srv, "/v1/chat/completions", {**CHAT, **change})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=10)
    founded: int = pydantic.Field(ge=0, le=3000)
    coastal: bool


def test_the_openai_sdk_parse_helper_returns_a_parsed_object(srv):
    """`beta.chat.completions.parse(response_format=<pydantic model>)` sends a strict
    json_schema and parses the content with the model: it must come back parsed."""
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key=srv.headers.get("Authorization", "Bearer x")[7:],
                           max_retries=0)
    out = client.beta.chat.completions.parse(model="llama", messages=CHAT["messages"], response_format=City,
                                             max_tokens=1500, temperature=1.0, seed=3)
    parsed = out.choices[0].message.parsed
    assert out.choices[0].finish_reason == "stop"
    assert isinstance(parsed, City)


def test_constrained_rows_survive_retraction_unchanged(tiny_models):
    """A pool far too small for 12 concurrent rows forces retractions: a retracted row
    comes back as prompt + generated and its matcher is rebuilt by replaying them. Its
    output must equal its solo run (the draw is a function of seed and position) and
    still validate and stop."""
    s = ServerProcess(tiny_models["llama"], "--page-size", "4", "--kv-pages", "48", "--max-running-requests", "12")
    try:
        body = {"model": "llama", "prompt": "x", "max_tokens": 180, "temperature": 1.0, "response_format": RF}
        solo = [post(s, "/v1/completions", {**body, "seed": i}).json()["choices"][0]["text"] for i in range(3)]
        with ThreadPoolExecutor(12) as ex:
            outs = list(ex.map(lambda i: post(s, "/v1/completions", {**body, "seed": i}), range(12)))
        for i, r in enumerate(outs):
            assert r.status_code == 200, r.text
            ch = r.json()["choices"][0]
            assert ch["finish_reason"] == "stop", ch
            jsonschema.validate(json.loads(ch["text"]), SCHEMA)
            if i < 3:
                assert ch["text"] == solo[i], f"request {i} changed by retraction"
        time.sleep(1.1)  # counters ride the scheduler's 0.5 s heartbeat: wait for one sent after the run
        stats = requests.get(s.url + "/stats", headers=s.headers, timeout=30).json()
        assert stats["retractions"] > 0, "the pool was never exhausted: this test proved nothing"
    finally:
        s.stop()
    assert not s.leftovers()
