"""A tool's `parameters` schema, checked at submission: it must describe an object, and
must not be plainly unsatisfiable.

Job: `check(params) -> None | reason`. A forced call with an unsatisfiable schema used
to run to max_tokens or return garbage; an auto one can never be called correctly.
The engine (llguidance) proves many unsatisfiable schemas when the grammar is built
(tool_grammar.engine_error); these static checks catch the common ones anywhere in
the schema, including in optional properties the engine would simply never emit:
`enum: []`, min above max for lengths, items, properties and number bounds, and a
`required` name absent from `properties` when `additionalProperties` is false.

Invariants: only schema positions are inspected (`const`, `default`, `examples` and
`enum` values are data, never walked); a reason names the JSON path it found.
"""
from __future__ import annotations

from typing import Any, Optional

_BOUNDS = (("minLength", "maxLength"), ("minItems", "maxItems"), ("minProperties", "maxProperties"),
           ("minimum", "maximum"), ("exclusiveMinimum", "exclusiveMaximum"),
           ("minimum", "exclusiveMaximum"), ("exclusiveMinimum", "maximum"))
_DATA = frozenset({"const", "default", "examples", "enum"})


def check(params: Any) -> Optional[str]:
    """Why `params` cannot be a tool's parameters (None: it can)."""
    if not isinstance(params, dict):
        return "must be a JSON Schema object describing an object (got " + type(params).__name__ + ")"
    t = params.get("type", "object")
    if t != "object" and not (isinstance(t, list) and "object" in t):
        return f"must describe an object ('type': 'object'), got 'type': {t!r:.40}"
    return _walk(params, "")


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _walk(node: Any, path: str) -> Optional[str]:
    if isinstance(node, list):
        for i, v in enumerate(node):
            if (why := _walk(v, f"{path}[{i}]")) is not None:
                return why
        return None
    if not isinstance(node, dict):
        return None
    if isinstance(node.get("enum"), list) and not node["enum"]:
        return f"{path or '(root)'}: 'enum' is empty, so no value is valid"
    for lo, hi in _BOUNDS:
        a, b = node.get(lo), node.get(hi)
        strict = lo.startswith("exclusive") or hi.startswith("exclusive")
        if _num(a) and _num(b) and (a >= b if strict else a > b):
            return f"{path or '(root)'}: '{lo}' ({a}) is above '{hi}' ({b}), so no value is valid"
    req, props = node.get("required"), node.get("properties")
    if node.get("additionalProperties") is False and isinstance(req, list) and isinstance(props, dict):
        missing = [r for r in req if isinstance(r, str) and r not in props]
        if missing:
            return (f"{path or '(root)'}: 'required' names {missing[0]!r:.60}, which 'properties' lacks "
                    "and 'additionalProperties' false forbids")
    for k, v in node.items():
        if k in _DATA:
            continue
        if k in ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas") and isinstance(v, dict):
            for name, sub in v.items():
                if (why := _walk(sub, f"{path}.{k}.{name}")) is not None:
                    return why
        elif isinstance(v, (dict, list)):
            if (why := _walk(v, f"{path}.{k}")) is not None:
                return why
    return None
