"""POST /v1/embeddings in OpenAI's shape, as prefill-only rows through the scheduler.

    {"input": str | [str] | [int] | [[int]], "model"?, "encoding_format"?: "float"|"base64",
     "dimensions"?: int, "user"?: str}
    -> {"object": "list", "data": [{"object": "embedding", "index", "embedding"}], "model", "usage"}

Each input is one request with `SamplingParams(max_tokens=1, pooling=...)`: the
scheduler admits, chunks and publishes it like any row; the worker returns the pooled
final-norm hidden state with its one (ignored) sampled token, and the row ends
holding no pages. A cached prefix makes last-token pooling cheaper; mean/CLS adopt
nothing (they need every position).

Invariants: the vector is L2-normalized; `dimensions` keeps the first d components and
renormalizes (Matryoshka-style, as OpenAI's text-embedding-3); base64 is the float32
little-endian bytes the openai SDK decodes; every other field is a 400 naming it; an
input too long for the context is the same 400 as for generation.
"""
from __future__ import annotations

import base64
import json
import math
import os
from array import array
from dataclasses import dataclass
from typing import Any, Optional

from ferroxmp.frontend.openai import schemas
from ferroxmp.frontend.errors import bad_param
from ferroxmp.frontend.fields import Fields, check_names
from ferroxmp.frontend.text.prompts import PromptEncoder
from ferroxmp.protocol import SamplingParams, le_array, le_bytes

FIELDS = frozenset({"model", "input", "encoding_format", "dimensions", "user"})
MAX_INPUTS = 2048  # OpenAI's own limit per request


@dataclass
class EmbeddingRequest:
    model: Optional[str]
    inputs: list[list[int]]
    base64: bool
    dimensions: Optional[int]


def parse(body: Any, encoder: PromptEncoder, vocab_size: int, max_model_len: int) -> EmbeddingRequest:
    f = Fields(body)
    check_names(f.obj, FIELDS, {})
    raw = f.raw("input")
    limits = schemas.Limits(vocab_size, max_model_len)
    if raw is None:
        raise bad_param("input", "is required: a string, a list of strings, token ids or lists of them")
    if isinstance(raw, str) or (isinstance(raw, list) and raw and all(type(t) is int for t in raw)):
        raw = [raw]  # one input
    if not isinstance(raw, list) or not raw:
        raise bad_param("input", "must be a non-empty string, list of strings, token ids or lists of them")
    if len(raw) > MAX_INPUTS:
        raise bad_param("input", f"at most {MAX_INPUTS} inputs per request, got {len(raw)}")
    inputs = []
    for i, item in enumerate(raw):
        param = f"input[{i}]" if len(raw) > 1 else "input"
        if isinstance(item, str):
            if not item:
                raise bad_param(param, "must not be empty")
            ids = encoder.encode(item, param)
        else:
            ids = limits.token_ids(item, param)
            if not ids:
                raise bad_param(param, "must not be empty")
        inputs.append(ids)
    fmt = f.str("encoding_format", "float")
    if fmt not in ("float", "base64"):
        raise bad_param("encoding_format", f"must be 'float' or 'base64', got {fmt!r}")
    return EmbeddingRequest(f.str("model", max_len=1024), inputs, fmt == "base64",
                            f.int("dimensions", None, 1, 1 << 20))


def params(pooling: str) -> SamplingParams:
    # One greedy token: the row's prompt ends in a sampling step, whose result carries
    # the vector; the token itself is never shown.
    return SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, pooling=pooling)


def resolve_pooling(model_path: Optional[str], flag: str = "auto") -> str:
    """--pooling, or what a sentence-transformers checkpoint's modules.json points at
    (its Pooling module's config), else "last" (decoder embedding models)."""
    if flag != "auto":
        return flag
    if not model_path or not os.path.isdir(model_path):
        return "last"
    try:
        with open(os.path.join(model_path, "modules.json")) as fh:
            modules = json.load(fh)
        folder = next(m.get("path", "") for m in modules if str(m.get("type", "")).endswith("Pooling"))
        with open(os.path.join(model_path, folder, "config.json")) as fh:
            cfg = json.load(fh)
    except (OSError, ValueError, StopIteration, AttributeError, TypeError):
        return "last"
    for key, mode in (("pooling_mode_lasttoken", "last"), ("pooling_mode_mean_tokens", "mean"),
                      ("pooling_mode_cls_token", "cls")):
        if cfg.get(key) is True:
            return mode
    return "last"


def body(req: EmbeddingRequest, vectors: list[bytes], model_name: str, usage: dict) -> dict:
    data = []
    for i, raw in enumerate(vectors):
        v = le_array("f", raw)  # not numpy: the frontend stays without it (~10 MB resident)
        if req.dimensions is not None:
            if req.dimensions > len(v):
                raise bad_param("dimensions", f"this model's embeddings have {len(v)} dimensions; "
                                f"got {req.dimensions}")
            del v[req.dimensions:]
        norm = max(math.sqrt(math.fsum(x * x for x in v)), 1e-12)
        v = array("f", [x / norm for x in v])
        emb = base64.b64encode(le_bytes(v)).decode() if req.base64 else v.tolist()
        data.append({"object": "embedding", "index": i, "embedding": emb})
    prompt = usage["prompt_tokens"]
    return {"object": "list", "data": data, "model": model_name,
            "usage": {"prompt_tokens": prompt, "total_tokens": prompt}}
