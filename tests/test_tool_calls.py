"""Tool calls: `tools` / `tool_choice` / `parallel_tool_calls`, rendered through the chat
template, the reply parsed into `tool_calls` (whole and streamed), `required` and named
choices constrained by the grammar, `role: "tool"` messages accepted back.

Oracles: transformers' apply_chat_template on the same template (the rendered prompt and
its token count), jsonschema on every returned `arguments` (random weights know no JSON:
only the grammar makes them validate), the non-streamed reply for the streamed one, and
llguidance's own matcher on strings that must or must not be tool calls. The checkpoint is
the tiny random llama with a Qwen-style (Hermes `<tool_call>`) template written over its
own.
"""
from __future__ import annotations

import json
import os
import random
import shutil

import openai
import pytest
import requests

from ferroxmp.frontend.openai import schemas

from ferroxmp.frontend.tools import render as tool_render

from ferroxmp.frontend.tools import parse as tool_parse
from ferroxmp.frontend.errors import ApiError
from ferroxmp.frontend.text.tokenizer import TextCodec
from serverproc import serving
import llg_bytes

jsonschema = pytest.importorskip("jsonschema")
pytestmark = pytest.mark.timeout(300)

# A Qwen2.5-style template: tools in the system turn, calls as <tool_call> JSON, results
# as <tool_response> user turns.
QWEN_TOOLS_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}"
    "{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}"
    "{{- '\\n\\n# Tools\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, "
    "\"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role == 'user' or message.role == 'system' "
    "or (message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>assistant' }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + tool_call.name + '\", \"arguments\": ' }}"
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
LLAMA3_TEMPLATE_BIT = ("{%- if message.role == 'ipython' %}{{- '<|start_header_id|>ipython<|end_header_id|>' }}"
                       "{%- endif %}{{- '<|eot_id|>' }}")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                   "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": -1000, "maximum": 1000},
                                                   "b": {"type": "integer", "minimum": -1000, "maximum": 1000}},
                   "required": ["a", "b"], "additionalProperties": False}}}
TOOLS = [WEATHER, ADD]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
NAMES = frozenset(PARAMS)
USER = [{"role": "user", "content": "What is the weather in Paris, and what is 2 + 3?"}]
CHAT = {"model": "tools", "messages": USER, "tools": TOOLS, "max_tokens": 600}
FLAGS = ("--page-size", "4", "--kv-pages", "4096", "--max-running-requests", "16")


# ---- parsing: the Hermes / Qwen format ---------------------------------------------------

def hermes(name: str, args: dict) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"


def test_one_hermes_call_becomes_a_tool_call_with_a_json_string_and_no_content():
    out = tool_parse.parse(hermes("add", {"a": 1, "b": 2}), tool_parse.HERMES, NAMES)
    assert out.content is None
    assert [(c.name, json.loads(c.arguments)) for c in out.calls] == [("add", {"a": 1, "b": 2})]
    assert out.calls[0].id.startswith("call_") and len(out.calls[0].id) > 10


def test_several_calls_and_the_text_before_them_are_all_kept_in_order():
    text = "Let me check.\n" + hermes("get_weather", {"city": "Paris", "unit": "c"}) + "\n" + hermes("add", {"a": 2, "b": 3})
    out = tool_parse.parse(text, tool_parse.HERMES, NAMES)
    assert out.content == "Let me check."
    assert [c.name for c in out.calls] == ["get_weather", "add"]
    assert len({c.id for c in out.calls}) == 2


@pytest.mark.parametrize("body", ['{"name": "add", "arguments": {"a": 1,', "not json at all",
                                  '{"name": "launch_missiles", "arguments": {}}', '{"name": "add", "arguments": [1, 2]}',
                                  '["add", {"a": 1}]', '{"name": "add", "arguments": {"a": NaN, "b": 1}}'])
def test_a_malformed_or_unknown_call_stays_in_the_content_verbatim(body):
    """Broken JSON, a function nobody offered, arguments that are not an object: content."""
    text = "Hm. <tool_call>\n" + body + "\n</tool_call> ok"
    out = tool_parse.parse(text, tool_parse.HERMES, NAMES)
    assert out.calls == [] and out.content == text


