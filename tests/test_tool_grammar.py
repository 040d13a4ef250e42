"""Tool-call constraints and parsers without a server (issue 25): nested schemas
($defs/$ref) in forced calls, the closing tag inside an argument, `parameters` that is
not an object schema or cannot be satisfied, Mistral's `[TOOL_CALLS]` formats and
`parallel_tool_calls: false` as a one-call grammar.

Oracles: llguidance's own matcher over a byte vocabulary (what the grammar admits),
random texts drawn through its mask then read back by tool_parse.parse and checked with
jsonschema, and the whole-reply parse for every split of a streamed one.
"""
from __future__ import annotations

import json
import random

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

import llg_bytes
from ferroxmp.frontend.openai import schemas
from ferroxmp.frontend.tools import grammar as tool_grammar
from ferroxmp.frontend.tools import schema as tool_schema
from ferroxmp.frontend.tools import parse as tool_parse
from ferroxmp.frontend.errors import ApiError


class Address(BaseModel):
    street: str = Field(max_length=10)
    zip: int = Field(ge=0, le=99999)


class Person(BaseModel):
    name: str = Field(max_length=10)
    home: Address
    past: list[Address] = Field(max_length=2)


PERSON = openai.pydantic_function_tool(Person)  # strict, with $defs/$ref, as the SDK sends it
TREE = {"type": "function", "function": {"name": "tree", "parameters": {  # a recursive $ref
    "type": "object", "$defs": {"node": {"type": "object", "properties": {
        "v": {"type": "integer", "minimum": 0, "maximum": 9},
        "kids": {"type": "array", "maxItems": 2, "items": {"$ref": "#/$defs/node"}}}, "required": ["v"]}},
    "properties": {"root": {"$ref": "#/$defs/node"}}, "required": ["root"]}}}
PLAIN = {"type": "function", "function": {"name": "ping", "parameters": {
    "type": "object", "properties": {"s": {"type": "string", "maxLength": 6}}, "required": ["s"]}}}
ALL = [PERSON, TREE, PLAIN]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in ALL}
USER = [{"role": "user", "content": "hi"}]
FORMATS = [tool_parse.HERMES, tool_parse.LLAMA3_JSON, tool_parse.MISTRAL_V3, tool_parse.MISTRAL]


def _req(fmt: str, choice, parallel: bool = True, tool_list=ALL):
    return schemas.parse_chat({"model": "m", "messages": USER, "tools": tool_list, "tool_choice": choice,
                               "parallel_tool_calls": parallel}, 1000, tool_format=fmt)


def _named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("choice", ["required", "Person", "tree"])
def test_nested_ref_schemas_make_calls_that_parse_and_validate(fmt, choice):
    """A $defs/$ref schema (nested pydantic model, recursive tree) used to be a 500:
    random texts the grammar admits parse back as calls whose arguments validate."""
    req = _req(fmt, choice if choice == "required" else _named(choice))
    g = req.sampling.grammar
    assert g.kind == "lark"
    rng = random.Random(hash((fmt, choice)) & 0xFFFF)
    for _ in range(8):
        text = llg_bytes.sample(g.kind, g.spec, rng).decode("utf-8")
        out = tool_parse.parse(text, fmt, req.tools.names)
        assert out.content is None and out.calls, text
        for c in out.calls:
            assert choice == "required" or c.name == choice
            jsonschema.validate(json.loads(c.arguments), PARAMS[c.name])


def test_a_pydantic_call_is_admitted_and_a_schema_violation_is_not():
    g = _req(tool_parse.HERMES, _named("Person")).sampling.grammar
    home = {"street": "Main", "zip": 7}
    good = Person(name="Ann", home=Address(**home), past=[]).model_dump()
    call = lambda args: '<tool_call>\n{"name": "Person", "arguments": ' + json.dumps(args) + '}\n</tool_call>'  # noqa: E731
    assert llg_bytes.accepts(g.kind, g.spec, call(good))
    assert not llg_bytes.accepts(g.kind, g.spec, call({**good, "home": {**home, "zip": -1}}))
    assert not llg_bytes.accepts(g.kind, g.spec, call({**good, "past": [home] * 3}))  # maxItems 2


