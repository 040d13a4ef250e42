"""routing_text: the text of a request that the backend's prefix cache will see first.

The router does not apply the chat template (it has no tokenizer and backends
may differ), so it renders what decides the prompt's tokens, in order: each
chat message as role, content; a completion's prompt string; token ids as
decimal text. Two requests whose renderings share a prefix share a token prefix
on the backend as long as the chat template renders messages one after another,
which every template of the supported models does. Anything it cannot read (bad
JSON, an unknown shape) renders as "": no affinity, the backend answers the error.
"""
from __future__ import annotations

import json

_SEP_FIELD, _SEP_MSG = "\x1f", "\x1e"


def _content(content) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts: their text, in order
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def _ids(ids) -> str:
    return ",".join(str(i) for i in ids) if isinstance(ids, list) else ""


def routing_text(path: str, body: bytes) -> str:
    try:
        req = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return ""
    if not isinstance(req, dict):
        return ""
    if path.endswith("/chat/completions"):
        messages = req.get("messages")
        if not isinstance(messages, list):
            return ""
        return "chat:" + _messages(messages)
    if path.endswith("/completions"):
        prompt = req.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch: route by its first prompt
        return "text:" + prompt if isinstance(prompt, str) else "ids:" + _ids(prompt)
    if path == "/generate":
        return "ids:" + _ids(req.get("input_ids"))
    if path.startswith("/v1/messages"):  # Anthropic: the system prompt, then the messages
        system = req.get("system")
        head = _content(system) if isinstance(system, (str, list)) else ""
        return "messages:" + head + _SEP_MSG + _messages(req.get("messages"))
    if path == "/v1/responses":  # the instructions, then the input (a string or items)
        head = req.get("instructions") if isinstance(req.get("instructions"), str) else ""
        inp = req.get("input")
        return "responses:" + head + _SEP_MSG + (inp if isinstance(inp, str) else _messages(inp))
    if path == "/v1/embeddings":
        inp = req.get("input")
        return "embed:" + (inp if isinstance(inp, str) else "")
    return ""


def _messages(messages) -> str:
    if not isinstance(messages, list):
        return ""
    return "".join(f"{m.get('role')}{_SEP_FIELD}{_content(m.get('content'))}{_SEP_MSG}"
                   for m in messages if isinstance(m, dict))
