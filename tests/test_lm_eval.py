"""lm-evaluation-harness against ferroxmp: its `local-completions` model scores the same
as its `hf` model on the same checkpoint.

Two tasks ship in tests/lm_eval_tasks/ with local jsonl data (no hub): a 20-item
multiple-choice task scored by loglikelihood (lm-eval sends `echo: true, logprobs: 1,
max_tokens: 1` with token-id prompts and sums the echoed prompt logprobs of the
continuation) and a 10-item greedy `generate_until` task. The oracle is lm-eval's own
`hf` model (transformers, float32) on the same random-weight checkpoint: every logged
per-choice loglikelihood must agree within 1e-3, every per-item accuracy and every
generated string must be equal. Random weights make the accuracies meaningless; the
equality is the test. local-completions runs with batch_size 2 (a list of prompts
per request) and 4 requests in flight, so the server batches them.
"""
from __future__ import annotations

import contextlib
import os

import pytest
import requests

from ferroxmp.tiny_model import build_model
from serverproc import serving

TASKS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lm_eval_tasks")
TASKS = ["ferroxmp_mc", "ferroxmp_gen"]
LL_TOL = 1e-3


@pytest.fixture(scope="module")
def offline(tmp_path_factory):
    """No hub: offline flags and private caches, set before lm_eval (datasets, transformers)
    is imported, and on their already-read config if another test imported them first."""
    cache = str(tmp_path_factory.mktemp("hf_cache"))
    with pytest.MonkeyPatch.context() as mp:
        for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
            mp.setenv(name, "1")
        mp.setenv("HF_HOME", cache)
        mp.setenv("HF_DATASETS_CACHE", os.path.join(cache, "datasets"))
        import datasets.config
        import huggingface_hub.constants
        mp.setattr(datasets.config, "HF_DATASETS_CACHE", os.path.join(cache, "datasets"))
        mp.setattr(datasets.config, "HF_HUB_OFFLINE", True)
        mp.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
        yield


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    """The tiny llama checkpoint with its HF tokenizer (tokenizer.json + config) in the folder."""
    return build_model("llama", str(tmp_path_factory.mktemp("lm_eval_model") / "llama"))


@contextlib.contextmanager
def in_tasks_dir():
    """The task YAMLs name their jsonl files relative to the working directory."""
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(TASKS_DIR)
        yield


def evaluate(model: str, model_args: dict, **kw) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager
    tm = TaskManager(include_path=TASKS_DIR, include_defaults=False)
    with in_tasks_dir():
        return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=TASKS, task_manager=tm,
                                       log_samples=True, **kw)


@pytest.fixture(scope="module")
def hf_run(offline, checkpoint) -> dict:
    return evaluate("hf", dict(pretrained=checkpoint, dtype="float32", device="cpu"), batch_size=1)


@pytest.fixture(scope="module")
def server_run(offline, checkpoint) -> dict:
    with serving(checkpoint, "--kv-pages", "512") as srv:
        model = requests.get(srv.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        # max_retries 1: a refused or failed request fails the run instead of being retried
        return evaluate("local-completions", dict(
            base_url=srv.url + "/v1/completions", model=model, tokenizer=checkpoint,
            tokenizer_backend="huggingface", batch_size=2, num_concurrent=4, max_retries=1, timeout=120))


def samples(run: dict, task: str) -> list[dict]:
    return sorted(run["samples"][task], key=lambda s: s["doc_id"])


def test_each_multiple_choice_item_gets_the_loglikelihoods_and_accuracy_of_lm_eval_hf(hf_run, server_run):
    """Fails if an echoed prompt logprob is off (a wrong position, a cached prefix adopted
    instead of computed, a null where a value belongs), if the choices of a multi-prompt
    request come back in the wrong order, or if the server mis-tokenized a token-id prompt."""
    ours, theirs = samples(server_run, "ferroxmp_mc"), samples(hf_run, "ferroxmp_mc")
    assert len(ours) == len(theirs) == 20
    for a, b in zip(ours, theirs):
        assert a["doc_id"] == b["doc_id"] and a["arguments"] == b["arguments"]
        assert len(a["filtered_resps"]) == len(b["filtered_resps"]) == 4
        for (ll_a, greedy_a), (ll_b, greedy_b) in zip(a["filtered_resps"], b["filtered_resps"]):
            assert abs(ll_a - ll_b) < LL_TOL, (a["doc_id"], ll_a, ll_b)
            assert greedy_a == greedy_b, a["doc_id"]
        assert (a["acc"], a["acc_norm"]) == (b["acc"], b["acc_norm"]), a["doc_id"]
    for metric in ("acc,none", "acc_norm,none"):
        assert server_run["results"]["ferroxmp_mc"][metric] == hf_run["results"]["ferroxmp_mc"][metric]


def test_each_generate_until_item_gets_the_greedy_text_of_lm_eval_hf(hf_run, server_run):
    """Fails if the server's greedy tokens, its detokenized text, its stop-string trimming
    or its EOS handling differ from transformers' generate under lm-eval's own post-processing."""
    ours, theirs = samples(server_run, "ferroxmp_gen"), samples(hf_run, "ferroxmp_gen")
    assert len(ours) == len(theirs) == 10
    for a, b in zip(ours, theirs):
        assert a["doc_id"] == b["doc_id"]
        assert a["filtered_resps"] == b["filtered_resps"], a["doc_id"]
        assert a["exact_match"] == b["exact_match"], a["doc_id"]
    # The comparison means something only if text was generated.
    assert sum(bool(s["filtered_resps"][0].strip()) for s in theirs) >= 5
    assert server_run["results"]["ferroxmp_gen"]["exact_match,none"] == \
        hf_run["results"]["ferroxmp_gen"]["exact_match,none"]
