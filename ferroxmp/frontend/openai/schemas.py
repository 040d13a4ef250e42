"""Request validation: an OpenAI (or native /generate) JSON body -> ApiRequest.

Invariants: every wrong type, out-of-range value, unknown field, unknown chat
role or unsupported content part raises ApiError(400) whose `param` names the
offending field exactly as the client spelled it (nested fields as
`stream_options.include_usage`, `sampling_params.top_p`, `messages[2].role`), and
whose message names the bound it broke. Every numeric parameter has both bounds,
so nothing the worker cannot compute (a top_k of 2^63) passes. Nothing here
tokenizes: prompts stay text or ids, and `sampling_for` turns the validated
fields into SamplingParams once the prompt length is known (chat's default
max_tokens is the rest of the context).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import msgspec

from ferroxmp.fits import context_refusal
from ferroxmp.frontend.errors import bad_param
from ferroxmp.frontend import structured
from ferroxmp.frontend.tools import request as tool_request
from ferroxmp.frontend.fields import Fields, check_names
from ferroxmp.frontend.tools.parse import HERMES
from ferroxmp.protocol import SamplingParams

MAX_LOGPROBS = 20
MAX_CHOICES = 128  # prompts x n in one request
MAX_STOPS = 16
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 256
MAX_MESSAGES = 8192
MAX_TEMPERATURE = 100.0
MAX_REPETITION_PENALTY = 10.0
MAX_SALT_CHARS = 256
MAX_TOKENS_CAP = 2 ** 31 - 1  # when the context is not known here; sampling_for checks it
SEED_RANGE = (-(2 ** 63), 2 ** 63 - 1 - MAX_CHOICES)  # int64 in the worker; choice i uses seed + i
ROLES = ("system", "developer", "user", "assistant", "tool")
# Names the chat template is called with or relies on: a client may not replace them.
RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "add_generation_prompt", "tools", "self",
                                      "raise_exception", "strftime_now"})

_SAMPLING = frozenset({"temperature", "top_p", "top_k", "min_p", "seed", "frequency_penalty",
                       "presence_penalty", "repetition_penalty", "stop_token_ids", "ignore_eos",
                       "logit_bias", "min_tokens"})
_OPENAI = _SAMPLING | {"model", "max_tokens", "max_completion_tokens", "n", "stop", "stream", "stream_options",
                       "user", "cache_salt", "response_format", "regex", "ebnf"}
COMPLETION_FIELDS = _OPENAI | {"prompt", "echo", "logprobs"}
CHAT_FIELDS = _OPENAI | {"messages", "logprobs", "top_logprobs", "chat_template_kwargs", "add_generation_prompt",
                         *tool_request.TOOL_FIELDS}
GENERATE_FIELDS = frozenset({"input_ids", "sampling_params", "stream", "cache_salt", "model"})
GENERATE_SAMPLING_FIELDS = _SAMPLING | {"max_tokens", "logprobs"}
MESSAGE_FIELDS = frozenset({"role", "content", "name", "tool_calls", "tool_call_id"})
# Known OpenAI/vLLM fields this server does not implement yet -> the value that asks for nothing.
NOT_YET = {"best_of": 1, "suffix": "",
           "functions": [],
           "function_call": "none", "store": False, "metadata": object(), "service_tier": object(),
           "modalities": ["text"], "audio": object(), "prediction": object(), "reasoning_effort": object(),
           "web_search_options": object(), "guided_json": object(), "guided_regex": object(),
           "guided_choice": object(), "guided_grammar": object(), "structured_outputs": object()}


@dataclass
class ApiRequest:
    kind: str  # "completion" | "chat" | "generate"
    prompts: list[Any]  # completion: str or list[int] each; chat: [messages]; generate: [ids]
    sampling: SamplingParams  # max_tokens unresolved here; see sampling_for
    max_tokens: Optional[int] = None  # None: the endpoint's default
    n: int = 1
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    echo: bool = False
    model: Optional[str] = None
    cache_salt: str = ""  # the client's; the tenant's identity is added by the app
    chat_extra: dict = field(default_factory=dict)  # chat_template_kwargs for the template
    tools: Optional[tool_request.ToolSpec] = None  # chat: tools, tool_choice, parallel_tool_calls

    @property
    def prompt_param(self) -> str:
        return {"completion": "prompt", "chat": "messages", "generate": "input_ids"}[self.kind]

    def sampling_for(self, prompt_len: int, max_model_len: int, pool_tokens: Optional[int] = None) -> SamplingParams:
        """The SamplingParams for one prompt, refusing a request that can never fit. A
        default max_tokens is capped by the pool too, so it never causes a refusal."""
        if prompt_len < 1:
            raise bad_param(self.prompt_param, "the prompt is empty: it must hold at least one token")
        if (why := context_refusal(prompt_len, None, max_model_len)) is not None:
            raise bad_param(self.prompt_param, why)
        max_tokens = self.max_tokens
        if max_tokens is None:
            room = min(max_model_len, pool_tokens or max_model_len) - prompt_len
            max_tokens = max(1, room if self.kind == "chat" else min(16, room))
        elif (why := context_refusal(prompt_len, max_tokens, max_model_len)) is not None:
            raise bad_param("max_tokens", why)
        if self.sampling.min_tokens > max_tokens:
            raise bad_param("min_tokens", f"min_tokens ({self.sampling.min_tokens}) exceeds max_tokens "
                            f"({max_tokens})")
        return msgspec.structs.replace(self.sampling, max_tokens=max_tokens)


@dataclass
class Limits:
    """What bounds depend on: the model's vocabulary and context."""
    vocab_size: int
    max_model_len: Optional[int] = None

    @property
    def max_tokens(self) -> int:
        return MAX_TOKENS_CAP if self.max_model_len is None else self.max_model_len - 1

    def token_ids(self, v: Any, param: str, what: str = "prompt") -> list[int]:
        if not isinstance(v, list) or not all(type(t) is int for t in v):
            raise bad_param(param, "must be a list of integer token ids")
        if what == "prompt" and self.max_model_len is not None and (
                why := context_refusal(len(v), None, self.max_model_len)) is not None:
            raise bad_param(param, why)
        if what == "stop" and len(v) > MAX_STOP_TOKEN_IDS:
            raise bad_param(param, f"at most {MAX_STOP_TOKEN_IDS} token ids, got {len(v)}")
        for t in v:
            if not 0 <= t < self.vocab_size:
                raise bad_param(param, f"token id {t if -2**64 < t < 2**64 else '(huge)'} is outside the "
                                f"vocabulary [0, {self.vocab_size})")
        return v


