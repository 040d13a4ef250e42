"""Grammar engines compared on one vocabulary: xgrammar vs llguidance (the engine the
worker uses, gpu_worker/sampling/grammar.py).

    python tools/bench_grammar.py [MODEL_DIR_OR_GGUF] [--walks 20] [--sizes 200,800]
    (xgrammar is compared when installed: pip install xgrammar; the server no longer needs it)

Three measurements, each printed as one table:
1. Correctness: random walks (uniform among the tokens each step's mask allows, what
   a sampler at a very high temperature does) over a corpus of real-world-shaped
   schemas (non-ASCII strings with maxLength/minLength, enums, $defs/$ref, pattern,
   anyOf); the oracle is a strict UTF-8 decode, json.loads and jsonschema. Counts of
   invalid documents per engine and schema.
2. Compile time of an object of N optional string properties (xgrammar: compile;
   llguidance: matcher + first mask, since it builds lazily).
3. Per-step mask time walking a valid document token by token.
Run it on a quiet machine; with other jobs on the cores, label the timings contaminated.
"""
from __future__ import annotations

import argparse
import json
import random
import time

import torch

CORPUS = {
    "unicode_maxlength": {"type": "object", "additionalProperties": False, "required": ["name", "note"],
                          "properties": {"name": {"type": "string", "minLength": 2, "maxLength": 4},
                                         "note": {"type": "string", "maxLength": 3}}},
    "enum_nonascii": {"type": "object", "additionalProperties": False, "required": ["unit"],
                      "properties": {"unit": {"enum": ["°C", "kelvin", "ñ"]}}},
    "defs_ref": {"$defs": {"p": {"type": "object", "additionalProperties": False, "required": ["x"],
                                 "properties": {"x": {"type": "integer", "minimum": -5, "maximum": 5}}}},
                 "type": "object", "additionalProperties": False, "required": ["a", "path"],
                 "properties": {"a": {"$ref": "#/$defs/p"},
                                "path": {"type": "array", "items": {"$ref": "#/$defs/p"}, "maxItems": 2}}},
    "pattern": {"type": "object", "additionalProperties": False, "required": ["id"],
                "properties": {"id": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}}},
    "anyof": {"type": "object", "additionalProperties": False, "required": ["v"],
              "properties": {"v": {"anyOf": [{"type": "boolean"}, {"type": "string", "maxLength": 2}]}}},
}


def vocab(path):
    from ferroxmp.frontend.text.tokenizer import TextCodec
    from ferroxmp.gpu_worker.loader import load_config
    codec = TextCodec(path)
    eos = list(load_config(path, "auto").eos_token_ids)
    toks = [b"" if codec.is_special(i) and i not in eos else codec.token_bytes(i) for i in range(codec.vocab_size)]
    return codec, toks, eos


class XGR:
    name = "xgrammar"
    seps = (", ", ": ")  # its compact JSON (any_whitespace=False)

    def __init__(self, toks, eos):
        import xgrammar as xgr
        self.xgr, self.V, self.eos = xgr, len(toks), eos
        info = xgr.TokenizerInfo(toks, xgr.VocabType.RAW, vocab_size=len(toks), stop_token_ids=eos)
        self.comp = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def compile(self, schema):
        return self.comp.compile_json_schema(json.dumps(schema), any_whitespace=False)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, m, bm):
        m.fill_next_token_bitmask(bm, 0)

    def accept(self, m, tok):
        return m.accept_token(tok)


class LLG:
    name = "llguidance"
    seps = (",", ":")  # whitespace_flexible false

    def __init__(self, toks, eos):
        from ferroxmp.gpu_worker.sampling.grammar import GrammarCache
        self.cache, self.V, self.eos = GrammarCache(toks, len(toks), eos), len(toks), eos

    def compile(self, schema):
        from ferroxmp.protocol import Grammar
        self.cache._cache.clear()
        return self.cache.compile(Grammar("json_schema", json.dumps(schema)))[0]

    def matcher(self, compiled):
        return compiled.deep_copy()

    def fill(self, m, bm):
        m.unsafe_compute_mask_ptr(bm[0].data_ptr(), bm[0].numel() * 4)

    def accept(self, m, tok):
        return m.consume_token(tok)