def test_an_unclosed_call_at_the_end_is_content():
    """Cut by max_tokens: what the model wrote is returned, not a half call."""
    text = "x <tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 1, \"b\": 2}}"
    out = tool_parse.parse(text, tool_parse.HERMES, NAMES)
    assert out.calls == [] and out.content == text


def test_raw_control_characters_in_a_string_come_back_escaped():
    """The grammar's JSON strings admit raw control bytes; the client gets valid JSON."""
    out = tool_parse.parse('<tool_call>\n{"name": "get_weather", "arguments": {"city": "a\x01b", "unit": "c"}}\n</tool_call>',
                      tool_parse.HERMES, NAMES)
    assert json.loads(out.calls[0].arguments) == {"city": "a\x01b", "unit": "c"}


def test_parallel_tool_calls_false_keeps_only_the_first_call():
    text = hermes("add", {"a": 1, "b": 1}) + "\n" + hermes("add", {"a": 2, "b": 2})
    out = tool_parse.parse(text, tool_parse.HERMES, NAMES, max_calls=1)
    assert [json.loads(c.arguments) for c in out.calls] == [{"a": 1, "b": 1}] and out.content is None


TEXTS = ["Sure! " + hermes("add", {"a": 1, "b": 2}) + "\n\n" + hermes("get_weather", {"city": "Nice", "unit": "f"}) + " done",
         "<tool_<tool_call> nope </tool_call> " + hermes("add", {"a": 5, "b": 6}) + "<tool_cal",
         "plain reply with a < sign and <tool but no call   ",
         "  \n" + hermes("add", {"a": 1, "b": 2}) + "\n"]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("fmt", [tool_parse.HERMES, tool_parse.LLAMA3_JSON])
def test_any_split_of_a_reply_streams_to_the_same_content_and_calls(text, fmt):
    """Chunking invariance: what a stream delivers (content deltas joined, calls in order)
    equals the whole reply parsed at once, for 60 random splits."""
    if fmt == tool_parse.LLAMA3_JSON:
        text = text.replace(hermes("add", {"a": 1, "b": 2}), '{"name": "add", "parameters": {"a": 1, "b": 2}}')
    whole = tool_parse.parse(text, fmt, NAMES)
    rng = random.Random(7)
    for _ in range(60):
        p, events, i = tool_parse.ToolParser(fmt, NAMES), [], 0
        while i < len(text):
            k = rng.randint(1, 9)
            events += p.feed(text[i:i + k])
            i += k
        events += p.finish()
        content = "".join(e for e in events if isinstance(e, str)) or None
        assert content == whole.content
        assert [(e.name, e.arguments) for e in events if isinstance(e, tool_parse.ToolCall)] == \
               [(c.name, c.arguments) for c in whole.calls]


def test_text_that_may_open_a_call_is_held_back_until_decided():
    p = tool_parse.ToolParser(tool_parse.HERMES, NAMES)
    assert p.feed("Hello <tool") == ["Hello"]  # the space waits too: it touches a possible call
    assert p.feed("box>") == [" <toolbox>"]


# ---- parsing: the Llama 3 JSON format ------------------------------------------------------

@pytest.mark.parametrize("prefix", ["", "<|python_tag|>", "  "])
def test_a_llama3_json_reply_is_one_call(prefix):
    out = tool_parse.parse(prefix + '{"name": "get_weather", "parameters": {"city": "Rome", "unit": "c"}}',
                      tool_parse.LLAMA3_JSON, NAMES)
    assert out.content is None
    assert [(c.name, json.loads(c.arguments)) for c in out.calls] == [("get_weather", {"city": "Rome", "unit": "c"})]


@pytest.mark.parametrize("text", ['{"name": "get_weather", "parameters": {"city": ', "It is sunny.",
                                  '{"answer": 42}', 'The call: {"name": "add", "parameters": {"a": 1, "b": 2}}'])