def _stops(f: Fields) -> list[str]:
    v = f.raw("stop")
    if v is None:
        return []
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad_param(f.name("stop"), "must be a string or a list of strings")
    if len(stops) > MAX_STOPS or any(len(s) > MAX_STOP_CHARS for s in stops):
        raise bad_param(f.name("stop"), f"at most {MAX_STOPS} stop strings of at most {MAX_STOP_CHARS} "
                        f"characters each")
    return [s for s in stops if s]


def _sampling(f: Fields, lim: Limits) -> SamplingParams:
    top_k = f.int("top_k", 0, lo=-1, hi=lim.vocab_size, hi_is="the vocabulary size; -1 or 0: off")
    stop_ids = f.raw("stop_token_ids")
    return SamplingParams(
        temperature=f.float("temperature", 1.0, lo=0.0, hi=MAX_TEMPERATURE),
        top_p=f.float("top_p", 1.0, lo=0.0, hi=1.0, lo_open=True),
        top_k=0 if top_k == -1 else top_k,
        min_p=f.float("min_p", 0.0, lo=0.0, hi=1.0),
        seed=f.int("seed", None, *SEED_RANGE, hi_is="int64 less n"),
        frequency_penalty=f.float("frequency_penalty", 0.0, lo=-2.0, hi=2.0),
        presence_penalty=f.float("presence_penalty", 0.0, lo=-2.0, hi=2.0),
        repetition_penalty=f.float("repetition_penalty", 1.0, lo=0.0, hi=MAX_REPETITION_PENALTY, lo_open=True),
        stop_token_ids=[] if stop_ids is None else lim.token_ids(stop_ids, f.name("stop_token_ids"), "stop"),
        ignore_eos=f.bool("ignore_eos"),
        logit_bias=structured.logit_bias(f, lim.vocab_size),
        min_tokens=f.int("min_tokens", 0, lo=0, hi=lim.max_tokens, hi_is="max_tokens"),
    )


