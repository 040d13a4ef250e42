"""--reasoning-parser end to end with a model that really closes its thinking (issue 26).

The random tiny model never writes </think>, so its replies are all reasoning. This
checkpoint's weights spell THINKING + "</think>" + ANSWER after the reasoning template's
open <think> (tests/scripted_model.py: a bigram table in the weights; "</think>" is an
added token as in Qwen3, and the JSON answer one token so a bigram can spell it). The
oracle is the script itself: every dialect, streamed or not, with or without tools, and
under a json_schema, must put exactly THINKING in its reasoning field and exactly ANSWER
in its answer. Under json_schema the thinking is free text no JSON grammar admits, so it
comes back whole only if the grammar starts after </think>; the answer must validate.
"""
from __future__ import annotations

import json

import jsonschema
import pytest
import requests

from ferroxmp.tiny_model import REASONING_CHAT_TEMPLATE
from scripted_model import build_scripted_model
from serverproc import serving

THINKING = "The user means Paris."
ANSWER = '{"city":"Paris"}'
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
          "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}}}}}]
MSGS = [{"role": "user", "content": "Which city?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path, _ = build_scripted_model(str(tmp_path_factory.mktemp("think") / "scripted-think"),
                                   script=THINKING + "</think>" + ANSWER, markup=["</think>", ANSWER],
                                   chat_template=REASONING_CHAT_TEMPLATE,
                                   prompt_tail="<|im_start|>assistant\n<think>\n")
    with serving(path, "--served-model-name", "think", "--reasoning-parser", "qwen3") as s:
        yield s


def _chat(server, stream: bool, **extra) -> tuple[str, str, list]:
    body = {"messages": MSGS, "max_tokens": 64, "temperature": 0, **extra}
    r = requests.post(server.url + "/v1/chat/completions", json={**body, "stream": stream}, stream=stream,
                      timeout=60)
    assert r.status_code == 200, r.text
    if not stream:
        msg = r.json()["choices"][0]["message"]
        return msg.get("reasoning_content") or "", msg["content"] or "", msg.get("tool_calls") or []
    deltas = [json.loads(x[6:])["choices"][0]["delta"] for x in r.iter_lines(decode_unicode=True)
              if x.startswith("data: {") and '"choices": []' not in x]
    return ("".join(d.get("reasoning_content") or "" for d in deltas),
            "".join(d.get("content") or "" for d in deltas), [c for d in deltas for c in d.get("tool_calls") or []])


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("case", ["plain", "tools", "json_schema"])
def test_chat_splits_what_the_model_thought_from_what_it_answered(server, stream, case):
    extra = {"tools": TOOLS} if case == "tools" else {}
    if case == "json_schema":
        extra = {"response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}}}
    reasoning, content, calls = _chat(server, stream, **extra)
    assert reasoning == THINKING, "the thinking was cut, constrained or leaked into the answer"
    assert content == ANSWER and calls == []
    jsonschema.validate(json.loads(content), SCHEMA)


@pytest.mark.parametrize("stream", [False, True])
def test_messages_and_responses_give_a_thinking_block_and_a_reasoning_item(server, stream):
    body = {"model": "think", "max_tokens": 64, "messages": MSGS, "temperature": 0, "stream": stream}
    r = requests.post(server.url + "/v1/messages", json=body, stream=stream, timeout=60)
    assert r.status_code == 200, r.text
    if stream:
        events = [json.loads(x[6:]) for x in r.iter_lines(decode_unicode=True) if x.startswith("data: ")]
        deltas = [e["delta"] for e in events if e["type"] == "content_block_delta"]
        assert "".join(d["thinking"] for d in deltas if d["type"] == "thinking_delta") == THINKING
        assert "".join(d["text"] for d in deltas if d["type"] == "text_delta") == ANSWER
    else:
        content = r.json()["content"]
        assert [(b["type"], b.get("thinking", b.get("text"))) for b in content] == \
            [("thinking", THINKING), ("text", ANSWER)]
    body = {"model": "think", "input": MSGS, "max_output_tokens": 64, "temperature": 0, "stream": stream}
    r = requests.post(server.url + "/v1/responses", json=body, stream=stream, timeout=60)
    assert r.status_code == 200, r.text
    if stream:
        events = [json.loads(x[6:]) for x in r.iter_lines(decode_unicode=True) if x.startswith("data: ")]
        output = next(e for e in events if e["type"] == "response.completed")["response"]["output"]
    else:
        output = r.json()["output"]
    assert [o["type"] for o in output] == ["reasoning", "message"]
    assert output[0]["content"][0]["text"] == THINKING
    assert output[1]["content"][0]["text"] == ANSWER
