"""--tp N: the ranks split the model (parallel/group.py) and follow rank 0 step by step (parallel/step.py).

Oracle: the tp=1 ModelRunner in this process (the code path of a --tp 1 worker, checked
against transformers elsewhere) on the same checkpoint, greedy, float32. The servers get
the prompts over HTTP, concurrently and with small prefill chunks (--max-batch-tokens),
plus a request sharing a cached prefix, so batched decode, chunked prefill, multi-page
reads and prefix adoption all cross the ranks. Every server must leave nothing behind:
no process of any rank, no shared-memory segment, no run directory.
"""
from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
import torch

from ferroxmp.gpu_worker.loader import load_config, load_weights
from ferroxmp.gpu_worker.parallel.group import Shard
from ferroxmp.tiny_model import TINY_SHAPES
from serverproc import ServerProcess, free_port, pid_alive, stream_lines

FLAGS = ("--page-size", "4", "--kv-pages", "256", "--max-running-requests", "8", "--max-batch-tokens", "12")
PROMPTS = {0: [5, 6, 7, 8, 9, 10, 11], 1: list(range(20, 45)), 2: [300, 17, 17, 4, 999, 123, 64, 3, 77, 8, 41]}
WARM = PROMPTS[1][:16] + [7, 7, 7]  # adopts the first 16 tokens (4 pages) of prompt 1
N_NEW = 8


@pytest.fixture(scope="module")
def expected(tiny_models):
    """shape -> {prompt index: greedy tokens} from the tp=1 runner, 'warm' computed cold,
    and 'prompt_logprobs': each token's logprob after the ones before it in prompt 1."""
    from conftest import RunnerHarness
    from ferroxmp.protocol import RowStep, SamplingParams
    out = {}
    for shape in TINY_SHAPES:
        h = RunnerHarness(tiny_models[shape], page_size=4)
        try:
            got, _ = h.generate({**PROMPTS, 3: WARM}, N_NEW)
            p = PROMPTS[1]
            res = h.run([h.new_row(4, p, SamplingParams(temperature=0.0, prompt_logprobs=0))], [RowStep(4, 0, len(p), True)])
            lps = [lp.token_logprob for lp in res.prompt_logprobs[4]]
        finally:
            h.close()
        out[shape] = {**{i: got[i] for i in PROMPTS}, "warm": got[3], "prompt_logprobs": lps}
    return out


