"""The worker's grammar module and the runner's constrained sampling, on random weights.

Oracles: jsonschema validates what a constrained row produced (the mask, not the
model, must guarantee it); an explicit per-token loop checks the bitmask expansion;
an uninterrupted run is the oracle for a row restarted after a retraction; the raw
logits' argmax is the oracle for an unconstrained row sharing the batch.
"""
from __future__ import annotations

import json
import re

import pytest
import torch

from ferroxmp.frontend.text.tokenizer import TextCodec
from ferroxmp.protocol import Grammar, NewRow, RowStep, SamplingParams, pack_ids, unpack_ids

jsonschema = pytest.importorskip("jsonschema")
llg = pytest.importorskip("llguidance")

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "age": {"type": "integer", "minimum": 0, "maximum": 200},
                         "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
                         "ok": {"type": "boolean"}},
          "required": ["name", "age", "tags", "ok"], "additionalProperties": False}
GRAMMAR = Grammar("json_schema", json.dumps(SCHEMA))
PROMPT = [5, 17, 99, 3, 42, 8]


def decode_row(h, row: int, params: SamplingParams, prompt=PROMPT, max_new: int = 400, seed: int = 0,
               stop_after: int = 0, others=()):
    """Prefill and decode `row` until it samples EOS (or max_new tokens). Rows in `others`
    (row -> prompt, unconstrained greedy) share every batch. Returns (tokens, finished,
    {other row: [(token, argmax of its raw logits)]})."""
    eos = set(h.runner.config.eos_token_ids)
    news = [NewRow(row, pack_ids(prompt), params, seed)]
    news += [NewRow(r, pack_ids(p), SamplingParams(temperature=0.0), 0) for r, p in others]
    steps = [RowStep(row, 0, len(prompt), True)] + [RowStep(r, 0, len(p), True) for r, p in others]
    out, side = [], {r: [] for r, _ in others}
    known = {r: len(p) for r, p in others}
    while len(out) < max_new:
        res = h.run(news, steps)
        assert res.error is None and not res.row_errors, (res.error, res.row_errors)
        news = []
        logits = h.runner.last_logits
        for j, (r, tok) in enumerate(zip(unpack_ids(res.rows).tolist(), unpack_ids(res.tokens).tolist())):
            if r == row:
                out.append(tok)
            else:
                side[r].append((tok, int(logits[j].argmax())))
                known[r] += 1
        if out[-1] in eos or (stop_after and len(out) >= stop_after):
            return out, out[-1] in eos, side
        steps = [RowStep(row, len(prompt) + len(out) - 1, 1, True)]
        steps += [RowStep(r, known[r] - 1, 1, True) for r, _ in others]
    return out, False, side


def text_of(codec: TextCodec, toks: list[int], eos) -> str:
    return codec.decode([t for t in toks if t not in eos])