def test_a_llama3_reply_that_is_not_exactly_a_call_is_content(text):
    out = tool_parse.parse(text, tool_parse.LLAMA3_JSON, NAMES)
    assert out.calls == [] and out.content == text


def test_the_format_follows_the_template_family():
    assert tool_parse.format_for_template(QWEN_TOOLS_TEMPLATE) == tool_parse.HERMES
    assert tool_parse.format_for_template(LLAMA3_TEMPLATE_BIT) == tool_parse.LLAMA3_JSON
    assert tool_parse.format_for_template(None) == tool_parse.HERMES


# ---- validation ----------------------------------------------------------------------------

BAD = [
    ({"tools": {"type": "function"}}, "tools"),
    ({"tools": [{"type": "retrieval", "function": {"name": "x"}}]}, "tools[0].type"),
    ({"tools": [WEATHER, {"type": "function", "function": {"name": "bad name!"}}]}, "tools[1].function.name"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "object"}}]}, "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "params": {}}}]}, "tools[0].function.params"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
    ({"tool_choice": {"type": "tool", "function": {"name": "add"}}}, "tool_choice.type"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"tool_choice": {"type": "function", "function": {"name": "add"}}, "regex": "a+"}, "regex"),
    ({"tool_choice": "required", "ignore_eos": True}, "ignore_eos"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"tool_choice": "required", "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "nonsense"}}}}}]},
     "tools[0].function.parameters"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "c", "function": {"arguments": "{}"}}]}]},
     "messages[0].tool_calls[0].function.name"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages[0].tool_calls"),
    ({"functions": [{"name": "f"}]}, "functions"),
]


@pytest.mark.parametrize("change,param", BAD, ids=[f"{p}-{i}" for i, (_, p) in enumerate(BAD)])
def test_a_bad_tool_field_is_a_400_naming_it(change, param):
    with pytest.raises(ApiError) as e:
        schemas.parse_chat({**CHAT, **change}, 1000)
    assert e.value.status == 400 and e.value.param == param, e.value.message


def test_tool_choice_none_and_empty_tools_ask_for_nothing():
    assert schemas.parse_chat({**CHAT, "tools": [], "tool_choice": "none"}, 1000).tools is None
    req = schemas.parse_chat({**CHAT, "tool_choice": "none"}, 1000)
    assert req.tools.choice == "none" and not req.tools.parses and req.sampling.grammar is None


# ---- the grammar of required and named choices ---------------------------------------------

def _accepts(grammar, text: str) -> bool:
    """llguidance's own matcher, over a byte vocabulary (the oracle for the grammar)."""
    return llg_bytes.accepts(grammar.kind, grammar.spec, text)


@pytest.mark.parametrize("choice,parallel,text,ok", [
    ("required", True, hermes("add", {"a": 1, "b": -2}), True),
    ("required", True, hermes("add", {"a": 1, "b": 2}) + "\n" + hermes("get_weather", {"city": "Oslo", "unit": "c"}), True),
    ("required", False, hermes("add", {"a": 1, "b": 2}) + "\n" + hermes("add", {"a": 1, "b": 2}), False),
    ("required", True, hermes("add", {"a": 1, "b": 2000}), False),  # maximum 1000
    ("required", True, hermes("add", {"a": 1}), False),  # b is required
    ("required", True, hermes("mul", {"a": 1, "b": 2}), False),
    ("required", True, "Sure. " + hermes("add", {"a": 1, "b": 2}), False),
    ("required", True, "", False),
    ("add", True, hermes("add", {"a": 3, "b": 4}), True),
    ("add", True, hermes("get_weather", {"city": "Oslo", "unit": "c"}), False),
    ("add", True, hermes("add", {"a": 3, "b": 4}) + "\n" + hermes("add", {"a": 3, "b": 4}), False),
])
def test_the_hermes_grammar_admits_exactly_tool_calls_that_fit_the_schemas(choice, parallel, text, ok):
    tc = choice if choice == "required" else {"type": "function", "function": {"name": choice}}
    req = schemas.parse_chat({**CHAT, "tool_choice": tc, "parallel_tool_calls": parallel}, 1000, tool_format=tool_parse.HERMES)
    assert _accepts(req.sampling.grammar, text) is ok


