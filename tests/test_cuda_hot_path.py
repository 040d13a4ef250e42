"""The parts of the CUDA hot path that can be checked without a GPU: padded batch sizes
for CUDA graphs, the --mem-fraction arithmetic, the pinned-copy helper's bookkeeping,
and that the runner keeps no logits (the old test hook) unless asked.

The padded Triton decode path itself (padding rows touch only the pad page) is checked
under the interpreter in tests/test_triton_attention.py; capture and replay need a GPU
(tools/gpu_check.sh).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from ferroxmp.config import parse_server_args
from ferroxmp.gpu_worker.cuda_graphs import PinnedStager, graph_batch_sizes, pad_rows, padded_batch_size
from ferroxmp.gpu_worker.gpu_memory import KVBudget, activation_bytes, profile_lengths, profile_pages


@pytest.mark.parametrize("max_rows", [1, 3, 16, 100, 256, 1000])
def test_every_batch_up_to_the_largest_size_pads_to_a_captured_size_with_little_waste(max_rows):
    sizes = graph_batch_sizes(max_rows)
    assert sizes == sorted(set(sizes)) and sizes[0] == 1 and sizes[-1] == min(max_rows, 256)
    for n in range(1, sizes[-1] + 1):
        p = padded_batch_size(n, sizes)
        assert p in sizes and n <= p
        assert p - n < max(n, 16), (n, p)  # at most doubling below 16, < 16 rows of padding above
    assert padded_batch_size(sizes[-1] + 1, sizes) is None  # larger steps run eagerly
    assert padded_batch_size(0, sizes) is None


def test_pad_rows_appends_the_pad_value():
    assert pad_rows(np.array([5, 6], np.int32), 4, -1).tolist() == [5, 6, -1, -1]


def test_the_stager_copies_through_one_reused_host_buffer_per_name():
    st = PinnedStager(pin=False)
    dst = torch.zeros(10, dtype=torch.int32)
    st.copy("a", dst, np.arange(3))
    buf = st.host["a"]
    st.copy("a", dst, np.array([7, 8]))
    assert st.host["a"] is buf and dst[:3].tolist() == [7, 8, 2]
    st.copy("a", dst, np.arange(10))  # fits the 64-entry buffer: still the same one
    assert st.host["a"] is buf and dst.tolist() == list(range(10))


def test_the_kv_budget_is_the_fraction_of_free_memory_less_weights_and_activations():
    b = KVBudget(free_at_start=80 << 30, mem_fraction=0.9, weights=16 << 30, activations=2 << 30,
                 bytes_per_page=1 << 20)
    assert b.kv_bytes == int(0.9 * (80 << 30)) - (18 << 30)
    assert b.pages == b.kv_bytes // (1 << 20)
    assert "pages" in b.describe() and "weights 16.00 GiB" in b.describe()
    starved = KVBudget(10 << 30, 0.5, 6 << 30, 0, 1 << 20)
    assert starved.kv_bytes == 0 and starved.pages == 0


def test_activation_estimate_grows_with_batch_tokens_and_rows():
    a = activation_bytes(2048, 3072, 8192, 128256, 2048, 256, 2)
    assert a > activation_bytes(2048, 3072, 8192, 128256, 1024, 256, 2)
    assert a > activation_bytes(2048, 3072, 8192, 128256, 2048, 128, 2)
    assert a >= 3 * 256 * 128256 * 4  # logits of every row, float32


def test_disable_cuda_graph_is_a_flag_and_off_by_default():
    assert parse_server_args([]).disable_cuda_graph is False
    assert parse_server_args(["--disable-cuda-graph"]).disable_cuda_graph is True


def test_the_runner_keeps_no_logits_unless_built_to_and_builds_no_graphs_on_cpu(tiny_models):
    from ferroxmp.gpu_worker.runner import ModelRunner
    from ferroxmp.protocol import ForwardBatch, NewRow, RowStep, SamplingParams, pack_ids
    from ferroxmp.page_pool import PagePool
    pool = PagePool.create(num_pages=8, max_rows=2, max_pages_per_row=4)
    try:
        pool.set_row(0, [0, 1, 2, 3], 0)
        for keep in (False, True):
            r = ModelRunner(tiny_models["llama"], pool, 16, device="cpu", keep_logits=keep)
            assert r.graphs is None and r.kv.num_pages == pool.num_pages
            res = r.execute(ForwardBatch(1, [NewRow(0, pack_ids([3, 4, 5]), SamplingParams(temperature=0.0), 0)],
                                         [RowStep(0, 0, 3, True)]))
            assert res.error is None
            if keep:
                assert r.last_logits.shape == (1, r.config.vocab_size)
            else:
                assert r._logits is None
                with pytest.raises(RuntimeError, match="keep_logits"):
                    r.last_logits
    finally:
        pool.close()
        pool.unlink()


@pytest.mark.parametrize("given,expected", [(None, "- 30000"), ("ACTIVE", "ACTIVE -"), ("PASSIVE", "PASSIVE -")])
def test_the_worker_process_sets_a_short_openmp_spin_before_torch_loads_unless_told(given, expected):
    """OpenMP reads its wait settings once, when torch loads it: the worker module must set
    its default (a short spin, GOMP_SPINCOUNT) before importing torch, and leave a wait
    policy the operator gave alone."""
    import os
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    if given:
        env["OMP_WAIT_POLICY"] = given
    code = ("import sys, os; import ferroxmp.gpu_worker.worker; e = os.environ; "
            "print(e.get('OMP_WAIT_POLICY', '-'), e.get('GOMP_SPINCOUNT', '-'), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.stdout.split() == expected.split() + ["True"], out.stderr[-2000:]
    # ...and torch was not imported before the worker module set it
    code = "import sys; import ferroxmp, ferroxmp.gpu_worker; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.stdout.strip() == "False", out.stderr[-2000:]


@pytest.mark.parametrize("tokens,rows,max_len", [(8192, 256, 8192), (100, 256, 4096), (8192, 4, 1000),
                                                 (7, 3, 100), (1, 1, 1)])
def test_the_profiling_step_is_the_largest_the_scheduler_may_send(tokens, rows, max_len):
    lengths = profile_lengths(tokens, rows, max_len)
    assert 1 <= len(lengths) <= rows and all(1 <= n <= max_len for n in lengths)
    assert sum(lengths) == min(tokens, len(lengths) * max_len)  # every budgeted token, unless no row may hold it
    assert len(lengths) == min(rows, tokens)  # as many sampling rows as may run: the widest logits
    assert profile_pages(lengths, 16) == sum(-(-n // 16) for n in lengths)


def _greedy(runner, pool, prompt: list[int], steps: int) -> list[int]:
    from ferroxmp.protocol import ForwardBatch, NewRow, RowStep, SamplingParams, pack_ids, unpack_ids
    pool.set_row(0, list(range(pool.max_pages_per_row)), 0)
    out, n = [], len(prompt)
    res = runner.execute(ForwardBatch(1, [NewRow(0, pack_ids(prompt), SamplingParams(temperature=0.0), 0)],
                                      [RowStep(0, 0, n, True)]))
    out.append(int(unpack_ids(res.tokens)[0]))
    for i in range(steps - 1):
        res = runner.execute(ForwardBatch(2 + i, [], [RowStep(0, n + i, 1, True)]))
        assert res.error is None and not res.row_errors
        out.append(int(unpack_ids(res.tokens)[0]))
    return out


def test_a_runner_profiled_over_a_small_pool_then_attached_to_the_real_one_decodes_as_a_fresh_one(tiny_models):
    """The worker's CUDA sizing path (gpu_memory.measure), run on CPU: load over a probe
    pool, run the largest step, re-attach; the pages and rows the probe used are gone and
    the output equals a runner built on the real pool from the start."""
    from ferroxmp.gpu_worker.runner import ModelRunner
    from ferroxmp.page_pool import PagePool
    lengths = profile_lengths(96, 4, 4096)
    probe = PagePool.create(profile_pages(lengths, 16), max_rows=4, max_pages_per_row=8)
    real = PagePool.create(num_pages=8, max_rows=4, max_pages_per_row=8)
    try:
        r = ModelRunner(tiny_models["llama"], probe, 16, device="cpu")
        probe.page_table[:] = 7  # a sentinel: the pool's table has one writer, never the runner
        r.profile_step(lengths)
        assert (probe.page_table == 7).all()
        probe.page_table[:] = -1
        assert (probe.page_table == -1).all() and not r.rows  # nothing of the probe outlives it
        with pytest.raises(ValueError, match="needs"):
            r.profile_step(profile_lengths(1000, 4, 4096))  # more than the probe pool holds
        prompt = [5, 9, 11, 3, 7, 2, 8]
        want = _greedy(ModelRunner(tiny_models["llama"], real, 16, device="cpu"), real, prompt, 6)
        # still on the probe: the profiled rows left nothing behind in the backend either
        assert _greedy(r, probe, prompt, 6) == want
        assert r.attach_pool(real) is r and r.kv.num_pages == 8 and r.pool is real and not r.rows
        assert _greedy(r, real, prompt, 6) == want
    finally:
        for p in (probe, real):
            p.close()
            p.unlink()


def test_the_budget_line_says_whether_it_was_measured():
    est = KVBudget(80 << 30, 0.9, 16 << 30, 2 << 30, 1 << 20)
    assert "estimated before loading" in est.describe()
    assert "measured after loading" in KVBudget(80 << 30, 0.9, 16 << 30, 2 << 30, 1 << 20, measured=True).describe()
