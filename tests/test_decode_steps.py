"""--decode-steps (issue 29): several greedy decode steps of a batch in one native call.

The oracle is the same runner or engine without the flag, one step a batch: the tokens
must be identical (each further step is the fused call a single step would make, fed the
row's argmax), through scattered pages, rows with smaller budgets, the prefix cache,
chunked prefill, stop tokens, max_tokens, a grammar row and a sampled row beside them.
Each comparison also checks that the several-step call ran, or it proved nothing. Then a
real server with the flag against one without (text, a stop string, a stream) and its
batch counter in /metrics.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import requests

from engine import LocalEngine
from ferroxmp.config import ServerArgs
from ferroxmp.gpu_worker.quant.fused_decode import FusedDecode
from ferroxmp.protocol import ForwardBatch, Grammar, RowStep, unpack_ids
from serverproc import greedy_completion, metric, serving


@pytest.fixture
def count_calls(monkeypatch):
    """Counts FusedDecode.steps calls by their step count n."""
    calls: list[int] = []
    inner = FusedDecode.steps

    def steps(self, ids, positions, page_at, pages, n):
        calls.append(n)
        return inner(self, ids, positions, page_at, pages, n)
    monkeypatch.setattr(FusedDecode, "steps", steps)
    return calls


def _decode(h, prompts: dict, n_new: int, budgets) -> dict:
    """Prefill the rows together, then decode them together until each has n_new tokens
    (a row that has them sits out); budgets(i, r) -> row r's spec budget at batch i."""
    out = {r: [] for r in prompts}
    bid = 0
    first = True
    while any(len(out[r]) < n_new for r in prompts):
        steps = [RowStep(r, 0, len(p), True) if first else RowStep(r, len(p) + len(out[r]) - 1, 1, True)
                 for r, p in prompts.items() if len(out[r]) < n_new]
        news = [h.new_row(r, p) for r, p in prompts.items()] if first else []
        spec = {} if first else {s.row: budgets(bid, s.row) for s in steps}
        bid += 1
        res = h.runner.execute(ForwardBatch(bid, news, steps, spec))
        assert res.error is None and not res.row_errors, (res.error, res.row_errors)
        for r, t in zip(unpack_ids(res.rows).tolist(), unpack_ids(res.tokens).tolist()):
            out[r].append(t)
            out[r].extend(unpack_ids(res.spec_tokens[r]).tolist() if r in res.spec_tokens else [])
        first = False
    return {r: o[:n_new] for r, o in out.items()}


@pytest.mark.parametrize("shape,mode,kv", [("llama", "none", "auto"), ("qwen3", "int4", "auto"),
                                           ("qwen2", "int8", "float16")])
def test_steps_in_one_call_give_the_single_steps_tokens(tiny_models, make_harness, count_calls, shape, mode, kv):
    """Three rows on pages scattered over the pool (row r's j-th page is j * 3 + r, so a
    further step's slot must come from the row's own page list), budgets that change from
    batch to batch (0: one step, as without the flag), float32 panels, int4 and int8 with
    float16 K/V."""
    prompts = {0: [5, 9, 300, 17, 4, 77, 12, 801, 3, 3, 64], 1: list(range(40, 61)), 2: [8, 1, 2, 500, 9]}
    got = {}
    for steps in (1, 4):
        h = make_harness(tiny_models[shape], page_size=4, max_rows=3, pages_per_row=64, quantization=mode,
                         kv_cache_dtype=kv, decode_steps=steps)
        h.runner.keep_logits = False
        for r in range(3):
            h.pool.set_row(r, [j * 3 + r for j in range(64)], 0)
        # row 1's budget is one less every other batch: the call takes as many as the least
        got[steps] = _decode(h, prompts, 30, lambda i, r: max(0, (3, 1, 0, 2, 3)[i % 5] - (r == 1 and i % 2)))
    assert got[4] == got[1]
    assert 4 in count_calls and 2 in count_calls and 3 in count_calls, count_calls


def _prompts(rng) -> list[list[int]]:
    base = rng.integers(5, 300, 24).tolist()
    return [base * 2, rng.integers(5, 300, 13).tolist(), base[:5] * 6, base + base[:7]]