def test_the_llama3_grammar_is_one_json_call_with_parameters():
    req = schemas.parse_chat({**CHAT, "tool_choice": "required"}, 1000, tool_format=tool_parse.LLAMA3_JSON)
    assert _accepts(req.sampling.grammar, '{"name": "add", "parameters": {"a": 1, "b": 2}}')
    assert not _accepts(req.sampling.grammar, '{"name": "add", "arguments": {"a": 1, "b": 2}}')


# ---- rendering, against transformers -------------------------------------------------------

@pytest.fixture(scope="module")
def tools_model(tiny_models, tmp_path_factory) -> str:
    """The tiny llama with a Qwen-style tools template (chat_template.jinja wins over the config's)."""
    path = str(tmp_path_factory.mktemp("tools_model") / "tools")
    shutil.copytree(tiny_models["llama"], path)
    with open(os.path.join(path, "chat_template.jinja"), "w", encoding="utf-8") as f:
        f.write(QWEN_TOOLS_TEMPLATE)
    return path


ROUND = USER + [
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C, cloudy"},
    {"role": "tool", "tool_call_id": "call_2", "content": "5"}]


def _oracle(path: str, messages: list, tools_list) -> str:
    """transformers' rendering; assistant arguments as objects, as its docs ask."""
    from transformers import AutoTokenizer
    msgs = json.loads(json.dumps(messages))
    for m in msgs:
        for c in m.get("tool_calls") or []:
            c["function"]["arguments"] = json.loads(c["function"]["arguments"])
    return AutoTokenizer.from_pretrained(path).apply_chat_template(msgs, tools=tools_list, tokenize=False,
                                                                   add_generation_prompt=True)


@pytest.mark.parametrize("messages", [USER, ROUND], ids=["first-turn", "with-results"])
def test_the_prompt_with_tools_renders_as_transformers_does(tools_model, messages):
    req = schemas.parse_chat({**CHAT, "messages": messages}, 1000)
    msgs, tool_list = tool_render.template_inputs(req.prompts[0], req.tools, reads_tools=True)
    ours = TextCodec(tools_model).render_chat(msgs, tools=tool_list)
    assert ours == _oracle(tools_model, messages, TOOLS)
    assert json.dumps(WEATHER) in ours and json.dumps(ADD) in ours
    assert ("<tool_response>\n18 C, cloudy\n</tool_response>" in ours) == (messages is ROUND)


def test_a_template_without_tools_gets_the_hermes_fallback_block(tiny_models):
    """The tiny default template renders only role and content: the tools, the calls and
    the results must still reach the prompt as text."""
    codec = TextCodec(tiny_models["llama"])
    req = schemas.parse_chat({**CHAT, "messages": ROUND}, 1000)
    msgs, tool_list = tool_render.template_inputs(req.prompts[0], req.tools, reads_tools=False)
    text = codec.render_chat(msgs, tools=tool_list)
    assert tool_list is None and text.startswith("<|im_start|>system\n# Tools")
    for t in TOOLS:
        assert json.dumps(t) in text
    assert hermes("get_weather", {"city": "Paris", "unit": "c"}) in text
    assert "<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>" in text


# ---- over HTTP -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def srv(tools_model):
    with serving(tools_model, "--served-model-name", "tools", *FLAGS) as s:
        yield s


def post(srv, body, **kw):
    return requests.post(srv.url + "/v1/chat/completions", json=body, headers=srv.headers, timeout=240, **kw)


def check_calls(calls, allowed=NAMES):
    assert calls, "no tool call"
    for c in calls:
        assert c["type"] == "function" and c["id"].startswith("call_")
        assert c["function"]["name"] in allowed
        jsonschema.validate(json.loads(c["function"]["arguments"]), PARAMS[c["function"]["name"]])


@pytest.mark.parametrize("temperature,seed,parallel", [(0.0, None, False), (1.0, 1, True), (1.0, 2, True),
                                                       (1.0, 3, False)])