ARG = {"s": "a</tool_call>b"}
ECHO = {"type": "function", "function": {"name": "echo", "parameters": {
    "type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"]}}}


@pytest.mark.parametrize("seed", range(5))
def test_a_closing_tag_inside_an_argument_string_stays_in_the_call(seed):
    """The call's JSON is read structurally: `</tool_call>` in a string is no end, in any
    split of the stream (it used to land the call in content)."""
    text = 'ok <tool_call>\n{"name": "echo", "arguments": ' + json.dumps(ARG) + "}\n</tool_call>"
    g = _req(tool_parse.HERMES, _named("echo"), tool_list=[ECHO]).sampling.grammar
    assert llg_bytes.accepts(g.kind, g.spec, text[3:])
    whole = tool_parse.parse(text, tool_parse.HERMES, {"echo"})
    assert whole.content == "ok" and [json.loads(c.arguments) for c in whole.calls] == [ARG]
    _assert_split_invariant(text, tool_parse.HERMES, {"echo"}, whole, random.Random(seed))


def _assert_split_invariant(text, fmt, names, whole, rng, rounds=40):
    for _ in range(rounds):
        p, events, i = tool_parse.ToolParser(fmt, frozenset(names)), [], 0
        while i < len(text):
            k = rng.randint(1, 7)
            events += p.feed(text[i:i + k])
            i += k
        events += p.finish()
        assert ("".join(e for e in events if isinstance(e, str)) or None) == whole.content
        assert [(e.name, e.arguments) for e in events if isinstance(e, tool_parse.ToolCall)] == \
               [(c.name, c.arguments) for c in whole.calls]


@pytest.mark.parametrize("params", ["a string", ["a", "list"], {"type": "string"}, {"type": "array"}, 7])
def test_parameters_that_are_not_an_object_schema_are_a_400(params):
    bad = {"type": "function", "function": {"name": "f", "parameters": params}}
    for choice in ("auto", "required"):
        with pytest.raises(ApiError) as e:
            _req(tool_parse.HERMES, choice, tool_list=[PLAIN, bad])
        assert e.value.status == 400 and e.value.param == "tools[1].function.parameters"


def _obj(prop: dict, required=True) -> dict:
    return {"type": "object", "properties": {"x": prop}, **({"required": ["x"]} if required else {})}


UNSAT = [
    {"type": "object", "enum": []},
    _obj({"enum": []}, required=False),  # even optional: a client bug the engine would hide
    _obj({"type": "string", "minLength": 5, "maxLength": 2}),
    _obj({"type": "array", "minItems": 3, "maxItems": 1}),
    _obj({"type": "object", "minProperties": 2, "maxProperties": 1}),
    _obj({"type": "integer", "minimum": 5, "maximum": 2}),
    _obj({"type": "number", "exclusiveMinimum": 2, "exclusiveMaximum": 2}),
    {"type": "object", "properties": {}, "required": ["z"], "additionalProperties": False},
]


@pytest.mark.parametrize("params", UNSAT)
@pytest.mark.parametrize("choice", ["auto", "required"])
def test_an_unsatisfiable_schema_is_a_400_at_submission(params, choice):
    """Accepted before, a forced call then ran to max_tokens or returned garbage."""
    bad = {"type": "function", "function": {"name": "f", "parameters": params}}
    with pytest.raises(ApiError) as e:
        _req(tool_parse.HERMES, choice, tool_list=[PLAIN, bad])
    assert e.value.status == 400 and e.value.param == "tools[1].function.parameters"


def test_the_engine_names_an_unsatisfiable_schema_the_static_checks_miss():
    params = _obj({"allOf": [{"type": "string"}, {"type": "integer"}]})
    assert tool_schema.check(params) is None
    bad = {"type": "function", "function": {"name": "f", "parameters": params}}
    with pytest.raises(ApiError) as e:
        _req(tool_parse.HERMES, _named("f"), tool_list=[PLAIN, bad])
    assert e.value.param == "tools[1].function.parameters" and "nsatisfiable" in e.value.message