def _run(model: str, steps: int, chunk: int, stops=(), overlap: bool = False, **sampling) -> tuple[list, int]:
    eng = LocalEngine(model, num_pages=256, page_size=4, max_batch_tokens=chunk, max_rows=8, decode_steps=steps,
                      overlap=overlap)
    try:
        prompts = _prompts(np.random.default_rng(3))
        outs = [eng.generate(p, 37, stop_token_ids=list(stops), **sampling) for p in prompts]
        outs.append(eng.generate(prompts[0], 37, **sampling))  # again: its prefix is cached now
        # Batched: every prompt at once (different max_tokens), one under a grammar and one
        # sampled (neither takes further steps; the batch they are in takes none either).
        rids = [eng.submit(p, 20 + 3 * i, stop_token_ids=list(stops), **sampling) for i, p in enumerate(prompts)]
        eng.run_until(lambda: all(r in eng.finish for r in rids))
        mixed = rids + [eng.submit(prompts[1], 12, grammar=Grammar("regex", "[a-z ]{1,40}")),
                        eng.submit(prompts[2], 9, temperature=0.8, seed=5)]
        eng.run_until(lambda: all(r in eng.finish for r in mixed))
        outs += [eng.outputs[r] for r in mixed]
        outs.append([eng.finish[r] for r in mixed])
        return outs, eng.core.stats().steps
    finally:
        eng.close()


@pytest.mark.parametrize("chunk,overlap", [(64, False), (5, False), (5, True)],
                         ids=["whole-prefill", "chunked-prefill", "chunked-overlap"])
def test_greedy_output_is_identical_with_and_without_decode_steps(tiny_model, count_calls, chunk, overlap):
    """With overlap (two batches in flight) a batch is planned behind one without further
    steps only (SchedulerCore.lookahead_inflight)."""
    plain, plain_batches = _run(tiny_model, 1, chunk, overlap=overlap)
    assert not count_calls
    got, batches = _run(tiny_model, 4, chunk, overlap=overlap)
    assert got == plain
    assert count_calls and batches < plain_batches, (count_calls, batches, plain_batches)


def test_stop_tokens_and_max_tokens_end_a_row_where_they_end_one_step_at_a_time(tiny_model, count_calls):
    plain, _ = _run(tiny_model, 1, 64)
    stops = {t for out in plain[:4] for t in out[5:8]}  # tokens the outputs do produce
    plain, _ = _run(tiny_model, 1, 64, stops)
    got, _ = _run(tiny_model, 4, 64, stops)
    assert got == plain
    assert any(r == "stop" for r in plain[-1]) and any(r == "length" for r in plain[-1]), plain[-1]
    assert count_calls


@pytest.mark.parametrize("rows", [1, 9])
def test_no_batch_is_planned_behind_one_whose_rows_may_take_several_tokens(rows):
    """--decode-steps 9 (a budget of 8, shared under the worker's cap of 16 tokens): one
    row gets further steps, and the next batch waits for its result; nine rows get none,
    and the next batch is planned while this one computes (overlap), as without the flag."""
    from engine import StubEngine
    eng = StubEngine(num_pages=512, max_rows=16, spec_tokens=8, spec_step_tokens=16)
    eng.core.cfg.decode_steps = True
    rids = [eng.submit([1, 2, 3, 10 + i], 40) for i in range(rows)]
    while any(eng.request(r).state.name != "DECODING" for r in rids):
        assert eng.step()
    while eng.queue:
        eng.report(eng.answer(eng.queue[0]))
    batch = eng.build()
    assert bool(batch.spec) == (rows == 1) == eng.core.lookahead_inflight, batch.spec
    eng.step()  # plans a second batch only where the first gave no budget
    assert len(eng.queue) == (0 if rows == 1 else 1), len(eng.queue)
    eng.core.check_integrity()
    eng.close()


@pytest.mark.parametrize("other", ["sampled", "logprobs", "chunk"])
def test_a_batch_with_a_row_that_cannot_take_further_steps_gets_no_budget(other):
    """Under --decode-steps the worker runs further steps only when every row takes them:
    a sampled row, a row asking for logprobs, or a prefill chunk beside greedy decode rows
    means no budget for any row (no pages held for nothing), and the overlap stays."""
    import msgspec
    from engine import StubEngine
    eng = StubEngine(num_pages=512, max_rows=16, max_batch_tokens=4, spec_tokens=3, spec_step_tokens=16)
    eng.core.cfg.decode_steps = True
    rids = [eng.submit([1, 2, 3, 10 + i], 40) for i in range(2)]
    if other != "chunk":
        req = eng.request(rids[1])
        req.params = msgspec.structs.replace(req.params, **(
            {"temperature": 0.7} if other == "sampled" else {"logprobs": 2}))
    while any(eng.request(r).state.name != "DECODING" for r in rids):
        assert eng.step()
    while eng.queue:
        eng.report(eng.answer(eng.queue[0]))
    assert eng.build().spec == ({} if other != "chunk" else {eng.request(r).cache.row: 3 for r in rids})
    if other == "chunk":  # a prompt arrives: its chunks ride with the decode rows (after it waited)
        eng.report(eng.answer(eng.queue[0]))
        eng.submit(list(range(50, 70)), 4)
        assert eng.build().spec == {}  # it waited: no budget
        eng.report(eng.answer(eng.queue[0]))
        batch = eng.build()
        assert any(s.length > 1 for s in batch.steps) and batch.spec == {}, batch
    assert not eng.core.lookahead_inflight
    eng.close()


