"""--reasoning-parser: the thinking split from the answer, the same way in every dialect.

Unit level, the oracle is the text itself: for every chunking of a reply, the split
must equal `str.partition` at </think> (tags removed, blank lines after it dropped),
and tool calls must be parsed from the answer only. End to end (one server, a tiny
model whose template opens <think> unless `enable_thinking: false`), the oracle is the
raw greedy completion of the same prompt ids through /v1/completions: with thinking
on, all of it is reasoning (random weights never close the block); with it off, all of
it is the answer — on chat completions, Messages and Responses, streamed and not.
"""
from __future__ import annotations

import json
import os

import pytest
import requests

from ferroxmp.frontend.tools import parse as tool_parse
from ferroxmp.frontend.anthropic.messages import MessagesWriter
from ferroxmp.frontend.generation import Delta
from ferroxmp.frontend.text.reasoning import ReasoningSplitter
from ferroxmp.frontend.openai.replies import Formatter
from ferroxmp.frontend.openai.responses import ResponsesWriter, ResponseStore
from ferroxmp.tiny_model import make_reasoning_variant
from serverproc import serving

REPLY = "<think>\nI should call f.\n</think>\n\nSure. <tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1}}\n</tool_call>"
THINK, ANSWER = "\nI should call f.\n", "Sure. <tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1}}\n</tool_call>"


def _chunkings(text: str):
    yield [text]
    yield list(text)
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]


def _split(splitter: ReasoningSplitter, pieces: list[str]) -> tuple[str, str]:
    r = c = ""
    for p in pieces:
        a, b = splitter.feed(p)
        r, c = r + a, c + b
    a, b = splitter.finish()
    return r + a, c + b


@pytest.mark.parametrize("parser,tail,reply,want", [
    ("qwen3", "<|im_start|>assistant\n", REPLY, (THINK, ANSWER)),
    ("qwen3", "<|im_start|>assistant\n", "no thinking here", ("", "no thinking here")),
    ("deepseek-r1", "<|im_start|>assistant\n", "plan</think>\n\nanswer", ("plan", "answer")),
    ("qwen3", "assistant\n<think>\n", "plan</think>answer", ("plan", "answer")),
    ("qwen3", "assistant\n<think>\n\n</think>\n\n", "<think>x</think>y", ("", "<think>x</think>y")),
    ("qwen3", "<|im_start|>assistant\n", "<think>cut by max_tokens </thi", ("cut by max_tokens </thi", "")),
])
def test_every_chunking_splits_the_reply_at_the_closing_tag(parser, tail, reply, want):
    """A tag split across deltas must be held back, never leaked into either side."""
    for pieces in _chunkings(reply):
        assert _split(ReasoningSplitter.for_prompt(parser, tail), pieces) == want, pieces


def _deltas(pieces: list[str]) -> list[Delta]:
    """What Generation yields with a splitter: each delta's text split (generation.py)."""
    s = ReasoningSplitter.for_prompt("qwen3", "assistant\n")
    out = []
    for k, p in enumerate(pieces):
        r, t = s.feed(p)
        last = k == len(pieces) - 1
        if last:
            r2, t2 = s.finish()
            r, t = r + r2, t + t2
        out.append(Delta(0, t, [], "stop" if last else None, reasoning=r))
    return out


def _parser():
    return tool_parse.ToolParser(tool_parse.HERMES, frozenset({"f"}))


class _Gen:  # the counts the writers read from a Generation
    class _C:
        prompt_tokens, cached_tokens, n_tokens = 10, 0, 20

        class stop:
            matched = None
    choices = [_C()]


@pytest.mark.parametrize("size", [1, 3, 7, len(REPLY)])
def test_chat_streams_reasoning_content_apart_and_parses_tools_from_the_answer_only(size):
    """The thinking mentions f; parsing it would add a call or corrupt content."""
    pieces = [REPLY[i:i + size] for i in range(0, len(REPLY), size)]
    whole = Formatter("chat", "r", "m", None, tool_parser=_parser)
    for d in _deltas(pieces):
        whole.add(d)
    msg = whole.body({})["choices"][0]
    p = _parser()  # what the answer alone parses to: the thinking must add nothing
    want = "".join(e for e in p.feed(ANSWER) + p.finish() if isinstance(e, str))
    assert msg["message"]["reasoning_content"] == THINK and msg["message"]["content"] == want
    assert [c["function"]["name"] for c in msg["message"]["tool_calls"]] == ["f"]
    assert msg["finish_reason"] == "tool_calls"
    stream = Formatter("chat", "r", "m", None, tool_parser=_parser)
    chunks = [c for d in _deltas(pieces) for c in stream.chunks(d, False)]
    got = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("reasoning_content", "") for d in got) == THINK
    assert "".join(d.get("content") or "" for d in got) == want
    assert sum(len(d.get("tool_calls", [])) for d in got) == 2  # the call's header, then its arguments


def test_messages_and_responses_put_the_thinking_in_its_own_block_and_item():
    """Anthropic: a thinking block before text and tool_use; Responses: a reasoning item
    before the message and the function call; streamed deltas equal the stored text."""
    pieces = [REPLY[i:i + 4] for i in range(0, len(REPLY), 4)]
    m = MessagesWriter("m", "r", _parser)
    events = [e for d in _deltas(pieces) for e in m.delta(d)] + m.end(_Gen())
    body = m.body(_Gen())
    assert [b["type"] for b in body["content"]] == ["thinking", "text", "tool_use"]
    assert body["content"][0]["thinking"] == THINK and body["stop_reason"] == "tool_use"
    assert "".join(e["delta"]["thinking"] for e in events
                   if e["type"] == "content_block_delta" and e["delta"]["type"] == "thinking_delta") == THINK
    r = ResponsesWriter("m", "r", _parser, {"store": False}, [], ResponseStore())
    events = [e for d in _deltas(pieces) for e in r.delta(d)] + r.end(_Gen())
    out = r.output
    assert [o["type"] for o in out] == ["reasoning", "message", "function_call"]
    assert out[0]["content"][0]["text"] == THINK
    assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta") == THINK
    assert [e["type"] for e in events].count("response.output_item.done") == 3