def test_data_that_looks_like_a_bad_schema_is_not_one():
    """const/default/examples values are data, not schemas: never checked as such."""
    params = _obj({"type": "object", "default": {"minLength": 5, "maxLength": 1, "enum": []},
                   "examples": [{"enum": []}]})
    assert tool_schema.check(params) is None


# ---- parallel_tool_calls: false is a one-call grammar ---------------------------------------

def _call_text(fmt: str, name: str, args: dict, n: int) -> str:
    a = json.dumps(args)
    if fmt == tool_parse.MISTRAL:
        return "".join(f"[TOOL_CALLS]{name}[ARGS]{a}" for _ in range(n))
    one = '{"name": ' + json.dumps(name) + ', "arguments": ' + a + "}"
    if fmt == tool_parse.MISTRAL_V3:
        return "[TOOL_CALLS] [" + ", ".join([one] * n) + "]"
    return "\n".join(["<tool_call>\n" + one + "\n</tool_call>"] * n)


@pytest.mark.parametrize("fmt", [tool_parse.HERMES, tool_parse.MISTRAL_V3, tool_parse.MISTRAL])
def test_parallel_tool_calls_false_admits_exactly_one_call(fmt):
    one, two = (_call_text(fmt, "ping", {"s": "hey"}, n) for n in (1, 2))
    g1 = _req(fmt, "required", parallel=False).sampling.grammar
    g2 = _req(fmt, "required", parallel=True).sampling.grammar
    assert llg_bytes.accepts("lark", g1.spec, one) and not llg_bytes.accepts("lark", g1.spec, two)
    assert llg_bytes.accepts("lark", g2.spec, one) and llg_bytes.accepts("lark", g2.spec, two)


# ---- Mistral [TOOL_CALLS] ------------------------------------------------------------------

MISTRAL_TEXTS = [
    'Let me check. [TOOL_CALLS] [{"name": "ping", "arguments": {"s": "a"}}, {"name": "tree", "arguments": {"root": {"v": 1}}}]',
    '[TOOL_CALLS]ping[ARGS]{"s": "[TOOL_CALLS]x"}[TOOL_CALLS]tree[CALL_ID]a1B2c3D4e[ARGS]{"root": {"v": 2}}',
    '[TOOL_CALLS] [{"name": "ping", "arguments": {"s": "]}"}}]',
]


@pytest.mark.parametrize("text", MISTRAL_TEXTS)
@pytest.mark.parametrize("fmt", [tool_parse.MISTRAL_V3, tool_parse.MISTRAL])
def test_mistral_tool_calls_parse_whole_and_streamed_in_any_split(text, fmt):
    whole = tool_parse.parse(text, fmt, PARAMS)
    want = [json.loads(a) for a in ('{"s": "a"}', '{"root": {"v": 1}}')] if "Let me" in text else None
    assert whole.calls and all(c.name in PARAMS for c in whole.calls)
    if want:
        assert whole.content == "Let me check." and [json.loads(c.arguments) for c in whole.calls] == want
    else:
        assert whole.content is None
    _assert_split_invariant(text, fmt, PARAMS, whole, random.Random(len(text)))


@pytest.mark.parametrize("text", [
    "[TOOL_CALLS] not a call at all", "x [TOOL_CALLS] [1, 2]", '[TOOL_CALLS]nope[ARGS]{"s": "a"}',
    '[TOOL_CALLS] [{"name": "ping", "arguments": {"s": "a"}}', "a [TOOL_CALL"])
def test_a_malformed_mistral_call_stays_in_the_content_verbatim(text):
    out = tool_parse.parse(text, tool_parse.MISTRAL, PARAMS)
    assert out.calls == [] and out.content == text
    _assert_split_invariant(text, tool_parse.MISTRAL, PARAMS, out, random.Random(3), rounds=15)


