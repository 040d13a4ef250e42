"""Grammar engines compared on one vocabulary: xgrammar vs llguidance, compile time and
per-step mask time for a JSON schema, walking a valid document token by token.

    python tools/bench_grammar.py MODEL_DIR_OR_GGUF
"""
import json
import sys
import time

from ferroxmp.frontend.tokenizer import TextCodec
path = sys.argv[1]
codec = TextCodec(path)
V = codec.vocab_size
eos = codec.tok.token_to_id(codec.special_tokens.get("eos_token", "")) or 0
toks = [b"" if codec.is_special(i) and i != eos else codec.token_bytes(i) for i in range(V)]
schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
          "tags": {"type": "array", "items": {"type": "string"}}, "ok": {"type": "boolean"}},
          "required": ["name", "age", "tags", "ok"], "additionalProperties": False}
text = json.dumps({"name": "Ada Lovelace", "age": 36, "tags": ["math", "poetry", "engines"], "ok": True})
ids = codec.encode(text, add_special_tokens=False)
print("vocab", V, "tokens in sample", len(ids))
import xgrammar as xgr
t = time.perf_counter()
info = xgr.TokenizerInfo(toks, xgr.VocabType.RAW, vocab_size=V, stop_token_ids=[eos])
comp = xgr.GrammarCompiler(info, max_threads=1)
t1 = time.perf_counter(); g = comp.compile_json_schema(json.dumps(schema)); t2 = time.perf_counter()
print(f"xgrammar: tokenizer {t1-t:.3f}s compile schema {t2-t1:.3f}s")
m = xgr.GrammarMatcher(g); bm = xgr.allocate_token_bitmask(1, V)
ts = []
for tok in ids:
    a = time.perf_counter(); m.fill_next_token_bitmask(bm); ts.append(time.perf_counter() - a)
    assert m.accept_token(tok), tok
print(f"xgrammar: mask mean {1e6*sum(ts)/len(ts):.0f}us max {1e6*max(ts):.0f}us, accepting={m.is_terminated() or m.accept_token(eos)}")
import llguidance, llguidance.torch
from llguidance import LLMatcher, LLTokenizer, TokenizerWrapper
class G:
    eos_token_id = eos; bos_token_id = None; tokens = toks
    special_token_ids = [i for i in range(V) if codec.is_special(i)]
    def __call__(self, s): return codec.encode(s.decode() if isinstance(s, bytes) else s, add_special_tokens=False)
t = time.perf_counter()
lt = LLTokenizer(TokenizerWrapper(G()))
t1 = time.perf_counter(); grm = LLMatcher.grammar_from_json_schema(schema); lm = LLMatcher(lt, grm); t2 = time.perf_counter()
print(f"llguidance: tokenizer {t1-t:.3f}s compile schema {t2-t1:.3f}s err={lm.get_error()!r}")
bm2 = llguidance.torch.allocate_token_bitmask(1, lt.vocab_size)
ts = []
for tok in ids:
    a = time.perf_counter(); llguidance.torch.fill_next_token_bitmask(lm, bm2, 0); ts.append(time.perf_counter() - a)
    assert lm.consume_token(tok), (tok, lm.get_error())
print(f"llguidance: mask mean {1e6*sum(ts)/len(ts):.0f}us max {1e6*max(ts):.0f}us accepting={lm.is_accepting()}")
