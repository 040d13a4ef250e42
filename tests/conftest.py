"""Shared fixtures: the tiny test checkpoints, built once per test session.

`tiny_models` maps each tiny shape (llama, qwen2, qwen3, mistral) to a checkpoint
folder in a session temp dir; the tokenizer is trained once and reused across shapes
(ferroxmp.tiny_model caches it per process). `tiny_model` is the same, one shape at a
time: parametrize it indirectly, e.g.
    @pytest.mark.parametrize("tiny_model", ["qwen3"], indirect=True)
and it defaults to "llama" when not parametrized. `make_harness(path)` gives a
RunnerHarness: a ModelRunner on a private PagePool (unlinked at teardown) with helpers
that drive it as the scheduler would (start rows, prefill in chunks, decode).
"""
from __future__ import annotations

import os

# Triton reads TRITON_INTERPRET once, when first imported; any test module may import it
# (test_gpu_check, test_triton_attention), so set it before all of them: kernels run on
# CPU tensors here. A GPU run sets TRITON_INTERPRET=0 itself (tools/gpu_check.sh).
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from ferroxmp.gpu_worker.quant.native import cache_dir as kernel_cache_dir
from ferroxmp.tiny_model import TINY_SHAPES, build_model

# Every server a test starts gets a private FERROXMP_CACHE; the native kernels' build is
# keyed by its source and shared instead (one build per session, not one per server start).
os.environ.setdefault("FERROXMP_KERNEL_CACHE", kernel_cache_dir())

# Files whose tests start real servers, load the shipped model or build and run whole
# tools (over 5 s a file, most of the suite's time). The edit loop skips them with
# `-m "not slow"`; tools/test (and CI) runs everything.
SLOW_FILES = {
    "test_bench_serving.py", "test_browser.py", "test_connections.py", "test_crash_leftovers.py",
    "test_default_model.py", "test_deterministic.py", "test_e2e_openai.py", "test_frontend_http.py",
    "test_gguf.py", "test_gpu_check.py", "test_kv_tiers_server.py", "test_lm_eval.py",
    "test_quant_model.py", "test_router.py", "test_scheduler_process.py", "test_slow_step.py",
    "test_speculative.py", "test_stall.py", "test_supervisor.py", "test_tensor_parallel.py",
}
# Files that must not run beside other tests (tools/test runs them alone, after the
# parallel part): a server start sweeps /dev/shm of dead servers' pools, which is what
# test_crash_leftovers watches one server do; the stall and slow-step tests time pauses
# and CPU progress against timeouts, which a busy neighbour would stretch.
SERIAL_FILES = {"test_crash_leftovers.py", "test_stall.py", "test_slow_step.py", "test_liveness.py"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        name = os.path.basename(str(item.fspath))
        if name in SLOW_FILES:
            item.add_marker(pytest.mark.slow)
        if name in SERIAL_FILES:
            item.add_marker(pytest.mark.serial)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tiny_models")
    return {shape: build_model(shape, os.path.join(str(root), shape)) for shape in TINY_SHAPES}


@pytest.fixture
def tiny_model(request, tiny_models) -> str:
    shape = getattr(request, "param", "llama")
    return tiny_models[shape]


# ---- worker harness ---------------------------------------------------------------

class RunnerHarness:
    """Drives a ModelRunner the way the scheduler would, on a private PagePool: row r owns
    pages [r * pages_per_row, (r + 1) * pages_per_row) unless a test rewrites its table."""

    def __init__(self, model_path: str, page_size: int = 16, max_rows: int = 8, pages_per_row: int = 40,
                 **runner_kw):
        from ferroxmp.gpu_worker.runner import ModelRunner
        from ferroxmp.page_pool import PagePool
        self.page_size = page_size
        self.pages_per_row = pages_per_row
        self.pool = PagePool.create(max_rows * pages_per_row, max_rows, pages_per_row)
        try:
            self.runner = ModelRunner(model_path, self.pool, page_size, device="cpu", keep_logits=True, **runner_kw)
        except BaseException:
            self.close()
            raise
        for r in range(max_rows):
            self.own_pages(r)
        self.batch_id = 0

    def own_pages(self, row: int, prefix: tuple = ()) -> None:
        """Give `row` its own pages, after an optional prefix of page ids (adopted pages)."""
        own = list(range(row * self.pages_per_row, (row + 1) * self.pages_per_row))
        self.pool.set_row(row, (list(prefix) + own[len(prefix):])[:self.pages_per_row], 0)

    def run(self, new_rows=(), steps=()):
        from ferroxmp.protocol import ForwardBatch
        self.batch_id += 1
        return self.runner.execute(ForwardBatch(self.batch_id, list(new_rows), list(steps)))

    def new_row(self, row: int, tokens, params=None, seed: int = 0):
        from ferroxmp.protocol import NewRow, SamplingParams, pack_ids
        return NewRow(row, pack_ids(tokens), params or SamplingParams(temperature=0.0), seed)

    def generate(self, prompts: dict, n_new: int, params=None, seeds=None, chunk=None, starts=None):
        """Prefill every row (in chunks of `chunk` tokens, all rows in each batch; row r
        starts at starts[r], default 0) and decode them together. Returns
        ({row: new tokens}, {row: [logits of each sampled token]})."""
        from ferroxmp.protocol import RowStep, unpack_ids
        seeds, starts = seeds or {}, starts or {}
        params = params if isinstance(params, dict) else {r: params for r in prompts}
        news = [self.new_row(r, p, params[r], seeds.get(r, 0)) for r, p in prompts.items()]
        pos = {r: starts.get(r, 0) for r in prompts}
        out = {r: [] for r in prompts}
        logits = {r: [] for r in prompts}
        while any(len(out[r]) < n_new for r in prompts):
            steps = []
            for r, p in prompts.items():
                known = len(p) + len(out[r])
                if len(out[r]) >= n_new:
                    continue
                if pos[r] < len(p):
                    n = min(chunk or len(p), len(p) - pos[r])
                    steps.append(RowStep(r, pos[r], n, pos[r] + n == len(p)))
                    pos[r] += n
                else:
                    steps.append(RowStep(r, known - 1, 1, True))
            res = self.run(news, steps)
            news = []
            assert res.error is None, res.error
            for j, (r, tok) in enumerate(zip(unpack_ids(res.rows).tolist(), unpack_ids(res.tokens).tolist())):
                out[r].append(tok)
                logits[r].append(self.runner.last_logits[j].clone())
        return out, logits

    def close(self) -> None:
        self.pool.close()
        self.pool.unlink()


@pytest.fixture
def make_harness():
    """Factory for RunnerHarness objects; every pool is unlinked at teardown."""
    made: list[RunnerHarness] = []

    def make(model_path: str, **kw) -> RunnerHarness:
        h = RunnerHarness(model_path, **kw)
        made.append(h)
        return h

    yield make
    for h in made:
        h.close()
