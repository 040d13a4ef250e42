#!/usr/bin/env python3
"""Benchmark the worker's ModelRunner against transformers' own forward, same shapes, same run.

Measures prefill tokens/s (one row, one chunk of --prompt tokens) and the time of one
decode step at batch 1, 16 and 64 (every row holding --prompt tokens of context), for
ferroxmp's paged runner and for transformers (eager attention, DynamicCache).

    .venv/bin/python tools/bench_worker.py [--shape smol-135m] [--model DIR] [--out bench.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from ferroxmp.protocol import ForwardBatch, NewRow, RowStep, SamplingParams, pack_ids  # noqa: E402
from ferroxmp.radix.pages import PagePool  # noqa: E402


def _timed(fn, repeat: int) -> float:
    """Median seconds of fn() over `repeat` runs after one warm-up."""
    fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def bench_ferroxmp(path: str, prompt: int, batches: list[int], steps: int, page_size: int) -> dict:
    from ferroxmp.gpu_worker.runner import ModelRunner
    max_b = max(batches)
    per_row = -(-(prompt + steps + 8) // page_size)
    pool = PagePool.create(num_pages=per_row * max_b, max_rows=max_b, max_pages_per_row=per_row)
    try:
        runner = ModelRunner(path, pool, page_size, device="cpu")
        for r in range(max_b):
            pool.set_row(r, list(range(r * per_row, (r + 1) * per_row)), 0)
        greedy = SamplingParams(temperature=0.0)
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(3, runner.config.vocab_size, (prompt,), generator=g).tolist() for _ in range(max_b)]
        bid = iter(range(1, 1 << 30))

        def start(rows: range) -> None:
            runner.execute(ForwardBatch(next(bid), [NewRow(r, pack_ids(prompts[r]), greedy, 0) for r in rows], []))

        def prefill() -> None:
            start(range(1))
            res = runner.execute(ForwardBatch(next(bid), [], [RowStep(0, 0, prompt, True)]))
            assert res.error is None, res.error

        out = {"prefill_tok_s": prompt / _timed(prefill, 3)}
        for b in batches:
            start(range(b))
            for r in range(b):  # context, untimed
                runner.execute(ForwardBatch(next(bid), [], [RowStep(r, 0, prompt, True)]))

            def decode() -> None:
                res = runner.execute(ForwardBatch(next(bid), [], [
                    RowStep(r, len(runner.rows[r].tokens) - 1, 1, True) for r in range(b)]))
                assert res.error is None, res.error
            out[f"decode_ms_b{b}"] = 1000 * _timed(decode, steps)
        return out
    finally:
        pool.close()
        pool.unlink()


def bench_transformers(path: str, prompt: int, batches: list[int], steps: int) -> dict:
    from transformers import AutoModelForCausalLM, DynamicCache
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager")
    model.eval()
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    out = {}
    with torch.inference_mode():
        ids = torch.randint(3, vocab, (1, prompt), generator=g)
        out["prefill_tok_s"] = prompt / _timed(lambda: model(ids, past_key_values=DynamicCache(), use_cache=True), 3)
        for b in batches:
            ids = torch.randint(3, vocab, (b, prompt), generator=g)
            cache = DynamicCache()
            logits = model(ids, past_key_values=cache, use_cache=True).logits[:, -1]
            state = {"next": logits.argmax(-1, keepdim=True)}

            def decode() -> None:
                lg = model(state["next"], past_key_values=cache, use_cache=True).logits[:, -1]
                state["next"] = lg.argmax(-1, keepdim=True)
            out[f"decode_ms_b{b}"] = 1000 * _timed(decode, steps)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="smol-135m", help="tiny_model shape to build when --model is not given")
    p.add_argument("--model", default=None, help="checkpoint folder (default: build --shape into a temp dir)")
    p.add_argument("--prompt", type=int, default=512, help="prompt / context tokens per row")
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--steps", type=int, default=8, help="timed decode steps per batch size")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--skip-transformers", action="store_true")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    batches = [int(x) for x in a.batches.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        path = a.model
        if path is None:
            from ferroxmp.tiny_model import build_model
            path = build_model(a.shape, os.path.join(tmp, a.shape))
        results = {"ferroxmp": bench_ferroxmp(path, a.prompt, batches, a.steps, a.page_size)}
        if not a.skip_transformers:
            results["transformers"] = bench_transformers(path, a.prompt, batches, a.steps)
    meta = {"shape": a.shape if a.model is None else a.model, "prompt": a.prompt, "threads": a.threads,
            "torch": torch.__version__, "dtype": "checkpoint"}
    keys = ["prefill_tok_s"] + [f"decode_ms_b{b}" for b in batches]
    print(f"{'metric':<18}" + "".join(f"{name:>14}" for name in results))
    for k in keys:
        print(f"{k:<18}" + "".join(f"{results[name][k]:>14.1f}" for name in results))
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
