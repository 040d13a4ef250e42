"""Text handling of the frontend: incremental detokenizer, stop strings, chat template.

Oracles: `tokenizers`' decode of the whole id list, `str.find` on the whole text,
and transformers' `apply_chat_template` on the same checkpoint folder.
"""
from __future__ import annotations

import json
import os
import random
import shutil

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from ferroxmp.frontend.text.detokenizer import Detokenizer, StopMatcher
from ferroxmp.frontend.text.tokenizer import TextCodec

MULTIBYTE = [
    "Héllo wörld, ça va? Ünïcödé",
    "漢字かな交じり文 と 한국어 텍스트",
    "emoji 🙂🚀👩‍👩‍👧 and flags 🇫🇷🇯🇵",
    "math ∀x∈ℝ: x² ≥ 0 → ∎, arrows ⇒ ⇔",
    "mixed: def f(x):\n    return 'ß' * x  # ≠ 🐍\n",
]


@pytest.fixture(scope="module")
def codec(tiny_models) -> TextCodec:
    return TextCodec(tiny_models["llama"])


def _stream(codec: TextCodec, ids: list[int], sizes: list[int]) -> list[str]:
    d = Detokenizer(codec.decode)
    chunks, i, k = [], 0, 0
    while i < len(ids):
        step = sizes[k % len(sizes)]
        chunks.append(d.feed(ids[i:i + step]))
        i, k = i + step, k + 1
    chunks.append(d.finish())
    return chunks


@pytest.mark.parametrize("text", MULTIBYTE)
@pytest.mark.parametrize("sizes", [[1], [2], [3, 1], [5]])
def test_streamed_multibyte_text_never_shows_a_replacement_character(codec, text, sizes):
    """A character split over tokens must be held back, not emitted as U+FFFD and then
    'fixed': the full decode has no U+FFFD, so any in a chunk is a leak."""
    ids = codec.encode(text)
    chunks = _stream(codec, ids, sizes)
    assert all("\ufffd" not in c for c in chunks), chunks
    assert "".join(chunks) == codec.decode(ids) == text


def test_random_ids_stream_to_exactly_the_full_decode(codec):
    """Arbitrary id sequences (invalid UTF-8, specials, lone continuation bytes): every
    emitted prefix is a prefix of the full decode and the whole equals it, so nothing is
    dropped, duplicated or replaced mid-stream."""
    rng = random.Random(1234)
    for _ in range(300):
        ids = [rng.randrange(codec.vocab_size) for _ in range(rng.randrange(1, 40))]
        full = codec.decode(ids)
        d, seen = Detokenizer(codec.decode), ""
        for t in ids:
            seen += d.feed([t])
            d.check_integrity()
            assert full.startswith(seen), (ids, seen, full)
        seen += d.finish()
        assert seen == full, ids


def test_detokenizer_with_prompt_context_emits_only_the_generated_text(codec):
    """The prompt tail gives context but is never emitted: output == decode(prompt+out)
    minus decode(prompt)."""
    prompt, out = codec.encode("The answer is"), codec.encode(" forty-two 🙂 ok")
    d = Detokenizer.with_context(codec.decode, prompt[-4:])
    text = "".join(d.feed([t]) for t in out) + d.finish()
    assert text == codec.decode(prompt + out)[len(codec.decode(prompt)):] == " forty-two 🙂 ok"


def test_each_step_decodes_a_bounded_window(codec):
    """O(new tokens) per step: the decoded windows stay short however long the text is
    (a whole-text re-decode would grow linearly)."""
    calls: list[int] = []

    def decode(ids):
        calls.append(len(ids))
        return codec.decode(ids)

    ids = codec.encode("lorem ipsum dolor sit amet 漢字 " * 60)
    d = Detokenizer(decode)
    for t in ids:
        d.feed([t])
    assert len(ids) > 200 and max(calls) <= 8


def test_token_bytes_concatenate_to_the_utf8_text(codec):
    """Logprob `bytes` must be the token's real bytes, even for half a character."""
    for text in MULTIBYTE:
        assert b"".join(codec.token_bytes(t) for t in codec.encode(text)) == text.encode("utf-8")


# ---- stop strings ------------------------------------------------------------------

def _run_stops(stops, chunks):
    m, out = StopMatcher(list(stops)), []
    for c in chunks:
        out.append(m.feed(c))
        m.check_integrity()
        if m.stopped:
            break
    out.append(m.finish())
    return m, out


