"""Every output the grammar mask allows is valid: random walks over the mask.

Oracle: jsonschema (and a strict UTF-8 decode, and re.fullmatch) on the bytes of
token sequences chosen uniformly among the tokens each step's mask allows, which is
what a sampler at very high temperature does. The model plays no part: if the mask
ever allows a token that breaks UTF-8 (a lone continuation byte, an encoded surrogate
such as ED BE 99), a raw control byte in a JSON string, or a string past maxLength,
some walk finds it.
"""
from __future__ import annotations

import json
import random
import re

import pytest
import torch

from ferroxmp.frontend.text.tokenizer import TextCodec
from ferroxmp.protocol import Grammar

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

CORPUS = {
    "short_unicode_strings": {
        "type": "object", "additionalProperties": False, "required": ["name", "note"],
        "properties": {"name": {"type": "string", "minLength": 2, "maxLength": 4},
                       "note": {"type": "string", "maxLength": 3}}},
    "enums_and_consts": {
        "type": "object", "additionalProperties": False, "required": ["unit", "kind"],
        "properties": {"unit": {"enum": ["°C", "kelvin", "ñ", 3, None]}, "kind": {"const": "naïve"}}},
    "defs_and_refs": {
        "$defs": {"point": {"type": "object", "additionalProperties": False, "required": ["x", "y"],
                            "properties": {"x": {"type": "integer", "minimum": -5, "maximum": 5},
                                           "y": {"type": "number"}}}},
        "type": "object", "additionalProperties": False, "required": ["a", "path"],
        "properties": {"a": {"$ref": "#/$defs/point"},
                       "path": {"type": "array", "items": {"$ref": "#/$defs/point"}, "maxItems": 2}}},
    "pattern_and_arrays": {
        "type": "object", "additionalProperties": False, "required": ["id", "tags"],
        "properties": {"id": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
                       "tags": {"type": "array", "items": {"type": "string", "maxLength": 2},
                                "minItems": 1, "maxItems": 3}}},
    "optional_and_anyof": {
        "type": "object", "additionalProperties": False,
        "properties": {"v": {"anyOf": [{"type": "boolean"}, {"type": "string", "maxLength": 2}]},
                       "w": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 4}}},
}


def walk(cache, g: Grammar, rng: random.Random, codec: TextCodec, max_steps: int = 120):
    """(bytes produced, ended in EOS): tokens drawn uniformly from each step's mask."""
    from ferroxmp.gpu_worker.sampling.grammar import allocate
    rg = cache.matcher(g)
    bm = allocate(1, cache.vocab_size)
    eos = set(cache.eos_ids)
    out = b""
    for _ in range(max_steps):
        rg.fill(bm, 0)
        bits = ((bm[0].to(torch.int64).unsqueeze(1) >> torch.arange(32)) & 1).flatten()[:cache.vocab_size]
        allowed = bits.nonzero().flatten().tolist()
        assert allowed, "the mask left no token"
        assert all(t in eos or not codec.is_special(t) for t in allowed), "a special token is allowed"
        # Prefer not to stop at once, so walks reach the long strings, but stop sometimes.
        body = [t for t in allowed if t not in eos]
        tok = rng.choice(body) if body and rng.random() < 0.9 else rng.choice(allowed)
        if tok in eos:
            return out, True
        rg.advance(tok)
        out += codec.token_bytes(tok)
    return out, False


@pytest.fixture(scope="module")
def cache_and_codec(tiny_models):
    from ferroxmp.gpu_worker.sampling.grammar import GrammarCache
    from ferroxmp.gpu_worker.loader import load_config
    path = tiny_models["llama"]
    cfg = load_config(path, "auto")
    return GrammarCache.for_checkpoint(path, cfg.vocab_size, cfg.eos_token_ids), TextCodec(path)


@pytest.mark.parametrize("name", sorted(CORPUS))
def test_every_random_walk_over_a_schema_mask_is_utf8_and_validates(name, cache_and_codec):
    """A mask that allowed broken UTF-8, a control byte in a string, a string past its
    maxLength or an enum value not listed would produce an invalid document in some walk."""
    cache, codec = cache_and_codec
    schema = CORPUS[name]
    g = Grammar("json_schema", json.dumps(schema))
    rng = random.Random(name)
    ended = 0
    for _ in range(25):
        raw, done = walk(cache, g, rng, codec)
        if not done:
            continue
        ended += 1
        text = raw.decode("utf-8")  # strict: raises on invalid UTF-8 (surrogates included)
        jsonschema.validate(json.loads(text), schema)
    assert ended >= 10, f"only {ended} of 25 walks ended"


def test_random_walks_over_a_regex_and_a_lark_grammar_match_them(cache_and_codec):
    """The regex and lark kinds are exact too; lark embeds a JSON schema with %json."""
    cache, codec = cache_and_codec
    rng = random.Random(5)
    lark = ('start: "<call>" obj "</call>"\n'
            'obj: %json{"type": "object", "properties": {"q": {"type": "string", "maxLength": 3}},'
            ' "required": ["q"], "additionalProperties": false}')
    for g, check in ((Grammar("regex", r"(é|ab){1,3}-[0-9]"), lambda s: re.fullmatch(r"(é|ab){1,3}-[0-9]", s)),
                     (Grammar("lark", lark), lambda s: s.startswith("<call>") and s.endswith("</call>")
                      and len(json.loads(s[6:-7])["q"]) <= 3)):
        for _ in range(15):
            raw, done = walk(cache, g, rng, codec)
            if done:
                assert check(raw.decode("utf-8")), raw


def test_a_schema_keyword_the_engine_cannot_enforce_is_named():
    """Silently ignoring uniqueItems would let a constrained reply break the schema."""
    from ferroxmp.frontend.structured import parse_error
    why = parse_error(Grammar("json_schema", json.dumps({"type": "array", "uniqueItems": True})))
    assert why is not None and "uniqueItems" in why
    assert parse_error(Grammar("json_schema", json.dumps(CORPUS["defs_and_refs"]))) is None
    assert parse_error(Grammar("lark", "start: nowhere")) is not None
