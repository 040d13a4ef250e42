"""POST /v1/messages and /v1/messages/count_tokens, driven by the official anthropic SDK.

The oracle for text is /v1/chat/completions on the same conversation (greedy): the
Messages API is a translation into the same internal request, so any divergence in
the rendered prompt, the sampling or the stop handling changes the tokens. Streamed
replies are compared with non-streamed ones, token counts with /tokenize, tool calls
with the tools' JSON schema. One module-scoped server with --api-key (the SDK sends
x-api-key; OpenAI clients send Authorization).
"""
from __future__ import annotations

import pytest
import requests

from serverproc import pages_leaked, serving

KEY = "sk-anthropic-test"
FLAGS = ("--page-size", "4", "--kv-pages", "2048", "--max-running-requests", "8", "--api-key", KEY)
AUTH = {"Authorization": f"Bearer {KEY}"}
GREEDY = {"temperature": 0}  # the SDK (2.x) no longer has a sampling argument: sent as extra body
SYSTEM = "You are terse."
USER = "Name three colours of the rainbow."
WEATHER = {"name": "get_weather", "description": "Current weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                            "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def server(tiny_models):
    with serving(tiny_models["llama"], "--served-model-name", "tiny", *FLAGS) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    import anthropic
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)


def _chat(server, messages: list, **kw) -> dict:
    r = requests.post(server.url + "/v1/chat/completions", headers=AUTH,
                      json={"messages": messages, "temperature": 0, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def test_greedy_text_and_counts_equal_chat_completions_for_the_same_conversation(server, client):
    """A system prompt dropped, a role mislabelled or a sampling default changed in
    translation changes the greedy tokens or the prompt count."""
    msg = client.messages.create(model="tiny", max_tokens=12, extra_body=GREEDY, system=SYSTEM,
                                 messages=[{"role": "user", "content": USER}])
    want = _chat(server, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}],
                 max_tokens=12)
    assert msg.type == "message" and msg.role == "assistant"
    assert "".join(b.text for b in msg.content if b.type == "text") == want["choices"][0]["message"]["content"]
    assert msg.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[want["choices"][0]["finish_reason"]]
    u = msg.usage
    assert u.input_tokens + u.cache_read_input_tokens == want["usage"]["prompt_tokens"]
    assert u.output_tokens == want["usage"]["completion_tokens"]
    n = client.messages.count_tokens(model="tiny", system=SYSTEM, messages=[{"role": "user", "content": USER}])
    assert n.input_tokens == want["usage"]["prompt_tokens"]


def test_a_stream_reassembles_to_the_non_streamed_message(client):
    """Events out of order, a lost delta or a wrong block index breaks the SDK's
    accumulation: the final message must equal the non-streamed one."""
    kw = dict(model="tiny", max_tokens=16, extra_body=GREEDY, messages=[{"role": "user", "content": "Count: one, two"}])
    whole = client.messages.create(**kw)
    with client.messages.stream(**kw) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    events = [e.type for e in client.messages.create(**kw, stream=True)]
    assert events[:2] == ["message_start", "content_block_start"] and events[-2:] == ["message_delta", "message_stop"]


def test_stop_sequences_end_the_turn_with_the_sequence_named(server, client):
    """The stop string must be trimmed and reported as stop_sequence, like chat's stop."""
    base = client.messages.create(model="tiny", max_tokens=16, extra_body=GREEDY,
                                  messages=[{"role": "user", "content": USER}])
    text = base.content[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    assert stop.strip(), text
    msg = client.messages.create(model="tiny", max_tokens=16, extra_body=GREEDY, stop_sequences=[stop],
                                 messages=[{"role": "user", "content": USER}])
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == stop
    assert msg.content[0].text == text[:text.index(stop)]


def test_a_tool_use_round_trip_matches_the_schema_and_the_chat_rendering(server, client):
    """tool_choice any forces a call through the shared grammar: its input must satisfy
    input_schema; sending it back with a tool_result must render exactly as the
    equivalent OpenAI messages (same count), and streamed calls equal non-streamed."""
    import jsonschema
    kw = dict(model="tiny", max_tokens=64, extra_body=GREEDY, tools=[WEATHER], tool_choice={"type": "any"},
              messages=[{"role": "user", "content": "Weather in Paris?"}])
    msg = client.messages.create(**kw)
    assert msg.stop_reason == "tool_use"
    uses = [b for b in msg.content if b.type == "tool_use"]
    assert uses and uses[0].name == "get_weather"
    jsonschema.validate(uses[0].input, WEATHER["input_schema"])
    with client.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == \
           [(b.name, b.input) for b in uses]
    follow = [{"role": "user", "content": "Weather in Paris?"},
              {"role": "assistant", "content": [{"type": "tool_use", "id": uses[0].id, "name": "get_weather",
                                                 "input": uses[0].input}]},
              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                            "content": "18 C, cloudy"}]}]
    reply = client.messages.create(model="tiny", max_tokens=8, extra_body=GREEDY, tools=[WEATHER], messages=follow)
    assert reply.stop_reason in ("end_turn", "max_tokens", "tool_use")
    import json
    openai_msgs = [{"role": "user", "content": "Weather in Paris?"},
                   {"role": "assistant", "content": None, "tool_calls": [
                       {"id": uses[0].id, "type": "function",
                        "function": {"name": "get_weather", "arguments": json.dumps(uses[0].input)}}]},
                   {"role": "tool", "tool_call_id": uses[0].id, "content": "18 C, cloudy"}]
    tools = [{"type": "function", "function": {"name": "get_weather", "description": WEATHER["description"],
                                               "parameters": WEATHER["input_schema"]}}]
    tok = requests.post(server.url + "/tokenize", headers=AUTH, json={"messages": openai_msgs, "tools": tools}).json()
    assert client.messages.count_tokens(model="tiny", tools=[WEATHER], messages=follow).input_tokens == tok["count"]
    assert pages_leaked(server.url, headers=AUTH) == 0


def test_errors_come_in_anthropic_shape_and_both_key_headers_work(server, client):
    """The SDK maps Anthropic's error shape to its exceptions; a missing max_tokens, an
    image block or a wrong key must each be refused, naming what was wrong."""
    import anthropic
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="tiny", max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}])
    assert "image" in str(e.value)
    r = requests.post(server.url + "/v1/messages", headers={"x-api-key": KEY},
                      json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in r.json()["error"]["message"]
    ok = requests.post(server.url + "/v1/messages", headers=AUTH,
                       json={"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
    assert ok.status_code == 200 and ok.json()["type"] == "message"
    bad = requests.post(server.url + "/v1/messages", headers={"x-api-key": "wrong"},
                        json={"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
    assert bad.status_code == 401 and bad.json()["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model="tiny", max_tokens=4, thinking={"type": "enabled", "budget_tokens": 1024},
                               messages=[{"role": "user", "content": "hi"}])
