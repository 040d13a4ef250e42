"""What vulture (tests/test_dead_code.py) reports as unused but is used, and why.

vulture reads names, not uses through strings, other libraries or protocols; every
entry here is such a use. A new report is either dead code (delete it) or a use of
this kind (add it here, with the reason).
"""
# ruff: noqa
from ferroxmp.checkpoint import gguf_tokenizer, text_codec
from ferroxmp import config, protocol, tiny_model
from ferroxmp.gpu_worker.sampling import grammar
from ferroxmp.gpu_worker.quant import fused_decode

# Attributes of a `tokenizers.Tokenizer` we build: the library reads them.
_.pre_tokenizer, _.normalizer, _.decoder, _.post_processor
# jinja2 reads an Extension's `tags` to know which block names it parses.
text_codec._GenerationTag.tags
# ServerArgs fields read by name from the launch arguments (args["disable_overlap"], ...).
config.ServerArgs.disable_overlap, config.ServerArgs.metrics_public, config.ServerArgs.reasoning_parser
# llguidance's tokenizer interface (LLTokenizer reads them from our adapter).
grammar._Vocab.bos_token_id, grammar._Vocab.special_token_ids
# Stats fields the frontend's metrics table reads by name (frontend/metrics.py).
protocol.Stats.generation_tokens, protocol.Stats.worker_busy_seconds, protocol.Stats.step_token_budget
protocol.Stats.kv_hit_tokens_pool
# The resource tracker's register(name, rtype) signature, replaced by a no-op.
rtype
# The layer array the ctypes struct of fused_decode.c points at (kept alive by this
# reference: ctypes holds only the address).
fused_decode.FusedDecode._layers