def test_required_gives_tool_calls_whose_arguments_validate(srv, temperature, seed, parallel):
    """Greedy runs with parallel_tool_calls false: random greedy weights would choose
    another call after each one until max_tokens (the grammar allows one or more)."""
    r = post(srv, {**CHAT, "tool_choice": "required", "temperature": temperature, "seed": seed, "n": 2,
                   "parallel_tool_calls": parallel})
    assert r.status_code == 200, r.text
    for ch in r.json()["choices"]:
        assert ch["finish_reason"] == "tool_calls", ch
        assert ch["message"]["content"] is None
        check_calls(ch["message"]["tool_calls"])
        if not parallel:
            assert len(ch["message"]["tool_calls"]) == 1


@pytest.mark.parametrize("temperature,seed", [(0.0, None), (1.0, 4)])
def test_a_named_choice_calls_exactly_that_function_once(srv, temperature, seed):
    r = post(srv, {**CHAT, "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
                   "temperature": temperature, "seed": seed})
    assert r.status_code == 200, r.text
    ch = r.json()["choices"][0]
    assert ch["finish_reason"] == "tool_calls"
    assert len(ch["message"]["tool_calls"]) == 1
    check_calls(ch["message"]["tool_calls"], {"get_weather"})


def _streamed(srv, body) -> tuple:
    """(content or None, [(name, arguments)], finish_reason) reassembled from SSE deltas."""
    content, calls, reason = "", {}, None
    with post(srv, {**body, "stream": True}, stream=True) as r:
        assert r.status_code == 200, r.text
        for line in r.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            ch = json.loads(line[6:])["choices"][0]
            d = ch["delta"]
            content += d.get("content") or ""
            for tc in d.get("tool_calls") or []:
                slot = calls.setdefault(tc["index"], {"name": "", "arguments": ""})
                if "id" in tc:  # the name comes first, with the id
                    assert tc["id"].startswith("call_") and not slot["name"]
                slot["name"] += tc.get("function", {}).get("name") or ""
                slot["arguments"] += tc.get("function", {}).get("arguments") or ""
            reason = ch.get("finish_reason") or reason
    return content or None, [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)], reason


@pytest.mark.parametrize("change", [
    {"tool_choice": "required", "temperature": 1.0, "seed": 11},
    {"tool_choice": {"type": "function", "function": {"name": "add"}}, "temperature": 1.0, "seed": 12},
    # auto, with the client's own grammar forcing text + a call: the parser, not the tool grammar
    {"tool_choice": "auto", "temperature": 1.0, "seed": 13,
     "ebnf": 'root ::= "Checking.\\n" ' + json.dumps(hermes("add", {"a": 2, "b": 3}))},
])
def test_streamed_deltas_reassemble_to_the_non_streamed_reply(srv, change):
    whole = post(srv, {**CHAT, **change}).json()["choices"][0]
    content, calls, reason = _streamed(srv, {**CHAT, **change})
    assert content == whole["message"]["content"]
    assert calls == [(c["function"]["name"], c["function"]["arguments"]) for c in whole["message"]["tool_calls"]]
    assert reason == whole["finish_reason"] == "tool_calls"


def test_auto_parses_a_call_the_model_writes_and_keeps_the_text_before_it(srv):
    r = post(srv, {**CHAT, "ebnf": 'root ::= "Checking.\\n" ' + json.dumps(hermes("add", {"a": 2, "b": 3}))})
    ch = r.json()["choices"][0]
    assert ch["message"]["content"] == "Checking."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in ch["message"]["tool_calls"]] \
        == [("add", {"a": 2, "b": 3})]


def test_tool_choice_none_yields_no_tool_calls_even_when_the_text_is_one(srv):
    """none: the reply is content, whatever it looks like."""
    text = hermes("add", {"a": 2, "b": 3})
    r = post(srv, {**CHAT, "tool_choice": "none", "ebnf": "root ::= " + json.dumps(text)})
    ch = r.json()["choices"][0]
    assert "tool_calls" not in ch["message"] and ch["message"]["content"] == text
    assert ch["finish_reason"] == "stop"
    r = post(srv, {**CHAT, "tool_choice": "none", "max_tokens": 30, "temperature": 1.0, "seed": 3})
    assert r.status_code == 200 and "tool_calls" not in r.json()["choices"][0]["message"]