def test_where_the_fused_step_cannot_run_them_the_scheduler_gives_no_budget(tiny_models, make_harness):
    """--decode-steps 4 on a worker without the fused step (here --disable-fused-decode; CUDA,
    --tp and --deterministic alike): the runner says 1, and the scheduler then holds no
    pages for further steps and keeps its overlap; where it runs, the worker says 4."""
    from ferroxmp.scheduler.settings import SchedulerConfig
    eager = make_harness(tiny_models["llama"], page_size=4, max_rows=2, decode_steps=4, fused_decode=False)
    fused = make_harness(tiny_models["llama"], page_size=4, max_rows=2, decode_steps=4)
    assert (eager.runner.decode_steps, fused.runner.decode_steps) == (1, 4)
    args = ServerArgs(decode_steps=4).to_dict()
    info = {"page_size": 4, "max_model_len": 512, "vocab_size": 1000}
    off = SchedulerConfig.from_launch(args, {**info, "decode_steps": eager.runner.decode_steps})
    on = SchedulerConfig.from_launch(args, {**info, "decode_steps": fused.runner.decode_steps})
    assert (off.spec_tokens, off.decode_steps, on.spec_tokens, on.decode_steps) == (0, False, 3, True)
    spec = SchedulerConfig.from_launch(ServerArgs(speculative_ngram=True).to_dict(), {**info, "decode_steps": 4})
    assert (spec.spec_tokens, spec.decode_steps) == (15, False)


def test_decode_steps_is_a_flag_of_4_by_default_1_under_speculation_and_not_beside_it(tiny_model):
    assert ServerArgs().decode_steps == 4 and ServerArgs().spec_tokens == 3
    assert ServerArgs(decode_steps=1).spec_tokens == 0 and ServerArgs(decode_steps=8).spec_tokens == 7
    assert ServerArgs(speculative_ngram=True).decode_steps == 1
    assert ServerArgs(draft_model=tiny_model).decode_steps == 1
    assert ServerArgs.from_dict(ServerArgs(decode_steps=1).to_dict()).decode_steps == 1
    with pytest.raises(ValueError, match="--decode-steps"):
        ServerArgs(decode_steps=4, speculative_ngram=True).validate()
    with pytest.raises(ValueError, match="--decode-steps"):
        ServerArgs(decode_steps=0).validate()


def test_a_server_with_decode_steps_answers_as_one_without_in_fewer_batches(tiny_model):
    prompts = ["the cat sat on the mat and the dog", "def f(x):\n    return", "hello there"]
    stream = {"prompt": prompts[0], "max_tokens": 40, "temperature": 0, "stream": True}

    def serve(*flags):
        with serving(tiny_model, *flags) as srv:
            texts = [greedy_completion(srv, p, 48) for p in prompts]
            stop = texts[1][10:14]  # a string the output does contain: the text ends before it
            r = requests.post(srv.url + "/v1/completions", headers=srv.headers, timeout=120,
                              json={"prompt": prompts[1], "max_tokens": 48, "temperature": 0, "stop": [stop]})
            r.raise_for_status()
            texts.append((r.json()["choices"][0]["text"], r.json()["choices"][0]["finish_reason"]))
            with requests.post(srv.url + "/v1/completions", headers=srv.headers, json=stream, stream=True,
                               timeout=120) as r:
                r.raise_for_status()
                chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith(b"data: {")]
            texts.append("".join(c["choices"][0]["text"] for c in chunks if c["choices"]))
            import time
            time.sleep(1.1)  # counters ride the scheduler's heartbeat
            return texts, metric(srv.url, "ferroxmp_batches_total", srv.headers)

    want, plain_batches = serve("--decode-steps", "1")
    got, batches = serve()  # (4 by default)
    assert got == want
    assert want[3][1] == "stop" and want[4] == want[0][:len(want[4])] and len(want[4]) > 10
    assert batches < 0.6 * plain_batches, (batches, plain_batches)
