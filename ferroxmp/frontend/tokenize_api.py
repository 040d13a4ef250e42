"""POST /tokenize and /detokenize in vLLM's shapes.

    /tokenize    {"prompt": str, "add_special_tokens"?: bool=true}
                 or {"messages": [...], "tools"?, "add_generation_prompt"?, "chat_template_kwargs"?}
                 -> {"tokens": [int], "count": int, "max_model_len": int}
    /detokenize  {"tokens": [int]} -> {"prompt": str}

Both take an optional "model" (checked by the app like /v1). Invariants: every other
field is a 400 naming it; messages are validated and rendered exactly as chat
completions does (the same template and encoder, so counts agree with usage); ids
are checked against the vocabulary; a prompt that cannot fit the context is the
same 400 as on /v1 (the encoder refuses it before tokenizing it all).
"""
from __future__ import annotations

from typing import Any

import jinja2

from ferroxmp.frontend.openai import schemas

from ferroxmp.frontend.tools import render as tool_render
from ferroxmp.frontend.errors import bad_param
from ferroxmp.frontend.fields import Fields, check_names
from ferroxmp.frontend.text.prompts import PromptEncoder

PROMPT_FIELDS = frozenset({"model", "prompt", "add_special_tokens"})
CHAT_FIELDS = frozenset({"model", "messages", "add_generation_prompt", "chat_template_kwargs", "tools"})
DETOKENIZE_FIELDS = frozenset({"model", "tokens"})


def tokenize(body: Any, encoder: PromptEncoder, vocab_size: int, max_model_len: int) -> tuple[dict, Any]:
    """-> (response body, the model the client named or None)."""
    f = Fields(body)
    if f.has("messages"):
        check_names(f.obj, CHAT_FIELDS, {})
        req = schemas.parse_chat(body, vocab_size, max_model_len)
        messages, tools = tool_render.template_inputs(req.prompts[0], req.tools, encoder.reads_tools)
        try:
            ids = encoder.encode_chat(messages, req.chat_extra, tools=tools)
        except (jinja2.TemplateError, TypeError, ValueError) as e:
            raise bad_param("messages", f"the chat template refused these messages: {e}") from None
    else:
        check_names(f.obj, PROMPT_FIELDS, {})
        prompt = f.str("prompt", max_len=2 ** 31)
        if prompt is None:
            raise bad_param("prompt", "is required (a string), or send 'messages'")
        ids = encoder.encode(prompt, "prompt", add_special_tokens=f.bool("add_special_tokens", True))
    return {"tokens": ids, "count": len(ids), "max_model_len": max_model_len}, f.str("model", max_len=1024)


def detokenize(body: Any, codec: Any, vocab_size: int) -> tuple[dict, Any]:
    f = Fields(body)
    check_names(f.obj, DETOKENIZE_FIELDS, {})
    raw = f.raw("tokens")
    if raw is None:
        raise bad_param("tokens", "is required: a list of token ids")
    ids = schemas.Limits(vocab_size).token_ids(raw, "tokens", what="ids")
    return {"prompt": codec.decode(ids, skip_special_tokens=False)}, f.str("model", max_len=1024)