@pytest.mark.parametrize("split", range(1, 24))
def test_a_stop_string_split_across_chunks_is_found_and_trimmed(split):
    """A matcher that looks only inside each chunk misses a stop split at any of these points."""
    text = "alpha beta gamma delta epsilon"
    m, out = _run_stops(["ta ga"], [text[:split], text[split:]])
    assert m.stopped and m.matched == "ta ga"
    assert "".join(out) == "alpha be"


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet="abc ", max_size=40), stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=4),
       max_size=3), cuts=st.lists(st.integers(0, 40), max_size=8))
@example(text="baa", stops=["a", "baa"], cuts=[2])  # a longer stop starting before a shorter one's hit
def test_stop_matching_equals_searching_the_whole_text(text, stops, cuts):
    """Oracle: the earliest occurrence of any stop in the whole text. Streaming must
    release exactly the text before it, and never release text that is later trimmed."""
    bounds = sorted({0, len(text), *[min(c, len(text)) for c in cuts]})
    chunks = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    hits = [text.find(s) for s in stops if s in text]
    expected = text[:min(hits)] if hits else text
    m, out = _run_stops(stops, chunks)
    released = ""
    for piece in out:
        released += piece
        assert expected.startswith(released)
    assert released == expected and m.stopped == bool(hits)


# ---- chat template -----------------------------------------------------------------

CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Wie geht's? 漢字"},
     {"role": "assistant", "content": "Gut."}, {"role": "user", "content": "und dir?"}],
    [{"role": "user", "content": [{"type": "text", "text": "part one, "}, {"type": "text", "text": "two"}]}],
]


def _bos_variant(src: str, dst: str) -> str:
    """The tiny checkpoint, but with a BOS that both the template and the tokenizer's
    post-processor add: the setup where a naive server puts BOS in twice."""
    shutil.copytree(src, dst)
    os.remove(os.path.join(dst, "chat_template.jinja"))
    tok = json.load(open(os.path.join(dst, "tokenizer.json")))
    tok["post_processor"] = {"type": "TemplateProcessing",
                             "single": [{"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}},
                                        {"Sequence": {"id": "A", "type_id": 0}}],
                             "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                             "special_tokens": {"<|endoftext|>": {"id": "<|endoftext|>", "ids": [0],
                                                                  "tokens": ["<|endoftext|>"]}}}
    json.dump(tok, open(os.path.join(dst, "tokenizer.json"), "w"))
    cfg = json.load(open(os.path.join(dst, "tokenizer_config.json")))
    cfg["bos_token"] = "<|endoftext|>"
    cfg["chat_template"] = "{{ bos_token }}" + cfg["chat_template"]
    json.dump(cfg, open(os.path.join(dst, "tokenizer_config.json"), "w"))
    return dst


@pytest.fixture(scope="module")
def checkpoints(tiny_models, tmp_path_factory):
    return {"tiny": tiny_models["llama"],
            "bos": _bos_variant(tiny_models["llama"], str(tmp_path_factory.mktemp("bos") / "m"))}


@pytest.mark.parametrize("which", ["tiny", "bos"])
@pytest.mark.parametrize("conv", range(len(CONVERSATIONS)))
def test_the_chat_prompt_equals_transformers_apply_chat_template(checkpoints, which, conv):
    """Same text and same ids as transformers, so prompts (and prefix-cache hits) match
    what the model was trained on; on the BOS variant this also pins 'BOS only once'."""
    from transformers import AutoTokenizer
    folder = checkpoints[which]
    hf = AutoTokenizer.from_pretrained(folder)
    codec = TextCodec(folder)
    msgs = CONVERSATIONS[conv]
    want_text = hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    want_ids = hf.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
    if not isinstance(want_ids, list):
        want_ids = want_ids["input_ids"]
    assert codec.render_chat(msgs, add_generation_prompt=True) == want_text
    assert codec.encode_chat(msgs) == list(want_ids)
    if which == "bos":
        assert want_ids[0] == 0 and want_ids[1] != 0


def test_a_template_cannot_reach_python_internals(tiny_models, tmp_path):
    """The chat template is untrusted code from the checkpoint: the sandbox must refuse
    attribute walks to Python internals."""
    import jinja2
    folder = str(tmp_path / "m")
    shutil.copytree(tiny_models["llama"], folder)
    with open(os.path.join(folder, "chat_template.jinja"), "w") as f:
        f.write("{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(jinja2.exceptions.SecurityError):
        TextCodec(folder).render_chat([{"role": "user", "content": "x"}])