# ---- end to end ---------------------------------------------------------------------------

MSGS = [{"role": "user", "content": "Think, then name a colour."}]


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    path = make_reasoning_variant(tiny_models["llama"], str(tmp_path_factory.mktemp("reasoning") / "think"))
    with serving(path, "--served-model-name", "think", "--reasoning-parser", "qwen3",
                 "--page-size", "4", "--kv-pages", "1024") as s:
        yield s


def _raw(server, thinking: bool) -> str:
    kw = {} if thinking else {"chat_template_kwargs": {"enable_thinking": False}}
    ids = requests.post(server.url + "/tokenize", json={"messages": MSGS, **kw}).json()["tokens"]
    r = requests.post(server.url + "/v1/completions", json={"prompt": ids, "max_tokens": 12, "temperature": 0})
    return r.json()["choices"][0]["text"]


@pytest.mark.parametrize("thinking", [True, False])
def test_chat_messages_and_responses_split_the_same_greedy_reply(server, thinking):
    """chat_template_kwargs must reach the template, and each dialect must put the
    reply on the side the prompt's open or closed think block says, streamed or not."""
    raw = _raw(server, thinking)
    assert raw.strip()
    kw = {} if thinking else {"chat_template_kwargs": {"enable_thinking": False}}
    body = {"messages": MSGS, "max_tokens": 12, "temperature": 0, **kw}
    msg = requests.post(server.url + "/v1/chat/completions", json=body).json()["choices"][0]["message"]
    want_r, want_c = (raw, "") if thinking else ("", raw)
    assert (msg.get("reasoning_content") or "", msg["content"] or "") == (want_r, want_c)
    lines = requests.post(server.url + "/v1/chat/completions", json={**body, "stream": True}, stream=True)
    deltas = [json.loads(x[6:])["choices"][0]["delta"] for x in lines.iter_lines(decode_unicode=True)
              if x.startswith("data: {")]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == want_r
    assert "".join(d.get("content") or "" for d in deltas) == want_c
    if not thinking:
        return  # the other dialects have no chat_template_kwargs
    a = requests.post(server.url + "/v1/messages", json={"max_tokens": 12, "messages": MSGS,
                                                         "temperature": 0}).json()
    assert [b["type"] for b in a["content"]] == ["thinking"] and a["content"][0]["thinking"] == raw
    r = requests.post(server.url + "/v1/responses", json={"input": MSGS, "max_output_tokens": 12,
                                                          "temperature": 0}).json()
    assert r["output"][0]["type"] == "reasoning" and r["output"][0]["content"][0]["text"] == raw


def test_a_grammar_waits_in_the_worker_until_the_thinking_ended(make_harness, tiny_models):
    """logit_bias +100 pushes a word token X, which a JSON object cannot start with. With
    grammar_after [X] the first token is X (no mask while thinking) and what follows is
    an object (the mask is on: unmasked, the bias would repeat X); without it the mask
    forbids X from the first token. A restarted row (retraction) replays only what
    followed the marker, so its grammar resumes where it was."""
    from tokenizers import Tokenizer
    from ferroxmp.protocol import Grammar, RowStep, SamplingParams
    path = tiny_models["llama"]
    tok = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    x = tok.encode("hello").ids[0]
    prompt = list(range(5, 25))

    def params(after):
        return SamplingParams(max_tokens=8, temperature=0.0, grammar=Grammar("json_object"),
                              logit_bias={x: 100.0}, grammar_after=after)
    out, _ = make_harness(path).generate({0: prompt}, 8, params=params([x]))
    thought = out[0]
    assert thought[0] == x
    assert tok.decode(thought[1:]).lstrip().startswith("{"), tok.decode(thought[1:])
    plain, _ = make_harness(path).generate({0: prompt}, 1, params=params([]))
    assert plain[0][0] != x
    from ferroxmp.protocol import NewRow, pack_ids, unpack_ids
    h = make_harness(path)
    row = NewRow(0, pack_ids(prompt + thought[:3]), params([x]), 0, len(prompt))
    h.run([row], [RowStep(0, 0, len(prompt) + 2, False)])
    assert h.runner.rows[0].grammar_on  # the marker is among the replayed tokens
    res = h.run([], [RowStep(0, len(prompt) + 2, 1, True)])
    assert unpack_ids(res.tokens).tolist() == [thought[3]]  # the uninterrupted row's next token


@pytest.mark.parametrize("stream", [False, True])
def test_json_output_is_enforced_after_the_thinking_not_during_it(server, stream):
    """With thinking open in the prompt, response_format must not constrain the thinking:
    the reasoning must equal the unconstrained greedy completion of the same prompt
    (random weights never close it, so the grammar never starts)."""
    raw = _raw(server, True)
    body = {"messages": MSGS, "max_tokens": 12, "temperature": 0, "response_format": {"type": "json_object"},
            "stream": stream}
    r = requests.post(server.url + "/v1/chat/completions", json=body, stream=stream)
    if stream:
        deltas = [json.loads(x[6:])["choices"][0]["delta"] for x in r.iter_lines(decode_unicode=True)
                  if x.startswith("data: {")]
        reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    else:
        reasoning = r.json()["choices"][0]["message"]["reasoning_content"]
    assert reasoning == raw