def generate(url: str, ids: list[int]) -> list[int]:
    r = requests.post(url + "/generate", json={"input_ids": ids, "sampling_params": {
        "temperature": 0.0, "max_tokens": N_NEW, "ignore_eos": True}}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def served_tokens(url: str) -> dict:
    """The same as `expected` over HTTP; prompt logprobs from echo + logprobs (lm_head on
    every prompt position, in --max-batch-tokens chunks), rounded to 1e-4."""
    with ThreadPoolExecutor(len(PROMPTS)) as ex:  # concurrently: one batch decodes every row
        got = dict(zip(PROMPTS, ex.map(lambda ids: generate(url, ids), PROMPTS.values())))
    got["warm"] = generate(url, WARM)
    r = requests.post(url + "/v1/completions", json={"prompt": PROMPTS[1], "echo": True, "logprobs": 0,
                                                     "max_tokens": 1, "temperature": 0.0}, timeout=120)
    assert r.status_code == 200, r.text
    got["prompt_logprobs"] = r.json()["choices"][0]["logprobs"]["token_logprobs"][1:len(PROMPTS[1])]
    return got


def same(got: dict, want: dict) -> bool:
    lps = (got.pop("prompt_logprobs"), want["prompt_logprobs"])
    assert len(lps[0]) == len(lps[1]) and max(abs(a - b) for a, b in zip(*lps)) < 1e-4, lps
    return got == {k: v for k, v in want.items() if k != "prompt_logprobs"}


def all_pids(srv: ServerProcess) -> list[int]:
    p = srv.info["processes"]
    return [p["frontend"], p["scheduler"], *p["workers"]]


def left_behind(srv: ServerProcess, pids: list[int]) -> list[str]:
    return ([f"pid {p}" for p in pids if pid_alive(p)] + glob.glob(f"/dev/shm/fxmp_{srv.proc.pid}_*")
            + glob.glob(os.path.join(srv.tmp, "ferroxmp-*")))


def wait_gone(what, timeout: float = 20.0) -> list:
    deadline = time.time() + timeout
    while (left := what()) and time.time() < deadline:
        time.sleep(0.2)
    return left


def test_each_rank_reads_only_its_slices_and_the_slices_rebuild_every_tensor(tiny_models, monkeypatch):
    """A rank must never read a whole tensor it does not keep (the point of sharding the
    load); and the ranks' q/k/v, MLP and vocabulary slices, put back together, must be the
    checkpoint's tensors. With 4 ranks and 2 KV heads each KV head is replicated on the
    two ranks whose query heads read it."""
    import safetensors
    path = tiny_models["llama"]
    cfg = load_config(path)
    full = load_weights(path, torch.device("cpu"), cfg.dtype)
    real_open = safetensors.safe_open

    class NoWholeReads:
        def __init__(self, *a, **kw):
            self.f = real_open(*a, **kw)

        def __enter__(self):
            self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def keys(self):
            return self.f.keys()

        def get_slice(self, name):
            return self.f.get_slice(name)

        def get_tensor(self, name):
            raise AssertionError(f"a sharded load read all of {name}")

    monkeypatch.setattr(safetensors, "safe_open", NoWholeReads)
    for world in (2, 4):
        shards = [Shard(cfg, r, world) for r in range(world)]
        parts = [load_weights(path, torch.device("cpu"), cfg.dtype, select=s.index) for s in shards]
        a = "model.layers.1.self_attn."
        m = "model.layers.1.mlp."
        assert torch.equal(torch.cat([p[a + "q_proj.weight"] for p in parts]), full[a + "q_proj.weight"])
        assert torch.equal(torch.cat([p[a + "o_proj.weight"] for p in parts], 1), full[a + "o_proj.weight"])
        assert torch.equal(torch.cat([p[m + "up_proj.weight"] for p in parts]), full[m + "up_proj.weight"])
        assert torch.equal(torch.cat([p[m + "down_proj.weight"] for p in parts], 1), full[m + "down_proj.weight"])
        assert torch.equal(torch.cat([p["model.embed_tokens.weight"] for p in parts]), full["model.embed_tokens.weight"])
        hd, group = cfg.head_dim, cfg.num_heads // cfg.num_kv_heads
        for s, p in zip(shards, parts):
            kv_heads = sorted({h // group for h in range(s.first_head, s.first_head + s.heads)})
            want = torch.cat([full[a + "k_proj.weight"][h * hd:(h + 1) * hd] for h in kv_heads])
            assert torch.equal(p[a + "k_proj.weight"], want), (world, s.rank)
            assert p["model.norm.weight"].shape == full["model.norm.weight"].shape


def test_a_gguf_rank_gets_the_same_shard_as_a_safetensors_rank(tiny_models, tmp_path):
    """A GGUF is dequantized whole and then cut (the Q/K permutation undone first): each
    rank's tensors must equal, bit for bit, what it reads as slices of the folder (qwen2:
    q/k/v biases, tied embeddings)."""
    from gguf_writer import write_gguf
    folder = tiny_models["qwen2"]
    path = write_gguf(folder, str(tmp_path / "qwen2-f32.gguf"))
    cfg = load_config(folder)
    for rank in range(2):
        shard = Shard(cfg, rank, 2)
        want = load_weights(folder, torch.device("cpu"), torch.float32, select=shard.index)
        got = load_weights(path, torch.device("cpu"), torch.float32, select=shard.index)
        assert sorted(got) == sorted(want)
        for name, t in want.items():
            assert torch.equal(got[name], t), (rank, name)


@pytest.mark.parametrize("shape", TINY_SHAPES)
def test_tp2_serves_the_same_greedy_tokens_as_tp1(tiny_models, expected, shape):
    """Concurrent prompts, chunked prefill and a prefix-cache hit over HTTP with two
    ranks must give the tp=1 runner's tokens; then SIGTERM stops every rank."""
    srv = ServerProcess(tiny_models[shape], "--tp", "2", *FLAGS)
    try:
        pids = all_pids(srv)
        assert len(srv.info["processes"]["workers"]) == 2
        assert same(served_tokens(srv.url), expected[shape])
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.wait_exit(30) == 0
        assert wait_gone(lambda: left_behind(srv, pids)) == []
    finally:
        srv.stop()


def node_children(pid: int) -> list[int]:
    kids = []
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            kids.append(int(stat.split("/")[2]))
    return kids


def test_two_nodes_serve_the_same_tokens_and_a_lost_rank_takes_both_down(tiny_models, expected):
    """Two supervisors on one machine (node 1 runs ranks 2-3 only, without shared memory:
    its page lists arrive with each step), --tp 4 so each of the 2 KV heads is replicated
    on two ranks. Then SIGKILL one rank of node 1: both supervisors must exit non-zero and
    leave nothing, within a timeout."""
    addr = f"127.0.0.1:{free_port()}"
    dist = ("--tp", "4", "--nnodes", "2", "--dist-init-addr", addr, *FLAGS)
    tmp1 = tempfile.mkdtemp(prefix="fxmp-node1-")
    with open(os.path.join(tmp1, "node1.log"), "w") as log1:
        node1 = subprocess.Popen([sys.executable, "-m", "ferroxmp.cli", "serve", "--model", tiny_models["llama"],
                                  "--node-rank", "1", *dist], stdout=log1, stderr=subprocess.STDOUT,
                                 env=dict(os.environ, TMPDIR=tmp1))
    srv, ranks1 = None, []
    try:
        srv = ServerProcess(tiny_models["llama"], "--node-rank", "0", *dist)
        pids0 = all_pids(srv)
        ranks1 = node_children(node1.pid)
        assert len(srv.info["processes"]["workers"]) == 2 and len(ranks1) == 2
        assert same(served_tokens(srv.url), expected["llama"])
        os.kill(ranks1[1], signal.SIGKILL)
        assert srv.wait_exit(30) != 0, "node 0 must go down when a rank on node 1 dies"
        assert node1.wait(30) != 0
        assert wait_gone(lambda: left_behind(srv, pids0) + [f"pid {p}" for p in ranks1 if pid_alive(p)]
                         + glob.glob(os.path.join(tmp1, "ferroxmp-*"))) == []
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait()
        if srv is not None:
            srv.stop()
        for p in ranks1:  # node 1's ranks, should any have outlived their supervisor
            if pid_alive(p) and "parallel.rank" in open(f"/proc/{p}/cmdline").read():
                os.kill(p, signal.SIGKILL)


def test_killing_one_rank_mid_stream_ends_the_stream_and_the_server_cleanly(tiny_models):
    """SIGKILL rank 1 while a stream decodes: the client sees an error or a cut stream
    (never [DONE]) within 10 s, the supervisor exits non-zero, and every process, the
    shared-memory pool and the run directory are gone within 20 s."""
    srv = ServerProcess(tiny_models["qwen2"], "--tp", "2", *FLAGS)
    try:
        pids = all_pids(srv)
        resp = requests.post(srv.url + "/v1/completions", json={
            "model": "qwen2", "prompt": "hello there", "max_tokens": 900, "ignore_eos": True, "stream": True},
            stream=True, timeout=(5, 10))
        assert resp.status_code == 200, resp.text
        events = stream_lines(resp)
        next(events)
        os.kill(srv.info["processes"]["workers"][1], signal.SIGKILL)
        t0 = time.time()
        last = None
        try:
            for last in events:
                if last == b"[DONE]" or (isinstance(last, dict) and "error" in last):
                    break
        except requests.RequestException:
            last = "connection error"
        assert time.time() - t0 < 10, "the client waited over 10 s for an error"
        assert last != b"[DONE]", "a stream cut short by a dead rank must not end as a success"
        assert srv.wait_exit(20) != 0
        assert wait_gone(lambda: left_behind(srv, pids)) == []
    finally:
        srv.stop()


def test_a_tp_that_does_not_divide_the_heads_is_refused_by_name_and_leaves_nothing(tiny_models):
    """--tp 3 on 4 query / 2 KV heads: every rank refuses before the rendezvous (no rank
    may wait for another that already quit), the server exits non-zero saying why."""
    tmp = tempfile.mkdtemp(prefix="fxmp-tp3-")
    proc = subprocess.Popen([sys.executable, "-m", "ferroxmp.cli", "serve", "--model", tiny_models["llama"],
                             "--tp", "3", "--port", str(free_port()), "--kv-pages", "64"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, TMPDIR=tmp))
    try:
        log, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0
    assert "--tp 3 cannot split 4 attention heads" in log, log[-3000:]
    assert glob.glob(os.path.join(tmp, "ferroxmp-*")) + glob.glob(f"/dev/shm/fxmp_{proc.pid}_*") == []


def test_a_sigkilled_supervisor_takes_every_rank_and_the_shared_memory_with_it(tiny_models):
    """No cleanup code of the supervisor runs: the ranks > 0 must go on their own (parent
    death signal) and rank 0 must still unlink the pool and remove the run directory."""
    srv = ServerProcess(tiny_models["mistral"], "--tp", "2", *FLAGS)
    try:
        pids = all_pids(srv)
        srv.proc.kill()
        srv.proc.wait()
        assert wait_gone(lambda: left_behind(srv, pids)) == []
    finally:
        srv.stop()