def test_the_server_renders_the_prompt_transformers_renders(srv, tools_model):
    """usage.prompt_tokens equals the token count of transformers' rendering, with the tool
    definitions and a full round of calls and results."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tools_model)
    want = len(tok(_oracle(tools_model, ROUND, TOOLS), add_special_tokens=False)["input_ids"])
    r = post(srv, {**CHAT, "messages": ROUND, "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == want


def test_tokenize_with_tools_gives_transformers_ids_and_the_chat_usage_count(srv, tools_model):
    """/tokenize renders messages and tools exactly as chat completions does."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tools_model)
    want = tok(_oracle(tools_model, ROUND, TOOLS), add_special_tokens=False)["input_ids"]
    r = requests.post(srv.url + "/tokenize", json={"messages": ROUND, "tools": TOOLS}, headers=srv.headers, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == want


def test_a_bad_tool_request_is_a_400_and_the_server_still_answers(srv):
    r = post(srv, {**CHAT, "tool_choice": {"type": "function", "function": {"name": "nope"}}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice.function.name"
    r = post(srv, {**CHAT, "tool_choice": "required", "response_format": {"type": "json_object"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"
    assert post(srv, {**CHAT, "max_tokens": 3}).status_code == 200


def test_the_openai_sdk_round_trip_ends_in_an_answer(srv):
    """request with tools -> tool_calls -> the assistant message and a tool message back ->
    a final answer, all through the openai SDK's own types."""
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
    first = client.chat.completions.create(model="tools", messages=USER, tools=TOOLS, tool_choice="required",
                                           max_tokens=600, temperature=1.0, seed=21)
    msg = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls" and msg.tool_calls
    check_calls([c.model_dump() for c in msg.tool_calls])
    results = [{"role": "tool", "tool_call_id": c.id, "content": json.dumps({"ok": True, "call": c.function.name})}
               for c in msg.tool_calls]
    final = client.chat.completions.create(model="tools", messages=USER + [msg] + results, tools=TOOLS,
                                           max_tokens=20, temperature=1.0, seed=22)
    assert final.choices[0].finish_reason in ("stop", "length")
    assert final.usage.prompt_tokens > first.usage.prompt_tokens


# ---- a Llama 3 style template: the JSON format, end to end ---------------------------------

LLAMA3_TOOLS_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message.role == 'user' and loop.first and tools %}"
    "{{- '<|start_header_id|>user<|end_header_id|>\\n\\nGiven the following functions, respond with a JSON "
    "for a function call with its proper arguments.\\n\\n' }}"
    "{%- for t in tools %}{{- t | tojson }}{{- '\\n\\n' }}{%- endfor %}{{- message.content + '<|eot_id|>' }}"
    "{%- elif message.role == 'assistant' and message.tool_calls %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- for c in message.tool_calls %}"
    "{{- '{\"name\": \"' + c.function.name + '\", \"parameters\": ' + c.function.arguments | tojson + '}' }}"
    "{%- endfor %}{{- '<|eot_id|>' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}"
    "{%- else %}{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}")


@pytest.fixture(scope="module")
def llama3_srv(tiny_models, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("llama3_tools") / "llama3tools")
    shutil.copytree(tiny_models["llama"], path)
    with open(os.path.join(path, "chat_template.jinja"), "w", encoding="utf-8") as f:
        f.write(LLAMA3_TOOLS_TEMPLATE)
    with serving(path, "--served-model-name", "tools", *FLAGS) as s:
        s.model_path = path
        yield s


def test_the_openai_sdk_stream_helper_assembles_the_same_tool_calls(srv):
    """The SDK's own accumulator (`chat.completions.stream`) reads our deltas into the
    message the non-streamed reply gives for the same seed."""
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
    kw = dict(model="tools", messages=USER, tools=TOOLS, tool_choice="required", max_tokens=600,
              temperature=1.0, seed=31)
    whole = client.chat.completions.create(**kw).choices[0]
    with client.chat.completions.stream(**kw) as stream:
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == whole.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in final.message.tool_calls] == \
           [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]


def test_a_llama3_template_gets_one_json_call_whose_arguments_validate(llama3_srv):
    """The format is read from the template (`<|eot_id|>`, `ipython`): the grammar is one
    `{"name", "parameters"}` object and the parser reads it back."""
    assert tool_parse.format_for_template(LLAMA3_TOOLS_TEMPLATE) == tool_parse.LLAMA3_JSON
    body = {**CHAT, "tool_choice": "required", "temperature": 1.0, "seed": 5, "n": 2}
    r = post(llama3_srv, body)
    assert r.status_code == 200, r.text
    for ch in r.json()["choices"]:
        assert ch["finish_reason"] == "tool_calls" and ch["message"]["content"] is None, ch
        assert len(ch["message"]["tool_calls"]) == 1
        check_calls(ch["message"]["tool_calls"])
    content, calls, reason = _streamed(llama3_srv, {**body, "n": 1})
    whole = r.json()["choices"][0]["message"]
    assert (content, reason) == (None, "tool_calls")
    assert calls == [(c["function"]["name"], c["function"]["arguments"]) for c in whole["tool_calls"]]


def test_a_llama3_round_renders_as_transformers_does(llama3_srv):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(llama3_srv.model_path)
    want = len(tok(_oracle(llama3_srv.model_path, ROUND, TOOLS), add_special_tokens=False)["input_ids"])
    r = post(llama3_srv, {**CHAT, "messages": ROUND, "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == want


# ---- nested pydantic tools through real clients (issue 25: they were a 500) ----------------

# The nested models the grammar tests use: one definition for both files.
from test_tool_grammar import Address, Person  # noqa: E402,F401


def _client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)


def test_a_nested_pydantic_tool_from_the_openai_sdk_is_called_and_parsed(srv):
    """`pydantic_function_tool` sends $defs/$ref; the call validates against the sent
    schema (jsonschema) and the SDK's own parse helper builds the model from it."""
    tool = openai.pydantic_function_tool(Person)
    for choice in ("required", {"type": "function", "function": {"name": "Person"}}):
        out = _client(srv).chat.completions.parse(model="tools", messages=USER, tools=[tool], tool_choice=choice,
                                                  max_tokens=400, temperature=1.0, seed=41, parallel_tool_calls=False)
        msg = out.choices[0].message
        assert out.choices[0].finish_reason == "tool_calls" and len(msg.tool_calls) == 1
        jsonschema.validate(json.loads(msg.tool_calls[0].function.arguments), tool["function"]["parameters"])
        assert isinstance(msg.tool_calls[0].function.parsed_arguments, Person)


@pytest.mark.parametrize("mode", ["TOOLS", "TOOLS_STRICT"])
def test_instructor_tools_modes_return_a_valid_nested_model(srv, mode):
    instructor = pytest.importorskip("instructor")
    client = instructor.from_openai(_client(srv), mode=getattr(instructor.Mode, mode))
    for seed in (51, 52):
        p = client.chat.completions.create(model="tools", messages=USER, response_model=Person, max_retries=0,
                                           max_tokens=400, temperature=1.0, seed=seed)
        assert isinstance(p, Person)
        jsonschema.validate(p.model_dump(mode="json"), Person.model_json_schema())


def test_instructor_streamed_partial_mode_ends_in_a_valid_nested_model(srv):
    instructor = pytest.importorskip("instructor")
    client = instructor.from_openai(_client(srv), mode=instructor.Mode.TOOLS)
    partials = list(client.chat.completions.create_partial(
        response_model=Person, model="tools", messages=USER, max_retries=0, max_tokens=400, temperature=1.0, seed=61))
    assert partials
    jsonschema.validate(partials[-1].model_dump(mode="json"), Person.model_json_schema())


def test_instructor_iterable_mode_yields_the_tasks_of_the_call(srv):
    """The streamed call instructor reads equals the non-streamed call of the same seed,
    which validates against the schema it sent. Its schema leaves `tasks` optional and
    the random model mostly answers `{}`, which instructor's iterable parser (1.17)
    rejects as an empty Address: its bug, so seeds whose call is `{}` only check the
    schema, and at least one seed must carry tasks."""
    import httpx2
    instructor = pytest.importorskip("instructor")
    sent = []
    oc = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0,
                       http_client=httpx2.Client(event_hooks={"request": [lambda r: sent.append(r.content)]}))
    client = instructor.from_openai(oc, mode=instructor.Mode.TOOLS)
    with_tasks = 0
    for seed in range(61, 67):
        kw = dict(model="tools", messages=USER, max_tokens=400, temperature=1.0, seed=seed)
        try:
            items = list(client.chat.completions.create_iterable(response_model=Address, max_retries=0, **kw))
        except Exception:  # noqa: BLE001 - instructor's error on `{}`, checked below
            items = None
        body = json.loads(sent[-1])
        ch = post(srv, {**body, "stream": False}).json()["choices"][0]
        args = json.loads(ch["message"]["tool_calls"][0]["function"]["arguments"])
        jsonschema.validate(args, body["tools"][0]["function"]["parameters"])
        if args.get("tasks"):
            with_tasks += 1
            assert [a.model_dump() for a in items] == args["tasks"]
    assert with_tasks


ECHO_TAG = {"type": "function", "function": {"name": "echo", "parameters": {
    "type": "object", "properties": {"s": {"const": "a</tool_call>b"}}, "required": ["s"]}}}


def test_a_forced_call_whose_argument_holds_the_closing_tag_is_a_tool_call(srv):
    """The argument string holds `</tool_call>` (the schema makes it): the call used to
    land in content; it is read structurally, whole and streamed."""
    body = {**CHAT, "tools": [ECHO_TAG], "tool_choice": {"type": "function", "function": {"name": "echo"}}}
    ch = post(srv, body).json()["choices"][0]
    assert ch["finish_reason"] == "tool_calls" and ch["message"]["content"] is None, ch
    assert [json.loads(c["function"]["arguments"]) for c in ch["message"]["tool_calls"]] == [{"s": "a</tool_call>b"}]
    content, calls, reason = _streamed(srv, body)
    assert (content, reason) == (None, "tool_calls") and [json.loads(a) for _, a in calls] == [{"s": "a</tool_call>b"}]


@pytest.mark.parametrize("params", ["a string", {"type": "string"}, {"type": "object", "enum": []},
                                    {"type": "object", "properties": {"x": {"type": "string", "minLength": 5,
                                                                            "maxLength": 2}}}])
def test_a_non_object_or_unsatisfiable_tool_schema_is_a_400_and_the_server_answers(srv, params):
    bad = {"type": "function", "function": {"name": "bad", "parameters": params}}
    r = post(srv, {**CHAT, "tools": [WEATHER, bad], "tool_choice": "required"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools[1].function.parameters", r.text
    assert post(srv, {**CHAT, "max_tokens": 3}).status_code == 200


def test_auto_with_parallel_calls_off_runs_under_its_grammar_and_streams_the_same(srv):
    """The auto one-call grammar (test_tool_grammar checks what it admits) compiles on the
    real vocabulary; replies carry at most one valid call, streamed as whole."""
    body = {**CHAT, "parallel_tool_calls": False, "temperature": 1.0, "seed": 71, "max_tokens": 40}
    r = post(srv, {**body, "n": 3})
    assert r.status_code == 200, r.text
    for ch in r.json()["choices"]:
        assert len(ch["message"].get("tool_calls") or []) <= 1
        if ch["message"].get("tool_calls"):
            check_calls(ch["message"]["tool_calls"])
    whole = r.json()["choices"][0]
    content, calls, reason = _streamed(srv, body)
    assert content == whole["message"]["content"] and reason == whole["finish_reason"]
