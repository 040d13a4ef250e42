"""The grammar that makes a reply exactly tool calls (tool_choice `required` or a named
function), as llguidance Lark text: the framing of the model family's format is literal,
and each function's arguments are its own `%json{...}` schema.

Why each schema is embedded on its own: `$ref: "#/$defs/X"` (every nested pydantic
model) resolves against the root of the schema that holds it, so a schema must stay a
root; wrapping it inside a call object's `properties.arguments` (what the xgrammar
builder did) made those references dangle and the request a 500.

Formats (one call when `one`, else one or more):
- hermes: `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`, joined by "\\n";
- llama3_json: one `{"name": "f", "parameters": {...}}` (the family writes one call);
- mistral_v3: `[TOOL_CALLS] [{"name": "f", "arguments": {...}}, ...]`;
- mistral: `[TOOL_CALLS]f[ARGS]{...}`, repeated for each call.

Invariants: JSON is compact with ", " and ": " separators (no free whitespace: a random
or confused model cannot pad to max_tokens); objects that list their properties admit
no others (`_close`); a function's arguments are always an
object (`type: object` is added where the schema leaves the type open), so what the
grammar admits is what tools.ToolParser accepts as a call.
"""
from __future__ import annotations

import copy
import json
import re

from ferroxmp.frontend.tools.parse import LLAMA3_JSON, MISTRAL, MISTRAL_V3

_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _lit(s: str) -> str:
    """A Lark string literal (JSON's escapes are Lark's)."""
    return json.dumps(s)


def args_schema(params: dict) -> dict:
    """The schema the arguments are generated under: the client's, an object, compact,
    its objects closed."""
    s = copy.deepcopy(params)
    s.setdefault("type", "object")
    _close(s, in_all_of=False)
    s["x-guidance"] = dict(_COMPACT)
    return s


_OPEN_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties",  # said, or may add some
              "allOf", "anyOf", "oneOf", "$ref", "if", "dependentSchemas", "dependencies")
_DATA = frozenset({"const", "default", "examples", "enum"})


def _close(node, in_all_of: bool) -> None:
    """An object schema that lists `properties` and says nothing of others gets
    `additionalProperties: false` (as OpenAI's strict mode and xgrammar did): JSON
    Schema's default admits any extra key, and a model (instructor's TOOLS mode sends
    such schemas) then invents keys until max_tokens. What is generated still validates
    against the client's schema. Where properties may come from elsewhere it stays
    open: a node with a combinator, `$ref` or conditional beside its properties, and the
    direct parts of allOf/anyOf/oneOf (closing a part would forbid its siblings' or its
    parent's properties)."""
    if isinstance(node, list):
        for v in node:
            _close(v, in_all_of)
        return
    if not isinstance(node, dict):
        return
    if isinstance(node.get("properties"), dict) and not in_all_of and not any(k in node for k in _OPEN_KEYS):
        node["additionalProperties"] = False
    for k, v in node.items():
        if k in _DATA:
            continue
        if k in ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas") and isinstance(v, dict):
            for sub in v.values():
                _close(sub, False)
        elif isinstance(v, (dict, list)):
            _close(v, k in ("allOf", "anyOf", "oneOf"))


def lark(fmt: str, named_params: list[tuple[str, dict]], one: bool, text_first: bool = False) -> str:
    """Lark text for calls of the given functions (name, parameters schema); with
    `text_first` (auto, one call): any text without the call tag, then optionally one call."""
    key = "parameters" if fmt == LLAMA3_JSON else "arguments"
    rules = []
    alts = []
    for i, (name, params) in enumerate(named_params):
        schema = json.dumps(args_schema(params), ensure_ascii=False)
        rules.append(f"args_{i}: %json{schema}")
        if fmt == MISTRAL:
            tag = "" if text_first else "[TOOL_CALLS]"  # text_first: HEAD ends with the tag
            rules.append(f"call_{i}: {_lit(tag + name + '[ARGS]')} args_{i}")
        else:
            head = '{"name": ' + json.dumps(name) + ', "' + key + '": '
            rules.append(f"call_{i}: {_lit(head)} args_{i} {_lit('}')}")
        alts.append(f"call_{i}")
    rules.append("call: " + " | ".join(alts))
    if text_first:
        return "\n".join(_text_then_one(fmt) + rules) + "\n"
    if fmt == LLAMA3_JSON:
        start = "start: call"
    elif fmt == MISTRAL:
        start = "start: call" if one else "start: call+"
    elif fmt == MISTRAL_V3:
        start = f"start: {_lit('[TOOL_CALLS] [')} call " + ("" if one else f"({_lit(', ')} call)* ") + _lit("]")
    else:
        rules.append(f"block: {_lit('<tool_call>' + chr(10))} call {_lit(chr(10) + '</tool_call>')}")
        start = "start: block" if one else f"start: block ({_lit(chr(10))} block)*"
    return "\n".join([start] + rules) + "\n"


def _text_then_one(fmt: str) -> list[str]:
    """TEXT never holds the tag; HEAD is text up to the first tag, which then opens the
    one call. (One lexeme each: llguidance's lexer does not backtrack, so TEXT cannot
    stop short of a tag on its own.)"""
    tag = "[TOOL_CALLS]" if fmt in (MISTRAL, MISTRAL_V3) else "<tool_call>"
    rx = re.escape(tag).replace("/", "\\/")
    if fmt == MISTRAL:
        rest = "call"
    elif fmt == MISTRAL_V3:
        rest = f"{_lit(' [')} call {_lit(']')}"
    else:
        rest = f"{_lit(chr(10))} call {_lit(chr(10) + '</tool_call>')}"
    return [f"start: TEXT | HEAD {rest}", f"TEXT: /(?s:.*)/ & ~/(?s:.*{rx}.*)/",
            f"HEAD: /(?s:.*){rx}/ & ~/(?s:.*{rx}.+)/"]


def engine_error(text: str) -> str | None:
    """Why the engine refuses this Lark text (None: it compiles), by the same check and
    bounds as any client grammar (structured.parse_error: 256 KiB of Lark, llguidance's
    limits). llguidance proves many unsatisfiable schemas (`enum: []`, minLength >
    maxLength, ...) and reports them as errors."""
    from ferroxmp.frontend import structured  # imports the engine on first use
    from ferroxmp.protocol import Grammar
    return structured.parse_error(Grammar("lark", text))
