"""--draft-model (issue 29's second drafter): a small model of the target's tokenizer drafts,
the target verifies with each row's own sampler, so the output is the target's alone.

The oracle is the same engine without drafts: greedy (and seeded sampled) output must be
identical, through whole and chunked prefill, a prefix-cache hit, stop tokens and a
batch of rows at once. Three drafts:
- the target itself: every draft must be accepted (accepted == drafted > 0). This is
  the check that the draft's KV is in step with the target's: the draft computes the
  target's own logits only if every position it reads holds what the target computed
  there, including the pages the second prompt adopts from the first (prefix hit);
- the target's weights plus noise (another model of the same vocabulary): some drafts
  accepted, some rejected;
- the tiny qwen3 (another architecture and KV geometry, vocabulary 1000 like every
  tiny shape): its drafts are rejected (almost) always, so the rejection path runs.

Mutants run by hand against these tests (each caught, then reverted):
- `DraftModel.sync` computing only the length-1 steps (prefill chunks skipped, so the
  draft's KV of every prompt, the adopted prefix included, is never written): the self
  draft got 73 of 254 drafts accepted (whole prefill), 83 of 265 (chunked): the
  `accepted == drafted` assertions fail; the output stayed identical, as verification
  promises, so only the acceptance count can catch a draft out of step.
- the k-th draft forward skipped (d_k's KV never written, a hole after every fully
  accepted draft): 164 of 176 accepted: caught.
(`DraftModel.forget` doing nothing was not caught: a reused row slot's mirror is read
only when the new request's first step is a decode step at exactly the old held length.)
Then the flag refusals, a draft of another vocabulary refused at load naming both
sizes, the KV sizing counting the draft's bytes per page, and a real server with
`--draft-model` answering as one without and counting its drafts in /metrics.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from typing import NamedTuple

import numpy as np
import pytest
import torch

from engine import LocalEngine
from ferroxmp.config import ServerArgs
from ferroxmp.gpu_worker.kv.pool import pages_for_budget
from ferroxmp.gpu_worker.loader import UnsupportedModel, load_config
from ferroxmp.gpu_worker.runner import ModelRunner
from ferroxmp.page_pool import PagePool
from serverproc import greedy_completion, metric, serving


def _noisy_copy(src: str, out: str, scale: float = 0.1) -> str:
    """Another model of the same vocabulary and shape: the target's weights plus Gaussian
    noise of `scale` times each tensor's spread (0.1: about half its drafts accepted)."""
    from safetensors.torch import load_file, save_file
    shutil.copytree(src, out)
    weights = load_file(os.path.join(src, "model.safetensors"))
    g = torch.Generator().manual_seed(1)
    noisy = {k: t + scale * t.std() * torch.randn(t.shape, generator=g) for k, t in weights.items()}
    save_file(noisy, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def drafts(tiny_models, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("drafts")
    return {"self": tiny_models["llama"], "noisy": _noisy_copy(tiny_models["llama"], str(root / "noisy")),
            "qwen3": tiny_models["qwen3"]}


class Counts(NamedTuple):
    drafted: int
    accepted: int
    cached: int  # prompt tokens adopted from the prefix cache


def _run(target: str, draft, chunk: int = 64, stops=(), deterministic: bool = False, quantization: str = "auto",
         **sampling) -> tuple[list, Counts]:
    eng = LocalEngine(target, num_pages=256, page_size=4, max_batch_tokens=chunk, max_rows=8,
                      deterministic=deterministic, spec_tokens=4 if draft else 0, draft_model=draft,
                      draft_quantization=quantization)
    try:
        rng = np.random.default_rng(7)
        shared = rng.integers(5, 300, 48).tolist()
        prompts = [shared + rng.integers(5, 300, 6).tolist(), shared + rng.integers(5, 300, 9).tolist(),
                   rng.integers(5, 300, 13).tolist(), shared[:8] * 3]
        # One at a time: the second prompt adopts the first's 48-token prefix (12 pages).
        outs = [eng.generate(p, 32, stop_token_ids=list(stops), **sampling) for p in prompts]
        cached = eng.core.stats().cached_prompt_tokens
        rids = [eng.submit(p, 24, stop_token_ids=list(stops), **sampling) for p in prompts]
        eng.run_until(lambda: all(r in eng.finish for r in rids))  # batched, every prefix cached now
        outs += [eng.outputs[r] for r in rids]
        outs.append([eng.finish[r] for r in rids])
        s = eng.core.stats()
        return outs, Counts(s.spec_draft_tokens, s.spec_accepted_tokens, cached)
    finally:
        eng.close()


@pytest.mark.parametrize("chunk", [64, 5], ids=["whole-prefill", "chunked-prefill"])
def test_greedy_output_is_the_targets_and_a_self_draft_is_always_accepted(tiny_model, drafts, chunk):
    plain, counts = _run(tiny_model, None, chunk)
    assert counts.drafted == 0 and counts.cached >= 44, counts
    got, counts = _run(tiny_model, drafts["self"], chunk)
    assert got == plain
    assert counts.drafted > 50 and counts.accepted == counts.drafted, counts


@pytest.mark.parametrize("which", ["noisy", "qwen3"])
def test_greedy_output_is_the_targets_with_a_draft_that_is_sometimes_wrong(tiny_model, drafts, which):
    plain, _ = _run(tiny_model, None, 5)
    got, counts = _run(tiny_model, drafts[which], 5)
    assert got == plain
    assert counts.drafted > 0 and counts.accepted < counts.drafted, counts
    if which == "noisy":
        assert counts.accepted > 0, counts


def test_deterministic_mode_with_a_draft_is_bit_identical(tiny_model, drafts):
    plain, _ = _run(tiny_model, None, 5, deterministic=True)
    got, counts = _run(tiny_model, drafts["noisy"], 5, deterministic=True)
    assert got == plain and 0 < counts.accepted < counts.drafted, counts


def test_stop_tokens_end_a_drafting_row_where_they_end_a_plain_one(tiny_model, drafts):
    plain, _ = _run(tiny_model, None)
    stops = {t for out in plain[:4] for t in out[5:8]}  # tokens the outputs do produce
    plain, _ = _run(tiny_model, None, stops=stops)
    got, counts = _run(tiny_model, drafts["self"], stops=stops)
    assert got == plain
    assert any(r == "stop" for r in plain[-1]), "some batched row must end on a stop token"
    assert counts.accepted == counts.drafted > 0, counts


def test_seeded_sampled_output_is_identical_with_and_without_a_draft(tiny_model, drafts):
    """The draft is greedy; the target verifies with the row's own seeded draw (a
    Gumbel-max fixed by seed and position), so the sample is the one without drafts."""
    sampling = dict(temperature=0.1, top_k=3, seed=11)
    plain, _ = _run(tiny_model, None, **sampling)
    got, counts = _run(tiny_model, drafts["self"], **sampling)
    assert got == plain
    assert 0 < counts.accepted <= counts.drafted, counts
    greedy, _ = _run(tiny_model, None)
    assert greedy[:-1] != plain[:-1], "the sampled run must differ from greedy, or sampling was not tested"


def test_self_speculation_with_an_int4_draft_of_the_target(tiny_model):
    """The target's own checkpoint in int4 drafts for its float32 self: the draft's weights
    are a fraction of the target's, its KV the same size (same pages, same geometry)."""
    eng = LocalEngine(tiny_model, num_pages=256, page_size=4, spec_tokens=4, draft_model=tiny_model,
                      draft_quantization="int4")
    try:
        info = eng.runner.memory_info()
        assert info["quantization"] == "none" and info["draft"]["quantization"] == "int4"
        assert info["draft"]["weight_bytes"] < info["weight_bytes"] / 3
        assert info["draft"]["kv_bytes"] == info["kv_bytes"] and eng.runner.kv_bytes == 2 * info["kv_bytes"]
    finally:
        eng.close()
    plain, _ = _run(tiny_model, None)
    got, counts = _run(tiny_model, tiny_model, quantization="int4")
    assert got == plain
    assert 0 < counts.accepted <= counts.drafted, counts


# ---- refusals and sizing ----------------------------------------------------------

@pytest.mark.parametrize("flags,needle", [
    (dict(speculative_ngram=True), "not both"),
    (dict(tp=2), "--tp > 1"),
    (dict(kv_host_gb=1.0), "--kv-host-gb"),
    (dict(kv_cache_dir="/tmp/x"), "--kv-cache-dir"),
    (dict(device="cuda", draft_quantization="fp16"), "--draft-quantization"),
])
def test_flags_that_do_not_go_with_a_draft_model_are_refused(tiny_model, flags, needle):
    with pytest.raises(ValueError, match="^--draft-(model|quantization): ") as e:
        ServerArgs(model=tiny_model, draft_model=tiny_model, **flags).validate()
    assert needle in str(e.value)
    ServerArgs(model=tiny_model, draft_model=tiny_model).validate()


def test_a_draft_path_that_is_no_checkpoint_is_refused(tmp_path):
    with pytest.raises(ValueError, match="^--draft-model: .* neither"):
        ServerArgs(draft_model=str(tmp_path / "nothing")).validate()


def test_spec_tokens_is_on_for_either_drafter(tiny_model):
    assert ServerArgs(decode_steps=1).spec_tokens == 0
    assert ServerArgs(speculative_ngram=True, num_speculative_tokens=3).spec_tokens == 3
    assert ServerArgs(draft_model=tiny_model, num_speculative_tokens=5).spec_tokens == 5


def test_a_draft_of_another_vocabulary_is_refused_at_load_naming_both_sizes(tiny_model, tmp_path):
    """The tiny llama grown to 1200 tokens (embedding and head rows added): a checkpoint the
    loader takes, whose ids would mean other tokens than the target's."""
    from safetensors.torch import load_file, save_file
    other = str(tmp_path / "other-vocab")
    shutil.copytree(tiny_model, other)
    with open(os.path.join(other, "config.json")) as f:
        cfg = json.load(f)
    cfg["vocab_size"] = 1200
    with open(os.path.join(other, "config.json"), "w") as f:
        json.dump(cfg, f)
    w = load_file(os.path.join(other, "model.safetensors"))
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        w[name] = torch.cat([w[name], w[name][:200]])
    save_file(w, os.path.join(other, "model.safetensors"), metadata={"format": "pt"})
    pool = PagePool.create(16, 2, 8)
    try:
        with pytest.raises(UnsupportedModel, match="1200 tokens and the target's 1000"):
            ModelRunner(tiny_model, pool, 4, device="cpu", draft_model=other)
    finally:
        pool.close()
        pool.unlink()


def test_the_kv_budget_counts_the_drafts_bytes_per_page(tiny_model):
    cfg = load_config(tiny_model)
    per_token = cfg.kv_bytes_per_token()
    gb = 1000 * 16 * per_token / 2**30  # 1000 pages of the target alone
    cpu = torch.device("cpu")
    assert pages_for_budget(cfg, 16, None, gb, 0.9, cpu) == 1000
    assert pages_for_budget(cfg, 16, None, gb, 0.9, cpu, draft_bytes_per_token=per_token) == 500


# ---- a real server --------------------------------------------------------------

def test_a_server_with_a_draft_model_answers_as_one_without_and_counts_its_drafts(tiny_model, drafts):
    prompts = ["the cat sat on the mat and the dog", "def f(x):\n    return x + 1\n", "hello there"]
    with serving(tiny_model) as plain:
        want = [greedy_completion(plain, p, 40) for p in prompts]
    with serving(tiny_model, "--draft-model", drafts["self"], "--num-speculative-tokens", "3") as srv:
        got = [greedy_completion(srv, p, 40) for p in prompts]
        time.sleep(1.1)  # counters ride the scheduler's heartbeat
        drafted = metric(srv.url, "ferroxmp_spec_draft_tokens_total", srv.headers)
        accepted = metric(srv.url, "ferroxmp_spec_accepted_tokens_total", srv.headers)
        memory = srv.info["worker_info"]["memory"]
    assert got == want
    assert drafted > 0 and accepted == drafted, (drafted, accepted)
    assert memory["draft"]["weight_bytes"] > 0 and memory["draft"]["kv_bytes"] == memory["kv_bytes"]
