"""Compressed weights end to end: the real SmolLM2 Q4_1 GGUF kept as fp16, or as its own
int4 blocks, answers what the dequantized float32 path answers; --tp 2 with compressed weights serves tp=1's tokens
and reports its memory in /server_info.

Oracles: the same runner on the same file with --quantization none (the float32 path
test_default_model checks against transformers), and the tp=1 runner in-process.
"""
from __future__ import annotations

import pytest
from gguf import GGMLQuantizationType as Q

from ferroxmp.gpu_worker.loader import load_config
from ferroxmp.gpu_worker.parallel.group import Shard
from gguf_writer import write_gguf
from serverproc import ServerProcess, greedy_ids

pytestmark = pytest.mark.timeout(600)
QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "Who wrote Romeo and Juliet?"]


def test_the_smollm2_gguf_kept_as_fp16_or_int4_answers_the_dequantized_paths_greedy_tokens(make_harness):
    """fp16 weights hold each Q4_1 value to 11 bits, far inside the file's own 4-bit step;
    int4 holds the file's blocks themselves (int4x16.c multiplies them by activations on a
    grid of 1/32258 of each group's largest value: perplexity within 0.01% of float32's,
    docs/BENCHMARKS.md 24), so greedy answers must not move. int8 requantizes the Q4_1 values (within half an int8
    step): measured, not asserted (docs/BENCHMARKS.md 18). Chunked prefill (chunks of 16,
    the kernel path) and a batch of 3 rows are part of the path; 3 prompts x 12 tokens
    keep it to three model loads and ~25 steps each."""
    from ferroxmp.checkpoint.default_model import default_model_path
    from ferroxmp.frontend.text.tokenizer import TextCodec
    path = default_model_path()
    codec = TextCodec(path)
    prompts = {i: codec.encode_chat([{"role": "user", "content": q}]) for i, q in enumerate(QUESTIONS)}
    answers = {}
    for mode in ("none", "fp16", "int4"):
        h = make_harness(path, max_rows=3, pages_per_row=8, quantization=mode)
        assert h.runner.quantization == mode
        answers[mode], _ = h.generate(prompts, 12, chunk=16)
        h.close()
    assert answers["fp16"] == answers["none"]
    assert answers["int4"] == answers["none"]


@pytest.mark.parametrize("mode,qtype", [("fp16", Q.Q8_0), ("int4", Q.Q4_1)])
def test_tp2_with_compressed_weights_serves_tp1s_tokens_and_reports_its_memory(tiny_models, make_harness,
                                                                             tmp_path, mode, qtype):
    """Shards of compressed weights (row-parallel o_proj/down_proj split by columns: for
    int4, at group boundaries) summed by the all-reduce must give the tp=1 runner's greedy
    tokens; /server_info's memory block names the mode and the KV bytes the pool really
    holds."""
    path = write_gguf(tiny_models["llama"], str(tmp_path / f"llama-{qtype.name}.gguf"), qtype)
    prompts = {0: [5, 6, 7, 8, 9, 10, 11], 1: list(range(20, 45)), 2: [300, 17, 17, 4, 999, 123, 64, 3]}
    h = make_harness(path, page_size=4, quantization=mode)
    want, _ = h.generate(prompts, 8)
    tp1_bytes = h.runner.memory_info()["weight_bytes"]
    h.close()
    flags = ("--tp", "2", "--page-size", "4", "--kv-pages", "64", "--max-running-requests", "8",
             "--quantization", mode)
    with ServerProcess(path, *flags) as srv:
        got = greedy_ids(srv, prompts, 8)
        memory = srv.info["worker_info"]["memory"]
    assert got == want
    cfg = load_config(path)
    local = Shard(cfg, 0, 2).local_config
    assert memory["quantization"] == mode
    assert memory["kv_bytes"] == 64 * 4 * local.kv_bytes_per_token()
    assert memory["weight_bytes"] == sum(memory["weight_bytes_by_format"].values())
    assert tp1_bytes / 2 < memory["weight_bytes"] < tp1_bytes  # rank 0's share: half, plus the norms
    assert {"fp16": "float16", "int4": "int4"}[mode] in memory["weight_bytes_by_format"]  # compressed on the rank