def _common(f: Fields, kind: str, prompts: list, lim: Limits) -> ApiRequest:
    sampling = _sampling(f, lim)
    sampling.grammar = structured.grammar(f)
    if sampling.grammar is not None and sampling.ignore_eos:
        raise bad_param(f.name("ignore_eos"), "cannot be used with a grammar: the row must end where "
                        "the grammar does")
    hi_is = "the context length" if lim.max_model_len else ""
    max_tokens = f.int("max_completion_tokens", None, lo=1, hi=lim.max_tokens, hi_is=hi_is)
    max_tokens = f.int("max_tokens", max_tokens, lo=1, hi=lim.max_tokens, hi_is=hi_is)
    n = f.int("n", 1, lo=1, hi=MAX_CHOICES)
    if n * len(prompts) > MAX_CHOICES:
        raise bad_param(f.name("n"), f"prompts x n is {n * len(prompts)}; at most {MAX_CHOICES} per request")
    include_usage = False
    if f.has("stream_options"):
        opts = Fields(f.raw("stream_options"), "stream_options.")
        check_names(opts.obj, frozenset({"include_usage"}), {}, "stream_options.")
        include_usage = opts.bool("include_usage")
    f.str("user", max_len=1024)  # OpenAI's abuse-monitoring id: nothing to do with it here
    return ApiRequest(kind=kind, prompts=prompts, sampling=sampling, max_tokens=max_tokens, n=n,
                      stop=_stops(f), stream=f.bool("stream"), include_usage=include_usage,
                      model=f.str("model", max_len=1024), cache_salt=f.str("cache_salt", "", MAX_SALT_CHARS))


def parse_completion(body: Any, vocab_size: int, max_model_len: Optional[int] = None) -> ApiRequest:
    lim = Limits(vocab_size, max_model_len)
    f = Fields(body)
    check_names(f.obj, COMPLETION_FIELDS, NOT_YET)
    p = f.raw("prompt")
    if isinstance(p, str):
        prompts: list = [p]
    elif isinstance(p, list) and p and all(type(t) is int for t in p):
        prompts = [lim.token_ids(p, "prompt")]
    elif isinstance(p, list) and 0 < len(p) <= MAX_CHOICES and all(isinstance(x, str) for x in p):
        prompts = list(p)
    elif isinstance(p, list) and 0 < len(p) <= MAX_CHOICES and all(isinstance(x, list) for x in p):
        prompts = [lim.token_ids(x, "prompt") for x in p]
    else:
        raise bad_param("prompt", f"must be a string, a list of token ids, or a list of 1 to {MAX_CHOICES} of either")
    req = _common(f, "completion", prompts, lim)
    req.echo = f.bool("echo")
    req.sampling.logprobs = f.int("logprobs", None, lo=0, hi=MAX_LOGPROBS)
    if req.echo:  # echoed prompt tokens get their logprobs too (the scheduler skips adoption)
        req.sampling.prompt_logprobs = req.sampling.logprobs
    return req


def _content(v: Any, param: str) -> Optional[str]:
    if v is None or isinstance(v, str):
        return v
    if not isinstance(v, list):
        raise bad_param(param, "must be a string or a list of text parts")
    texts = []  # text parts are joined: templates expect a string, and images are not served
    for j, part in enumerate(v):
        pf = Fields(part, f"{param}[{j}].")
        kind = pf.raw("type")
        if kind != "text":
            raise bad_param(pf.name("type"), f"content part type {kind!r:.40} is not supported; only 'text'")
        check_names(pf.obj, frozenset({"type", "text"}), {}, pf.prefix)
        texts.append(pf.str("text", "", max_len=2 ** 31))
    return "".join(texts)


