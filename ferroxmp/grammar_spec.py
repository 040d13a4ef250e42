"""A grammar spec as the engine (llguidance) reads it, with no vocabulary and no torch:
shared by the frontend (check a spec before queueing it) and the worker (compile it).

Invariants: a spec's cache key is a hash of kind and text; errors are one line of at
most 300 characters (the engine's verbose errors would echo the schema back).
"""
from __future__ import annotations

import hashlib
import json
from typing import Optional

import llguidance as llg

from .protocol import Grammar

KINDS = ("json_object", "json_schema", "regex", "ebnf", "lark")
# Compact JSON (as before): no free whitespace, so a row cannot spend its tokens on blanks.
_JSON_OPTS = {"whitespace_flexible": False}


class GrammarError(ValueError):
    """A spec the engine cannot compile, or a replayed token the grammar refuses."""


def spec_key(g: Grammar) -> str:
    """The cache key of a spec: a hash of kind and text (specs may be 64 KiB)."""
    return hashlib.sha256(f"{g.kind}\0{g.spec}".encode()).hexdigest()[:32]


def to_llguidance(g: Grammar) -> str:
    """The llguidance grammar text for `g`; GrammarError for an unknown kind or a
    grammar the converters refuse (the rest is checked when a matcher is built)."""
    try:
        if g.kind == "json_object":
            return llg.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=_JSON_OPTS)
        if g.kind == "json_schema":
            return llg.LLMatcher.grammar_from_json_schema(g.spec, defaults=_JSON_OPTS)
        if g.kind == "regex":
            return llg.LLMatcher.grammar_from_regex(g.spec)
        if g.kind == "ebnf":  # GBNF (llama.cpp / SGLang's `ebnf`) through llguidance's converter
            return llg.grammar_from("ebnf", g.spec)
        if g.kind == "lark":  # llguidance's own syntax; may embed JSON schemas with %json{...}
            return llg.LLMatcher.grammar_from_lark(g.spec)
    except (ValueError, TypeError, json.JSONDecodeError) as e:
        raise GrammarError(f"cannot read the {g.kind} grammar: {_short(e)}") from None
    raise GrammarError(f"unknown grammar kind {g.kind!r}")


def limits() -> "llg.LLParserLimits":
    """Bounds on the engine's own work per grammar and per step (its defaults, but
    terse errors: verbose ones would echo the schema into logs and responses)."""
    return llg.LLParserLimits(verbose_errors=False)


def check(g: Grammar) -> Optional[str]:
    """Why the engine cannot build `g` (None: it can). No vocabulary is needed."""
    try:
        text = to_llguidance(g)
    except GrammarError as e:
        return str(e)
    is_err, msgs = llg.LLMatcher.validate_grammar_with_warnings(text, None, limits=limits())
    return _short(msgs[0]) if is_err and msgs else None


def _short(e) -> str:
    text = " ".join(ln.strip() for ln in str(e).strip().splitlines() if ln.strip())
    return (text or type(e).__name__)[:300]
