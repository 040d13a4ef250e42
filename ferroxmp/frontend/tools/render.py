"""What a chat template is given for a conversation with tools.

Job: turn validated messages and tools into the template's `messages` and `tools`, as
transformers' apply_chat_template would get them, or, for a template that never reads
`tools`, into plain messages that describe the tools in the Hermes format.

- Template with tools support: `tools` is passed as the jinja variable `tools` (the
  OpenAI tool dicts); an assistant message's `tool_calls[].function.arguments` that is
  a JSON object string is given as the object, as templates (Qwen's, Llama 3's) expect
  (they `tojson` it; a string would render quoted).
- Template without it (FALLBACK): the tools go into a system block in the Hermes format
  (the one this server's parser reads by default), assistant calls become
  `<tool_call>` text and tool results become `<tool_response>` user turns, so any
  template that renders role and content can carry the conversation.
"""
from __future__ import annotations

import copy
import json
from typing import Optional

from ferroxmp.frontend.tools.request import ToolSpec

FALLBACK_HEADER = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>")
FALLBACK_FOOTER = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def _arguments(args):
    """A JSON object string -> the object; anything else as sent."""
    if isinstance(args, str):
        try:
            obj = json.loads(args)
        except ValueError:
            return args
        return obj if isinstance(obj, dict) else args
    return args


def _with_object_arguments(messages: list[dict]) -> list[dict]:
    out = []
    for m in messages:
        if m.get("tool_calls"):
            m = copy.deepcopy(m)
            for c in m["tool_calls"]:
                c["function"]["arguments"] = _arguments(c["function"]["arguments"])
        out.append(m)
    return out


def _call_text(call: dict) -> str:
    fn = call["function"]
    args = _arguments(fn["arguments"])
    args_text = json.dumps(args, ensure_ascii=False) if isinstance(args, dict) else args
    return '<tool_call>\n{"name": ' + json.dumps(fn["name"]) + ', "arguments": ' + args_text + "}\n</tool_call>"


def fallback_messages(messages: list[dict], spec: Optional[ToolSpec]) -> list[dict]:
    """Plain role/content messages carrying the tools, calls and results as Hermes text."""
    out = []
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            parts = ([m["content"]] if m.get("content") else []) + [_call_text(c) for c in m["tool_calls"]]
            out.append({"role": "assistant", "content": "\n".join(parts)})
        elif m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"})
        else:
            out.append(dict(m))
    if spec is not None:
        block = FALLBACK_HEADER + "".join("\n" + json.dumps(t, ensure_ascii=False) for t in spec.tools) + FALLBACK_FOOTER
        if out and out[0]["role"] == "system":
            out[0]["content"] = (out[0]["content"] or "") + "\n\n" + block
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


def template_inputs(messages: list[dict], spec: Optional[ToolSpec], reads_tools: bool) -> tuple[list[dict], Optional[list]]:
    """(messages, tools) for the template: tools None when none are rendered by it."""
    uses_tools = spec is not None or any(m.get("tool_calls") or m["role"] == "tool" for m in messages)
    if not uses_tools:
        return messages, None
    if reads_tools:
        return _with_object_arguments(messages), (spec.tools if spec is not None else None)
    return fallback_messages(messages, spec), None
