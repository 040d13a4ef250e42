"""Request validation: an OpenAI (or native /generate) JSON body -> ApiRequest.

Invariants: every wrong type or out-of-range value raises ApiError(400) whose
`param` names the offending field exactly as the client spelled it (nested
fields as `stream_options.include_usage`, `sampling_params.top_p`); unknown
fields are ignored; JSON booleans never pass for numbers (Python's bool is an
int, the API's is not). Nothing here tokenizes: prompts stay text or ids, and
`sampling_for` turns the validated fields into SamplingParams once the prompt
length is known (chat's default max_tokens is the rest of the context).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

import msgspec

from ferroxmp.frontend.errors import bad_param
from ferroxmp.protocol import SamplingParams

MAX_LOGPROBS = 20
MAX_CHOICES = 128  # prompts x n in one request
MAX_STOPS = 16


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
    chat_extra: dict = field(default_factory=dict)  # tools / chat_template_kwargs for the template

    @property
    def prompt_param(self) -> str:
        return {"completion": "prompt", "chat": "messages", "generate": "input_ids"}[self.kind]

    def sampling_for(self, prompt_len: int, max_model_len: int, pool_tokens: Optional[int] = None) -> SamplingParams:
        """The SamplingParams for one prompt, refusing a request that can never fit. A
        default max_tokens is capped by the pool too, so it never causes a refusal."""
        if prompt_len < 1:
            raise bad_param(self.prompt_param, "the prompt is empty: it must hold at least one token")
        if prompt_len >= max_model_len:
            raise bad_param(self.prompt_param, f"the prompt has {prompt_len} tokens; this model's context "
                            f"holds {max_model_len} (prompt + completion): shorten the prompt")
        max_tokens = self.max_tokens
        if max_tokens is None:
            room = min(max_model_len, pool_tokens or max_model_len) - prompt_len
            max_tokens = max(1, room if self.kind == "chat" else min(16, room))
        elif prompt_len + max_tokens > max_model_len:
            raise bad_param("max_tokens", f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) "
                            f"exceeds the context of {max_model_len} tokens: lower max_tokens")
        return msgspec.structs.replace(self.sampling, max_tokens=max_tokens)


class _Fields:
    """Typed reads from one JSON object; errors name `prefix + key`."""

    def __init__(self, obj: Any, prefix: str = ""):
        if not isinstance(obj, dict):
            raise bad_param(prefix.rstrip(".") or "body", "must be a JSON object")
        self.obj, self.prefix = obj, prefix

    def has(self, key: str) -> bool:
        return self.obj.get(key) is not None

    def raw(self, key: str) -> Any:
        return self.obj.get(key)

    def name(self, key: str) -> str:
        return self.prefix + key

    def bool(self, key: str, default: bool = False) -> bool:
        v = self.obj.get(key)
        if v is None:
            return default
        if type(v) is not bool:
            raise bad_param(self.name(key), f"must be a boolean, got {v!r}")
        return v

    def int(self, key: str, default: Optional[int], lo: Optional[int] = None,
            hi: Optional[int] = None) -> Optional[int]:
        v = self.obj.get(key)
        if v is None:
            return default
        if type(v) is float and v.is_integer():
            v = int(v)
        if type(v) is not int:
            raise bad_param(self.name(key), f"must be an integer, got {v!r}")
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            bounds = f"[{'...' if lo is None else lo}, {'...' if hi is None else hi}]"
            raise bad_param(self.name(key), f"must be in {bounds}, got {v}")
        return v

    def float(self, key: str, default: float, lo: float = -math.inf, hi: float = math.inf,
              lo_open: bool = False) -> float:
        v = self.obj.get(key)
        if v is None:
            return default
        if type(v) not in (int, float) or not math.isfinite(v):
            raise bad_param(self.name(key), f"must be a number, got {v!r}")
        if v < lo or v > hi or (lo_open and v == lo):
            low = f"> {lo:g}" if lo_open else f">= {lo:g}"
            rule = low if hi == math.inf else f"{low} and <= {hi:g}"
            raise bad_param(self.name(key), f"must be {rule}, got {v}")
        return float(v)


def _token_ids(v: Any, param: str, vocab_size: int) -> list[int]:
    if not isinstance(v, list) or not all(type(t) is int for t in v):
        raise bad_param(param, "must be a list of integer token ids")
    for t in v:
        if not 0 <= t < vocab_size:
            raise bad_param(param, f"token id {t} is outside the vocabulary [0, {vocab_size})")
    return v


def _stops(f: _Fields) -> list[str]:
    v = f.raw("stop")
    if v is None:
        return []
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad_param(f.name("stop"), "must be a string or a list of strings")
    if len(stops) > MAX_STOPS:
        raise bad_param(f.name("stop"), f"at most {MAX_STOPS} stop strings, got {len(stops)}")
    return [s for s in stops if s]


def _sampling(f: _Fields, vocab_size: int) -> SamplingParams:
    top_k = f.int("top_k", 0, lo=-1)
    stop_ids = f.raw("stop_token_ids")
    return SamplingParams(
        temperature=f.float("temperature", 1.0, lo=0.0),
        top_p=f.float("top_p", 1.0, lo=0.0, hi=1.0, lo_open=True),
        top_k=0 if top_k == -1 else top_k,
        min_p=f.float("min_p", 0.0, lo=0.0, hi=1.0),
        seed=f.int("seed", None, lo=-(2 ** 63), hi=2 ** 63 - 1 - MAX_CHOICES),
        frequency_penalty=f.float("frequency_penalty", 0.0, lo=-2.0, hi=2.0),
        presence_penalty=f.float("presence_penalty", 0.0, lo=-2.0, hi=2.0),
        repetition_penalty=f.float("repetition_penalty", 1.0, lo=0.0, lo_open=True),
        stop_token_ids=[] if stop_ids is None else _token_ids(stop_ids, f.name("stop_token_ids"), vocab_size),
        ignore_eos=f.bool("ignore_eos"),
    )


def _common(f: _Fields, kind: str, prompts: list, vocab_size: int) -> ApiRequest:
    sampling = _sampling(f, vocab_size)
    max_tokens = f.int("max_completion_tokens", None, lo=1)
    max_tokens = f.int("max_tokens", max_tokens, lo=1)
    n = f.int("n", 1, lo=1, hi=MAX_CHOICES)
    if n * len(prompts) > MAX_CHOICES:
        raise bad_param(f.name("n"), f"prompts x n is {n * len(prompts)}; at most {MAX_CHOICES} per request")
    model = f.raw("model")
    if model is not None and not isinstance(model, str):
        raise bad_param("model", "must be a string")
    stream = f.bool("stream")
    include_usage = False
    if f.has("stream_options"):
        include_usage = _Fields(f.raw("stream_options"), "stream_options.").bool("include_usage")
    if f.has("user") and not isinstance(f.raw("user"), str):
        raise bad_param("user", "must be a string")
    return ApiRequest(kind=kind, prompts=prompts, sampling=sampling, max_tokens=max_tokens, n=n,
                      stop=_stops(f), stream=stream, include_usage=include_usage, model=model)


def parse_completion(body: Any, vocab_size: int) -> ApiRequest:
    f = _Fields(body)
    p = f.raw("prompt")
    if isinstance(p, str):
        prompts: list = [p]
    elif isinstance(p, list) and p and all(type(t) is int for t in p):
        prompts = [_token_ids(p, "prompt", vocab_size)]
    elif isinstance(p, list) and p and all(isinstance(x, str) for x in p):
        prompts = list(p)
    elif isinstance(p, list) and p and all(isinstance(x, list) for x in p):
        prompts = [_token_ids(x, "prompt", vocab_size) for x in p]
    else:
        raise bad_param("prompt", "must be a string, a list of token ids, or a non-empty list of either")
    req = _common(f, "completion", prompts, vocab_size)
    req.echo = f.bool("echo")
    lp = f.int("logprobs", None, lo=0, hi=MAX_LOGPROBS)
    req.sampling.logprobs = lp
    return req


def _message(m: Any, i: int) -> dict:
    param = f"messages[{i}]"
    if not isinstance(m, dict):
        raise bad_param(param, "must be an object with 'role' and 'content'")
    role = m.get("role")
    if not isinstance(role, str) or not role:
        raise bad_param(f"{param}.role", "must be a non-empty string")
    content = m.get("content")
    if isinstance(content, list):
        # Text parts are joined: templates expect a string, and images are not served.
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_param(f"{param}.content", "only text content parts are supported")
            texts.append(part["text"])
        content = "".join(texts)
    elif content is not None and not isinstance(content, str):
        raise bad_param(f"{param}.content", "must be a string or a list of text parts")
    if content is None and role != "assistant":
        raise bad_param(f"{param}.content", "is required for this role")
    return {**m, "content": content}


def parse_chat(body: Any, vocab_size: int) -> ApiRequest:
    f = _Fields(body)
    msgs = f.raw("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad_param("messages", "must be a non-empty list of messages")
    messages = [_message(m, i) for i, m in enumerate(msgs)]
    req = _common(f, "chat", [messages], vocab_size)
    want = f.bool("logprobs")
    top = f.int("top_logprobs", None, lo=0, hi=MAX_LOGPROBS)
    if top is not None and not want:
        raise bad_param("top_logprobs", "needs logprobs: true")
    req.sampling.logprobs = (top or 0) if want else None
    extra: dict = {}
    if f.has("tools"):
        if not isinstance(f.raw("tools"), list):
            raise bad_param("tools", "must be a list")
        extra["tools"] = f.raw("tools")
    if f.has("chat_template_kwargs"):
        if not isinstance(f.raw("chat_template_kwargs"), dict):
            raise bad_param("chat_template_kwargs", "must be an object")
        extra.update(f.raw("chat_template_kwargs"))
    extra["add_generation_prompt"] = f.bool("add_generation_prompt", True)
    req.chat_extra = extra
    return req


def parse_generate(body: Any, vocab_size: int) -> ApiRequest:
    f = _Fields(body)
    ids = f.raw("input_ids")
    if not isinstance(ids, list) or not ids:
        raise bad_param("input_ids", "must be a non-empty list of token ids")
    ids = _token_ids(ids, "input_ids", vocab_size)
    raw = f.raw("sampling_params")
    sp = _Fields({} if raw is None else raw, "sampling_params.")
    req = ApiRequest(kind="generate", prompts=[ids], sampling=_sampling(sp, vocab_size),
                     max_tokens=sp.int("max_tokens", None, lo=1), n=1, stream=f.bool("stream"))
    req.sampling.logprobs = sp.int("logprobs", None, lo=0, hi=MAX_LOGPROBS)
    return req
