"""Structured output, logit_bias and min_tokens at the edge: JSON fields -> Grammar and
SamplingParams values, or an ApiError(400) naming the field.

Job: read `response_format` (OpenAI's text / json_object / json_schema), `regex` and
`ebnf` (SGLang's names), `logit_bias` and `min_tokens`; check a grammar with the
engine's own parser (llguidance, grammar_spec.py) so a schema, regex or EBNF the
worker could not compile, or a schema keyword it could not enforce, is a 400 here,
before anything is queued.

Invariants: at most one constraint per request; a spec is at most MAX_SPEC_CHARS (a
lark spec, which may embed a whole tool list, MAX_LARK_CHARS); a JSON schema has at
most MAX_SCHEMA_PROPERTIES properties in all and nests at most MAX_SCHEMA_DEPTH deep
(the engine's compile time grows with them: 3,000 properties took 0.87 s on a 49k
vocabulary, docs/BENCHMARKS.md), so a schema over the bounds never reaches the
worker; a bias names a token of this vocabulary and lies in [-100, 100], as OpenAI's does.
"""
from __future__ import annotations

import json
import re
from typing import Any, Optional

from ferroxmp.frontend.errors import bad_param
from ferroxmp.frontend.fields import Fields, check_names
from ferroxmp.protocol import Grammar

MAX_SPEC_CHARS = 65536
MAX_LARK_CHARS = 4 * MAX_SPEC_CHARS
MAX_SCHEMA_PROPERTIES = 1000  # summed over every "properties" object of the schema
MAX_SCHEMA_DEPTH = 32  # nested objects/arrays of the schema's JSON
MAX_LOGIT_BIAS = 1024  # entries
_SCHEMA_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
GRAMMAR_FIELDS = ("response_format", "regex", "ebnf")


def grammar(f: Fields) -> Optional[Grammar]:
    """The request's constraint, or None; validated by the engine's parser."""
    asked = [(name, g) for name in GRAMMAR_FIELDS if (g := _one(f, name)) is not None]
    if len(asked) > 1:
        raise bad_param(f.name(asked[1][0]), f"only one of {', '.join(GRAMMAR_FIELDS)} may constrain "
                        f"a request; it also has '{asked[0][0]}'")
    if not asked:
        return None
    name, g = asked[0]
    param = f.name("response_format.json_schema.schema") if g.kind == "json_schema" else f.name(name)
    if len(g.spec) > MAX_SPEC_CHARS:
        raise bad_param(param, f"at most {MAX_SPEC_CHARS} characters, got {len(g.spec)}")
    why = parse_error(g)
    if why is not None:
        raise bad_param(param, f"not a {g.kind.replace('_', ' ')} the grammar engine accepts: {why}")
    return g


def _one(f: Fields, name: str) -> Optional[Grammar]:
    if name != "response_format":
        spec = f.str(name, None, max_len=MAX_SPEC_CHARS)
        return None if spec is None else Grammar("regex" if name == "regex" else "ebnf", spec)
    if not f.has(name):
        return None
    rf = Fields(f.raw(name), f.name(name) + ".")
    kind = rf.raw("type")
    if kind == "text":
        check_names(rf.obj, frozenset({"type"}), {}, rf.prefix)
        return None
    if kind == "json_object":
        check_names(rf.obj, frozenset({"type"}), {}, rf.prefix)
        return Grammar("json_object")
    if kind != "json_schema":
        raise bad_param(rf.name("type"), f"{kind!r:.40} is not one of 'text', 'json_object', 'json_schema'")
    check_names(rf.obj, frozenset({"type", "json_schema"}), {}, rf.prefix)
    js = Fields(rf.raw("json_schema"), rf.name("json_schema") + ".")
    check_names(js.obj, frozenset({"name", "schema", "strict", "description"}), {}, js.prefix)
    name_v = js.str("name", max_len=64)
    if name_v is None or not _SCHEMA_NAME.match(name_v):
        raise bad_param(js.name("name"), "is required: 1 to 64 letters, digits, '_' or '-'")
    js.bool("strict")  # always enforced: the mask makes every output follow the schema
    js.str("description", max_len=MAX_SPEC_CHARS)
    schema = js.raw("schema")
    if not isinstance(schema, dict):
        raise bad_param(js.name("schema"), "is required: a JSON Schema object")
    return Grammar("json_schema", json.dumps(schema))


def parse_error(g: Grammar) -> Optional[str]:
    """Why the grammar engine (llguidance) cannot build `g` (None: it can), for every
    kind (json_object, json_schema, regex, ebnf, lark). No vocabulary is needed; a
    JSON Schema keyword the engine cannot enforce is named ("Unimplemented keys: ...")."""
    limit = MAX_LARK_CHARS if g.kind == "lark" else MAX_SPEC_CHARS
    if len(g.spec) > limit:
        return f"at most {limit} characters, got {len(g.spec)}"
    if g.kind == "json_schema":
        why = schema_bounds_error(g.spec)
        if why is not None:
            return why
    from ferroxmp.grammar_spec import check
    return check(g)


def schema_bounds_error(spec: str) -> Optional[str]:
    """Why a JSON schema's text is over the size bounds (None: within them)."""
    try:
        schema = json.loads(spec)
    except ValueError as e:
        return f"not JSON: {e}"
    props, stack = 0, [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            return f"nests deeper than {MAX_SCHEMA_DEPTH} levels"
        if isinstance(node, dict):
            if isinstance(node.get("properties"), dict):
                props += len(node["properties"])
                if props > MAX_SCHEMA_PROPERTIES:
                    return f"has more than {MAX_SCHEMA_PROPERTIES} properties in all (compile time grows with them)"
            stack.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node)
    return None


def logit_bias(f: Fields, vocab_size: int) -> dict[int, float]:
    """OpenAI's {"token id": bias}: keys are token ids (as JSON strings), biases in [-100, 100]."""
    v: Any = f.raw("logit_bias")
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise bad_param(f.name("logit_bias"), "must be an object mapping token ids to biases")
    if len(v) > MAX_LOGIT_BIAS:
        raise bad_param(f.name("logit_bias"), f"at most {MAX_LOGIT_BIAS} entries, got {len(v)}")
    out: dict[int, float] = {}
    for key in v:
        param = f"{f.name('logit_bias')}.{key:.40}"
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 12):
            raise bad_param(param, "a key must be a token id (a non-negative integer)")
        tid = int(key)
        if tid >= vocab_size:
            raise bad_param(param, f"token id {tid} is outside the vocabulary [0, {vocab_size})")
        out[tid] = Fields(v, f.name("logit_bias") + ".").float(key, 0.0, lo=-100.0, hi=100.0)
    return out