def walk(eng, compiled, toks, rng, steps=150):
    m, bm = eng.matcher(compiled), torch.zeros((1, (eng.V + 31) // 32), dtype=torch.int32)
    out = b""
    for _ in range(steps):
        eng.fill(m, bm)
        bits = ((bm[0].to(torch.int64).unsqueeze(1) >> torch.arange(32)) & 1).flatten()[:eng.V]
        allowed = bits.nonzero().flatten().tolist()
        body = [t for t in allowed if t not in eng.eos]
        tok = rng.choice(body) if body and rng.random() < 0.9 else rng.choice(allowed)
        if tok in eng.eos:
            return out
        assert eng.accept(m, tok)
        out += toks[tok]
    return None


def invalid(raw, schema):
    import jsonschema
    try:
        jsonschema.validate(json.loads(raw.decode("utf-8")), schema)
        return None
    except Exception as e:
        return f"{type(e).__name__}: {str(e)[:80]}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?")
    ap.add_argument("--walks", type=int, default=20)
    ap.add_argument("--sizes", default="200,800")
    a = ap.parse_args()
    if a.model is None:
        from ferroxmp.checkpoint.default_model import default_model_path
        a.model = default_model_path()
    codec, toks, eos = vocab(a.model)
    try:  # no longer a dependency of the server: compared only where it is installed
        engines = [XGR(toks, eos), LLG(toks, eos)]
    except ImportError:
        print("xgrammar is not installed: llguidance only")
        engines = [LLG(toks, eos)]
    print(f"vocab {len(toks)}\n\n1. invalid / ended walks (UTF-8 + json + jsonschema)")
    for name, schema in CORPUS.items():
        row = []
        for eng in engines:
            compiled, rng, bad, ended, example = eng.compile(schema), random.Random(name), 0, 0, ""
            for _ in range(a.walks):
                raw = walk(eng, compiled, toks, rng)
                if raw is None:
                    continue
                ended += 1
                why = invalid(raw, schema)
                if why:
                    bad, example = bad + 1, example or f" e.g. {raw[:40]!r} {why}"
            row.append(f"{eng.name} {bad}/{ended}{example}")
        print(f"  {name:18s} " + " | ".join(row))
    print("\n2. compile seconds, N optional string properties")
    for n in map(int, a.sizes.split(",")):
        schema = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(n)}}
        row = []
        for eng in engines:
            t = time.perf_counter()
            eng.compile(schema)
            row.append(f"{eng.name} {time.perf_counter() - t:.3f}")
        print(f"  N={n:5d} " + " | ".join(row))
    print("\n3. per-step mask, walking a valid document")
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
              "tags": {"type": "array", "items": {"type": "string"}}, "ok": {"type": "boolean"}},
              "required": ["name", "age", "tags", "ok"], "additionalProperties": False}
    doc = {"name": "Ada Lovelace", "age": 36, "tags": ["math", "poetry"], "ok": True}
    for eng in engines:
        ids = codec.encode(json.dumps(doc, separators=eng.seps), add_special_tokens=False)
        m, bm, ts = eng.matcher(eng.compile(schema)), torch.zeros((1, (eng.V + 31) // 32), dtype=torch.int32), []
        for tok in ids:
            t = time.perf_counter()
            eng.fill(m, bm)
            ts.append(time.perf_counter() - t)
            assert eng.accept(m, tok), tok
        print(f"  {eng.name}: mean {1e6 * sum(ts) / len(ts):.0f} us, max {1e6 * max(ts):.0f} us over {len(ids)} tokens")


if __name__ == "__main__":
    main()