def _message(m: Any, i: int) -> dict:
    f = Fields(m, f"messages[{i}].")
    check_names(f.obj, MESSAGE_FIELDS, {}, f.prefix)
    role = f.raw("role")
    if not isinstance(role, str) or role not in ROLES:
        raise bad_param(f.name("role"), f"role {role!r:.40} is not one of {', '.join(ROLES)}")
    content = _content(f.raw("content"), f.name("content"))
    if content is None and role != "assistant":
        raise bad_param(f.name("content"), f"is required for the role '{role}'")
    msg = {"role": role, "content": content}
    for key in ("name", "tool_call_id"):
        if f.has(key):
            msg[key] = f.str(key)
    if f.has("tool_calls"):
        if role != "assistant":
            raise bad_param(f.name("tool_calls"), "only an assistant message has tool_calls")
        msg["tool_calls"] = tool_request.message_tool_calls(f.raw("tool_calls"), f.name("tool_calls"))
    return msg


def parse_chat(body: Any, vocab_size: int, max_model_len: Optional[int] = None,
               tool_format: str = HERMES) -> ApiRequest:
    """`tool_format`: the model family's tool-call format (tools.format_for_template), which
    the grammar of a required or named tool_choice follows."""
    lim = Limits(vocab_size, max_model_len)
    f = Fields(body)
    check_names(f.obj, CHAT_FIELDS, NOT_YET)
    msgs = f.raw("messages")
    if not isinstance(msgs, list) or not 0 < len(msgs) <= MAX_MESSAGES:
        raise bad_param("messages", f"must be a list of 1 to {MAX_MESSAGES} messages")
    messages = [_message(m, i) for i, m in enumerate(msgs)]
    req = _common(f, "chat", [messages], lim)
    want = f.bool("logprobs")
    top = f.int("top_logprobs", None, lo=0, hi=MAX_LOGPROBS)
    if top is not None and not want:
        raise bad_param("top_logprobs", "needs logprobs: true")
    req.sampling.logprobs = (top or 0) if want else None
    grammar_field = next((n for n in structured.GRAMMAR_FIELDS if f.has(n)), None)
    req.tools = tool_request.parse(f, req.sampling.grammar, grammar_field, req.sampling.ignore_eos)
    if req.tools is not None and req.tools.constrains:
        req.sampling.grammar = req.tools.grammar(tool_format)
    extra: dict = {}
    if f.has("chat_template_kwargs"):
        kw = Fields(f.raw("chat_template_kwargs"), "chat_template_kwargs.")
        for name in kw.obj:
            if name in RESERVED_TEMPLATE_KWARGS:
                raise bad_param(kw.name(name), f"'{name}' is set by the server and cannot be passed to the "
                                "template" + (" (use the top-level field)" if name in CHAT_FIELDS else ""))
        extra.update(kw.obj)
    extra["add_generation_prompt"] = f.bool("add_generation_prompt", True)
    req.chat_extra = extra
    return req


def parse_generate(body: Any, vocab_size: int, max_model_len: Optional[int] = None) -> ApiRequest:
    lim = Limits(vocab_size, max_model_len)
    f = Fields(body)
    check_names(f.obj, GENERATE_FIELDS, {})
    ids = f.raw("input_ids")
    if not isinstance(ids, list) or not ids:
        raise bad_param("input_ids", "must be a non-empty list of token ids")
    ids = lim.token_ids(ids, "input_ids")
    sp = Fields({} if f.raw("sampling_params") is None else f.raw("sampling_params"), "sampling_params.")
    check_names(sp.obj, GENERATE_SAMPLING_FIELDS, {}, sp.prefix)
    req = ApiRequest(kind="generate", prompts=[ids], sampling=_sampling(sp, lim),
                     max_tokens=sp.int("max_tokens", None, lo=1, hi=lim.max_tokens, hi_is="the context length"),
                     n=1, stream=f.bool("stream"),
                     cache_salt=f.str("cache_salt", "", MAX_SALT_CHARS), model=f.str("model", max_len=1024))
    req.sampling.logprobs = sp.int("logprobs", None, lo=0, hi=MAX_LOGPROBS)
    return req