def test_the_bitmask_expansion_allows_exactly_the_set_bits():
    """A shifted or sign-extended bit (bit 31 is the int32 sign) would allow a token the
    grammar forbids or forbid one it allows."""
    from ferroxmp.gpu_worker.sampling.sampler import apply_bitmask
    g = torch.Generator().manual_seed(0)
    vocab = 100
    bitmask = torch.randint(-2 ** 31, 2 ** 31 - 1, (3, 4), generator=g, dtype=torch.int64).to(torch.int32)
    out = apply_bitmask(torch.zeros(3, vocab), bitmask)
    for i in range(3):
        for t in range(vocab):
            bit = (int(bitmask[i, t // 32]) >> (t % 32)) & 1
            assert (out[i, t] == 0) == bool(bit), (i, t)


def test_packing_a_token_set_round_trips_through_the_mask():
    """The JSON rows' extra mask (no control bytes) is packed by the module itself."""
    from ferroxmp.gpu_worker.sampling.grammar import _pack_bits
    from ferroxmp.gpu_worker.sampling.sampler import apply_bitmask
    allowed = torch.rand(77, generator=torch.Generator().manual_seed(1)) > 0.5
    allowed[31] = allowed[63] = True  # the sign bits
    out = apply_bitmask(torch.zeros(1, 77), _pack_bits(allowed)[None, :])
    assert torch.equal(out[0] == 0, allowed)


def test_compiled_grammars_are_cached_by_spec(tiny_model):
    """Compiling per request would cost milliseconds on every constrained request."""
    from ferroxmp.gpu_worker.sampling.grammar import GrammarCache
    cache = GrammarCache.for_checkpoint(tiny_model, 1024, [1])
    cache.matcher(GRAMMAR)
    cache.matcher(Grammar("json_schema", json.dumps(SCHEMA)))
    assert cache.compiles == 1
    cache.matcher(Grammar("regex", "[ab]+"))
    assert cache.compiles == 2


@pytest.mark.parametrize("temperature,seed", [(0.0, 0), (1.0, 1), (1.0, 2), (1.0, 3), (1.0, 4)])
def test_a_schema_constrained_row_ends_in_eos_with_valid_json(temperature, seed, tiny_model, make_harness):
    """Random weights know nothing of JSON: only the mask makes the text parse and
    validate, and EOS comes only where the grammar accepts."""
    h = make_harness(tiny_model)
    codec = TextCodec(tiny_model)
    toks, finished, _ = decode_row(h, 0, SamplingParams(temperature=temperature, grammar=GRAMMAR), seed=seed)
    assert finished, codec.decode(toks)
    jsonschema.validate(json.loads(text_of(codec, toks, h.runner.config.eos_token_ids)), SCHEMA)


@pytest.mark.parametrize("grammar,check", [
    (Grammar("regex", r"(cat|dog)-[0-9]{2,4}"), lambda s: re.fullmatch(r"(cat|dog)-[0-9]{2,4}", s)),
    (Grammar("ebnf", 'root ::= "yes" | "no" | "maybe " [0-9]'), lambda s: re.fullmatch(r"yes|no|maybe [0-9]", s)),
])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_regex_and_ebnf_rows_produce_only_matching_text(grammar, check, temperature, tiny_model, make_harness):
    """The regex and EBNF kinds reach the engine with their own parsers."""
    h = make_harness(tiny_model)
    codec = TextCodec(tiny_model)
    toks, finished, _ = decode_row(h, 1, SamplingParams(temperature=temperature, grammar=grammar), seed=7)
    assert finished
    assert check(text_of(codec, toks, h.runner.config.eos_token_ids)), codec.decode(toks)


def test_an_unconstrained_row_in_the_same_batch_is_not_masked(tiny_model, make_harness):
    """The mask is per row: a row without a grammar must still take its raw argmax."""
    h = make_harness(tiny_model)
    _, finished, side = decode_row(h, 0, SamplingParams(temperature=0.0, grammar=GRAMMAR),
                                   others=[(3, [7, 7, 9, 200])])
    assert finished and side[3]
    assert all(tok == best for tok, best in side[3])


def test_a_row_restarted_after_retraction_replays_its_tokens_into_a_fresh_matcher(tiny_model, make_harness):
    """A retracted row comes back as prompt + generated with prompt_len: if the matcher
    were not replayed, the restarted row would start the JSON again (or be refused)."""
    params = SamplingParams(temperature=1.0, grammar=GRAMMAR)
    h = make_harness(tiny_model)
    whole, finished, _ = decode_row(h, 0, params, seed=11)
    assert finished and len(whole) > 6
    h2 = make_harness(tiny_model)
    first, _, _ = decode_row(h2, 0, params, seed=11, stop_after=5)
    assert first == whole[:5]
    tokens = PROMPT + first
    res = h2.run([NewRow(2, pack_ids(tokens), params, 11, len(PROMPT))], [RowStep(2, 0, len(tokens), True)])
    assert res.error is None
    rest = unpack_ids(res.tokens).tolist()
    eos = set(h2.runner.config.eos_token_ids)
    while rest[-1] not in eos and len(rest) < 400:
        n = len(tokens) + len(rest)
        rest += unpack_ids(h2.run([], [RowStep(2, n - 1, 1, True)]).tokens).tolist()
    assert first + rest == whole


def test_a_complete_grammar_ends_the_row_even_before_min_tokens(tiny_model, make_harness):
    """Once the regex is matched only EOS may follow; min_tokens=50 would block it and
    leave no candidate at all. The grammar wins: the row ends at once with EOS."""
    h = make_harness(tiny_model)
    codec = TextCodec(tiny_model)
    toks, finished, _ = decode_row(h, 0, SamplingParams(temperature=1.0, min_tokens=50,
                                                        grammar=Grammar("regex", "ok")), seed=2)
    assert finished and text_of(codec, toks, h.runner.config.eos_token_ids) == "ok", toks


def test_min_tokens_yields_to_a_grammar_that_allows_only_eos():
    """Blocking EOS where the grammar allows nothing else would leave every logit -inf
    (argmax then says token 0, a token neither allowed): the grammar's EOS must win."""
    from ferroxmp.gpu_worker.sampling.grammar import _pack_bits
    from ferroxmp.gpu_worker.sampling.sampler import RowSample, sample
    only = torch.zeros(40, dtype=torch.bool)
    only[7] = True
    logits = torch.randn(2, 40, generator=torch.Generator().manual_seed(0))
    rows = [RowSample(SamplingParams(temperature=t, min_tokens=5), 1, 3, allowed=_pack_bits(only),
                      blocked=(7, 0)) for t in (0.0, 1.0)]
    assert sample(logits, rows).tolist() == [7, 7]


def test_a_row_slot_reused_after_a_constrained_request_is_unconstrained(tiny_model, make_harness):
    """The matcher belongs to the request: a new NewRow in the same slot (after a finish
    or an abort) must not inherit it, so the next request's tokens equal a fresh run's."""
    h = make_harness(tiny_model)
    _, finished, _ = decode_row(h, 0, SamplingParams(temperature=0.0, grammar=GRAMMAR))
    assert finished
    after, _ = h.generate({0: PROMPT}, 8, SamplingParams(temperature=0.0))
    fresh, _ = make_harness(tiny_model).generate({0: PROMPT}, 8, SamplingParams(temperature=0.0))
    assert after == fresh