def test_the_mistral_format_follows_the_template():
    v3 = "{{ '[AVAILABLE_TOOLS] ' + tools|tojson }}{{ '[TOOL_CALLS] ' + calls|tojson }}</s>"
    v11 = "{{ '[TOOL_CALLS]' + name + '[ARGS]' + args }}</s>"
    assert tool_parse.format_for_template(v3) == tool_parse.MISTRAL_V3
    assert tool_parse.format_for_template(v11) == tool_parse.MISTRAL


def test_the_grammar_module_adds_object_type_and_compact_json_only_to_a_copy():
    params = {"properties": {"a": {"type": "string"}}}
    s = tool_grammar.args_schema(params)
    assert s["type"] == "object" and params == {"properties": {"a": {"type": "string"}}}


@pytest.mark.parametrize("fmt", [tool_parse.HERMES, tool_parse.MISTRAL_V3, tool_parse.MISTRAL])
def test_auto_with_parallel_calls_off_admits_text_then_at_most_one_call(fmt):
    """`parallel_tool_calls: false` used to drop later calls after generating them; now
    the auto grammar ends the reply after the first call."""
    g = _req(fmt, "auto", parallel=False).sampling.grammar
    one, two = (_call_text(fmt, "ping", {"s": "hey"}, n) for n in (1, 2))
    assert llg_bytes.accepts(g.kind, g.spec, "Sure, a <b> tag and [brackets].")
    assert llg_bytes.accepts(g.kind, g.spec, "Let me look. " + one)
    assert not llg_bytes.accepts(g.kind, g.spec, "Let me look. " + two)
    assert not llg_bytes.accepts(g.kind, g.spec, "x " + one + " and more text")
    assert not llg_bytes.accepts(g.kind, g.spec, "x " + _call_text(fmt, "ping", {"s": 3}, 1))  # schema


def test_auto_with_parallel_calls_on_or_a_client_grammar_is_not_constrained():
    assert _req(tool_parse.HERMES, "auto", parallel=True).sampling.grammar is None
    req = schemas.parse_chat({"model": "m", "messages": USER, "tools": ALL, "parallel_tool_calls": False,
                              "regex": "[a-z]+"}, 1000, tool_format=tool_parse.HERMES)
    assert req.sampling.grammar.kind == "regex"
    assert _req(tool_parse.LLAMA3_JSON, "auto", parallel=False).sampling.grammar is None  # one call is the format


def test_a_tool_schema_over_the_response_format_bounds_is_a_400_before_any_compile():
    """Tool lists used to reach the worker's compiler unbounded (a slow compile stalled
    it): parameters get the bounds response_format has (here > 1,000 properties)."""
    big = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(1001)}}
    with pytest.raises(ApiError) as e:
        _req(tool_parse.HERMES, "auto", tool_list=[PLAIN, {"type": "function", "function": {"name": "big", "parameters": big}}])
    assert e.value.param == "tools[1].function.parameters" and "1000 properties" in e.value.message


def test_closing_objects_never_forbids_properties_a_combinator_adds():
    """Objects are closed in the grammar (a model must not invent keys), except where
    properties may come from elsewhere: an anyOf branch adding `b` to its parent's `a`
    stays callable with both."""
    params = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "anyOf": [{"properties": {"b": {"type": "string"}}, "required": ["b"]}]}
    g = _req(tool_parse.HERMES, _named("f"), tool_list=[{"type": "function", "function": {"name": "f", "parameters": params}}]
             ).sampling.grammar
    ok = '<tool_call>\n{"name": "f", "arguments": {"a": 1, "b": "x"}}\n</tool_call>'
    assert llg_bytes.accepts(g.kind, g.spec, ok)
    closed = _req(tool_parse.HERMES, _named("ping")).sampling.grammar
    extra = '<tool_call>\n{"name": "ping", "arguments": {"s": "x", "zz": 1}}\n</tool_call>'
    assert not llg_bytes.accepts(closed.kind, closed.spec, extra)
    jsonschema.validate({"s": "x", "zz": 1}, PARAMS["ping"])  # the schema itself admits it
