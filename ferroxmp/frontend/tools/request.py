"""The tool fields of a chat request: `tools`, `tool_choice`, `parallel_tool_calls` and
the `tool_calls` of assistant messages -> a ToolSpec, or an ApiError(400) naming the field.

Job: validate the shapes OpenAI defines, and for `required` or a named function build
the grammar that makes the reply exactly tool calls (the worker masks the rest), in the
format of the model's family (tools/grammar.py: llguidance Lark, each function's schema
embedded whole so `$defs`/`$ref` resolve): one call when parallel calls are off or a
function is named, else one or more. `auto` with parallel calls off is constrained too
(any text, then at most one call, then the end) unless the client sent its own grammar
or ignore_eos. The arguments validate against the chosen
function's `parameters`.

Invariants: a function name is OpenAI's `[A-Za-z0-9_-]{1,64}` and unique; a named
choice names an offered tool; a choice other than `none` needs tools; `required` or a
named choice cannot be combined with another grammar (response_format, regex, ebnf) or
`ignore_eos`; `parameters` describes an object and is not plainly unsatisfiable
(tools/schema.py); a schema the grammar engine cannot compile or proves unsatisfiable is a
400 naming its field.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Optional

from ferroxmp.frontend import structured
from ferroxmp.frontend.errors import bad_param
from ferroxmp.frontend.fields import Fields, check_names
from ferroxmp.frontend.tools import grammar as tool_grammar
from ferroxmp.frontend.tools import schema as tool_schema
from ferroxmp.frontend.tools.parse import LLAMA3_JSON
from ferroxmp.protocol import Grammar

MAX_TOOLS = 128
TOOL_FIELDS = ("tools", "tool_choice", "parallel_tool_calls")
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_CHOICES = ("none", "auto", "required")
NO_PARAMETERS = {"type": "object", "properties": {}}  # OpenAI: omitted `parameters` = an empty list


@dataclass
class ToolSpec:
    tools: list[dict]  # as the client sent them (normalised): what the template renders
    choice: str = "auto"  # none | auto | required | named
    named: Optional[str] = None  # the function a named choice forces
    parallel: bool = True
    free: bool = True  # no client grammar and no ignore_eos: an auto reply may be constrained

    @property
    def names(self) -> frozenset:
        return frozenset(t["function"]["name"] for t in self.tools)

    @property
    def forces(self) -> bool:
        """The reply must be tool calls (`required` or a named function)."""
        return self.choice in ("required", "named")

    @property
    def constrains(self) -> bool:
        """A grammar applies: a forced call, or `auto` with parallel calls off (text, then
        at most one call, then the end: later calls are never generated)."""
        return self.forces or (self.choice == "auto" and not self.parallel and self.free)

    @property
    def parses(self) -> bool:
        """Whether the reply is searched for calls (`none`: it is plain content)."""
        return self.choice != "none"

    @property
    def max_calls(self) -> Optional[int]:
        return None if self.parallel and self.choice != "named" else 1

    def params(self, name: str) -> dict:
        return next(t["function"].get("parameters") or NO_PARAMETERS for t in self.tools
                    if t["function"]["name"] == name)

    def grammar(self, fmt: str) -> Optional[Grammar]:
        """The constraint for `required` / a named choice (None otherwise): Lark for
        llguidance, each function's schema embedded whole (tools/grammar.py)."""
        if not self.constrains:
            return None
        chosen = [self.named] if self.choice == "named" else sorted(self.names)
        if not self.forces and fmt == LLAMA3_JSON:
            return None  # the family writes one call as the whole reply: nothing to bound
        text = tool_grammar.lark(fmt, [(n, self.params(n)) for n in chosen], self.max_calls == 1,
                                 text_first=not self.forces)
        why = tool_grammar.engine_error(text)
        if why is not None:  # name the tool: check each chosen schema alone
            for i, t in enumerate(self.tools):
                name = t["function"]["name"]
                if name in chosen and tool_grammar.engine_error(tool_grammar.lark(fmt, [(name, self.params(name))], True)):
                    raise bad_param(f"tools[{i}].function.parameters",
                                    f"not a JSON schema the grammar engine accepts: {why}")
            raise bad_param("tools", f"the tool-call grammar does not compile: {why}")
        return Grammar("lark", text)


def parse(f: Fields, grammar: Optional[Grammar], grammar_field: Optional[str], ignore_eos: bool) -> Optional[ToolSpec]:
    """The request's ToolSpec (None: no tools), validated."""
    tools = _tools(f)
    choice, named = _choice(f, tools)
    parallel = f.bool("parallel_tool_calls", True)
    if not tools:
        return None
    spec = ToolSpec(tools, choice, named, parallel, free=grammar is None and not ignore_eos)
    if spec.forces and grammar is not None:
        raise bad_param(f.name(grammar_field or "response_format"), f"cannot be combined with tool_choice "
                        f"'{choice if choice != 'named' else named}': that already constrains the reply")
    if spec.forces and ignore_eos:
        raise bad_param(f.name("ignore_eos"), "cannot be used with a required or named tool_choice: the "
                        "reply must end where the tool calls do")
    return spec


