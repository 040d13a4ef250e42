"""POST /v1/responses (+ GET/DELETE) driven by the official openai SDK.

The oracle for text is /v1/chat/completions on the same conversation (greedy): the
Responses API is a translation into the same internal request. Streams are compared
with non-streamed replies, structured output with the pydantic model, tool calls with
their JSON schema, previous_response_id with the same conversation sent whole. One
module-scoped server.
"""
from __future__ import annotations

import json
from typing import Literal

import pytest
import requests
from pydantic import BaseModel

from serverproc import pages_leaked, serving

FLAGS = ("--page-size", "4", "--kv-pages", "2048", "--max-running-requests", "8")
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                          "required": ["city"], "additionalProperties": False}}


class Pick(BaseModel):
    colour: Literal["red", "green", "blue"]
    ok: bool


@pytest.fixture(scope="module")
def server(tiny_models):
    with serving(tiny_models["llama"], "--served-model-name", "tiny", *FLAGS) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI
    return OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)


def _chat(server, messages: list, **kw) -> dict:
    r = requests.post(server.url + "/v1/chat/completions", json={"messages": messages, "temperature": 0, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def test_greedy_output_text_and_usage_equal_chat_completions(server, client):
    """Instructions dropped or misplaced, or a sampling default changed in translation,
    changes the greedy tokens or the prompt count."""
    want = _chat(server, [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Name a colour."}],
                 max_tokens=10)
    r = client.responses.create(model="tiny", instructions="Be terse.", input="Name a colour.",
                                max_output_tokens=10, temperature=0)
    assert r.output_text == want["choices"][0]["message"]["content"]
    assert r.status == ("incomplete" if want["choices"][0]["finish_reason"] == "length" else "completed")
    assert r.usage.input_tokens == want["usage"]["prompt_tokens"]
    assert r.usage.output_tokens == want["usage"]["completion_tokens"]
    assert r.usage.input_tokens_details.cached_tokens > 0  # the chat request published this prefix


def test_a_stream_is_the_typed_event_sequence_and_reassembles_to_the_reply(client):
    """Every event numbered in order; deltas concatenate to the stored text; the SDK's
    stream helper accumulates the same final response."""
    kw = dict(model="tiny", input="Count: one, two", max_output_tokens=16, temperature=0)
    whole = client.responses.create(**kw)
    events = list(client.responses.create(**kw, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert types[-1] == "response.completed"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    with client.responses.stream(**kw) as stream:
        final = stream.get_final_response()
    assert final.output_text == whole.output_text and final.usage.output_tokens == whole.usage.output_tokens


def test_parse_with_a_pydantic_model_returns_a_valid_instance(client):
    """text.format json_schema must reach the shared grammar: unconstrained random
    weights never write JSON that validates."""
    r = client.responses.parse(model="tiny", input="Pick a colour.", text_format=Pick, max_output_tokens=48,
                               temperature=0)
    assert isinstance(r.output_parsed, Pick)
    assert Pick.model_validate_json(r.output_text) == r.output_parsed


def test_a_function_call_round_trip_and_previous_response_id_continue_the_same_conversation(server, client):
    """A forced call's arguments must satisfy the schema, stream as they are stored, and
    a continuation by previous_response_id must equal the same conversation sent whole
    (greedy): a store that lost the call or the output changes the prompt."""
    import jsonschema
    kw = dict(model="tiny", input="Weather in Paris?", tools=[WEATHER], tool_choice="required",
              max_output_tokens=64, temperature=0)
    r = client.responses.create(**kw)
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather"
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["parameters"])
    streamed = list(client.responses.create(**kw, stream=True))
    assert [e.arguments for e in streamed if e.type == "response.function_call_arguments.done"] == \
           [c.arguments for c in calls]
    result = {"type": "function_call_output", "call_id": calls[0].call_id, "output": "18 C, cloudy"}
    cont = client.responses.create(model="tiny", previous_response_id=r.id, input=[result], tools=[WEATHER],
                                   max_output_tokens=8, temperature=0)
    whole = client.responses.create(
        model="tiny", tools=[WEATHER], max_output_tokens=8, temperature=0, store=False,
        input=[{"role": "user", "content": "Weather in Paris?"}]
        + [o.model_dump(exclude_none=True) for o in r.output] + [result])  # every output item, as users send them
    assert cont.output_text == whole.output_text
    assert cont.usage.input_tokens == whole.usage.input_tokens
    assert pages_leaked(server.url) == 0


def test_stored_responses_can_be_read_and_deleted_and_unknown_ids_are_404(server, client):
    """GET returns what POST returned; DELETE removes it; store: false keeps nothing."""
    r = client.responses.create(model="tiny", input="hi", max_output_tokens=3, temperature=0)
    got = client.responses.retrieve(r.id)
    assert got.output_text == r.output_text and got.id == r.id
    client.responses.delete(r.id)
    assert requests.get(f"{server.url}/v1/responses/{r.id}").status_code == 404
    unstored = client.responses.create(model="tiny", input="hi", max_output_tokens=3, store=False)
    assert requests.get(f"{server.url}/v1/responses/{unstored.id}").status_code == 404
    p = requests.post(server.url + "/v1/responses", json={"input": "hi", "previous_response_id": "resp_nope"})
    assert p.status_code == 404 and p.json()["error"]["param"] == "response_id"


@pytest.mark.parametrize("body,param", [
    ({"input": "hi", "include": ["reasoning.encrypted_content"]}, "include"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].type"),
    ({"input": "hi", "text": {"format": {"type": "grammar"}}}, "text.format.type"),
    ({}, "input"),
])
def test_unsupported_response_fields_are_a_400_naming_them(server, body, param):
    r = requests.post(server.url + "/v1/responses", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