def _tools(f: Fields) -> list[dict]:
    raw = f.raw("tools")
    if raw is None:
        return []
    if not isinstance(raw, list) or len(raw) > MAX_TOOLS:
        raise bad_param(f.name("tools"), f"must be a list of at most {MAX_TOOLS} tools")
    out, seen = [], set()
    for i, t in enumerate(raw):
        tf = Fields(t, f"tools[{i}].")
        check_names(tf.obj, frozenset({"type", "function"}), {}, tf.prefix)
        if tf.raw("type") != "function":
            raise bad_param(tf.name("type"), f"{tf.raw('type')!r:.40} is not supported; only 'function'")
        fn = Fields(tf.raw("function"), tf.name("function") + ".")
        check_names(fn.obj, frozenset({"name", "description", "parameters", "strict"}), {}, fn.prefix)
        name = fn.str("name", max_len=64)
        if name is None or not _NAME.match(name):
            raise bad_param(fn.name("name"), "is required: 1 to 64 letters, digits, '_' or '-'")
        if name in seen:
            raise bad_param(fn.name("name"), f"the function '{name}' is defined twice")
        seen.add(name)
        func: dict[str, Any] = {"name": name}
        desc = fn.str("description", max_len=structured.MAX_SPEC_CHARS)
        if desc is not None:
            func["description"] = desc
        params = fn.raw("parameters")
        if params is not None:
            why = tool_schema.check(params)
            if why is not None:
                raise bad_param(fn.name("parameters"), why)
            text = json.dumps(params)
            if len(text) > structured.MAX_SPEC_CHARS:
                raise bad_param(fn.name("parameters"), f"at most {structured.MAX_SPEC_CHARS} characters of JSON")
            why = structured.schema_bounds_error(text)  # the bounds response_format has
            if why is not None:
                raise bad_param(fn.name("parameters"), why)
            func["parameters"] = params
        fn.bool("strict")  # a constrained call always follows the schema; an auto one is parsed as written
        out.append({"type": "function", "function": func})
    return out


def _choice(f: Fields, tools: list[dict]) -> tuple[str, Optional[str]]:
    raw = f.raw("tool_choice")
    if raw is None:
        return ("auto" if tools else "none"), None
    if isinstance(raw, str):
        if raw not in _CHOICES:
            raise bad_param(f.name("tool_choice"), f"{raw!r:.40} is not one of {', '.join(_CHOICES)} or "
                            "{'type': 'function', 'function': {'name': ...}}")
        if raw != "none" and not tools:
            raise bad_param(f.name("tool_choice"), f"'{raw}' needs a non-empty 'tools' list")
        return raw, None
    cf = Fields(raw, f.name("tool_choice") + ".")
    check_names(cf.obj, frozenset({"type", "function"}), {}, cf.prefix)
    if cf.raw("type") != "function":
        raise bad_param(cf.name("type"), "must be 'function'")
    fn = Fields(cf.raw("function"), cf.name("function") + ".")
    check_names(fn.obj, frozenset({"name"}), {}, fn.prefix)
    name = fn.str("name", max_len=64)
    names = {t["function"]["name"] for t in tools}
    if name is None or name not in names:
        raise bad_param(fn.name("name"), f"{name!r:.70} is not one of the tools offered "
                        f"({', '.join(sorted(names)) or 'none'})")
    return "named", name


def message_tool_calls(raw: Any, param: str) -> list[dict]:
    """An assistant message's `tool_calls`, as OpenAI sends them back: arguments a JSON
    string (an object is accepted as is)."""
    if not isinstance(raw, list):
        raise bad_param(param, "must be a list of {'id', 'type': 'function', 'function': {'name', 'arguments'}}")
    out = []
    for j, c in enumerate(raw):
        cf = Fields(c, f"{param}[{j}].")
        check_names(cf.obj, frozenset({"id", "type", "function", "index"}), {}, cf.prefix)
        if cf.raw("type") not in (None, "function"):
            raise bad_param(cf.name("type"), "must be 'function'")
        fn = Fields(cf.raw("function"), cf.name("function") + ".")
        check_names(fn.obj, frozenset({"name", "arguments"}), {}, fn.prefix)
        name = fn.str("name", max_len=64)
        if name is None:
            raise bad_param(fn.name("name"), "is required")
        args = fn.raw("arguments")
        if args is not None and not isinstance(args, (str, dict)):
            raise bad_param(fn.name("arguments"), "must be a JSON string (or an object)")
        call: dict[str, Any] = {"type": "function", "function": {"name": name, "arguments": args or "{}"}}
        if cf.has("id"):
            call["id"] = cf.str("id")
        out.append(call)
    return out
