#!/usr/bin/env python3
"""Benchmark the worker's ModelRunner against the floor: a minimal torch forward of the same
model, same weights, same process, timings interleaved (runner, floor, runner, floor, ...).

The floor (`MinimalForward`) is what a forward costs without serving: fused QKV and
gate/up matmuls (the runner's own weight tensors), RoPE, SDPA over contiguous per-row K/V
`[batch, kv_heads, max_len, head_dim]` (no pages, no masks: every row has the same
length), greedy argmax. The runner pays on top of it: the step plan, paged K/V reads
(decode rows: the decode mirror, filled once per row; `--decode-path gather`: every layer),
masks, sampling, row bookkeeping. Interleaving makes the ratio fair on a shared box: a
neighbour that steals a core slows both sides of a pair alike.

Decode: the median time of one step at each batch x context (rows hold `context` tokens;
the KV values of the context are whatever the pool holds, which does not change the
time). Prefill: tokens/s of one row's whole prompt in one chunk. Optionally also
transformers' own forward (eager attention, DynamicCache), not interleaved.

    .venv/bin/python tools/bench_worker.py --model /tmp/smol [--batches 1,16,64]
        [--contexts 160,512,2048] [--prefills 512,2048] [--out bench.json]
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
import torch.nn.functional as F  # noqa: E402

from ferroxmp.protocol import ForwardBatch, NewRow, RowStep, SamplingParams, pack_ids  # noqa: E402
from ferroxmp.page_pool import PagePool  # noqa: E402

GREEDY = SamplingParams(temperature=0.0)


class MinimalForward:
    """The floor: the runner's DecoderLM weights (and its matmul dispatch, so quantized
    weights multiply through their kernels), contiguous K/V, SDPA, argmax."""

    def __init__(self, model, batch: int, max_len: int):
        cfg = model.cfg
        self.m, self.cfg = model, cfg
        shape = (cfg.num_layers, batch, cfg.num_kv_heads, max_len, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=model.dtype)
        self.v = torch.zeros(shape, dtype=model.dtype)

    def forward(self, ids: torch.Tensor, pos0: int) -> torch.Tensor:
        """ids [B, n], every row at positions pos0..pos0+n-1 -> next token per row [B]."""
        m, cfg = self.m, self.cfg
        B, n = ids.shape
        nh, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_w, kv_w, half = nh * hd, nkv * hd, hd // 2
        cos = m.cos_table[pos0:pos0 + n].to(m.dtype)[None, :, None, :]
        sin = m.sin_table[pos0:pos0 + n].to(m.dtype)[None, :, None, :]

        def rope(x):
            return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin

        h = m.embed_ids(ids.reshape(-1)).view(B, n, -1)
        end = pos0 + n
        for li, L in enumerate(m.layers):
            x = m._rms(h, L.in_norm)
            qkv = m.linear(x, L.w_qkv, L.b_qkv)
            q = qkv[..., :q_w].view(B, n, nh, hd)
            k = qkv[..., q_w:q_w + kv_w].view(B, n, nkv, hd)
            v = qkv[..., q_w + kv_w:].view(B, n, nkv, hd)
            if L.q_norm is not None:
                q, k = m._rms(q, L.q_norm), m._rms(k, L.k_norm)
            q, k = rope(q), rope(k)
            self.k[li, :, :, pos0:end] = k.transpose(1, 2)
            self.v[li, :, :, pos0:end] = v.transpose(1, 2)
            K, V = self.k[li, :, :, :end], self.v[li, :, :, :end]
            if n == 1:  # GQA as G queries per KV head: no K/V repeat
                o = F.scaled_dot_product_attention(q.view(B, nkv, nh // nkv, hd), K, V)
            else:
                o = F.scaled_dot_product_attention(q.transpose(1, 2), K, V, is_causal=pos0 == 0,
                                                   enable_gqa=nh != nkv).transpose(1, 2)
            h = h + m.linear(o.reshape(B, n, q_w), L.w_o, L.b_o)
            x = m._rms(h, L.post_norm)
            gu = m.linear(x, L.w_gate_up)
            h = h + m.linear(F.silu(gu[..., :cfg.intermediate_size]) * gu[..., cfg.intermediate_size:], L.w_down)
        return m.logits(h[:, -1]).argmax(-1)


def _pair(a, b, repeat: int) -> tuple[float, float]:
    """Median seconds of a() and of b(), run alternately after one warm-up each."""
    a(), b()
    ta, tb = [], []
    for _ in range(repeat):
        t = time.perf_counter()
        a()
        ta.append(time.perf_counter() - t)
        t = time.perf_counter()
        b()
        tb.append(time.perf_counter() - t)
    return statistics.median(ta), statistics.median(tb)


def _read_floor(runner, ctx: int, runner_step, steps: int) -> tuple[float, float, int]:
    """The bandwidth floor of a one-row step: the bytes it must read (every weight once,
    the row's K/V at `ctx` positions) read from a buffer in 2 MiB pages (where the weights
    live: gpu_worker/huge_pages.py) the fastest way this machine reads (read_floor.py),
    alternately with the runner's step. Returns (runner s, read s, bytes)."""
    from read_floor import ReadFloor
    nbytes = sum(runner.model.weight_bytes().values()) + runner.config.kv_bytes_per_token(runner.kv.k.dtype) * ctx
    floor = ReadFloor(nbytes)
    _, way = floor.seconds(nbytes)
    t_run, t_read = _pair(runner_step, floor.ways(nbytes)[way], steps)
    return t_run, t_read, nbytes


class RunnerBench:
    """A ModelRunner on a private pool. Row r's j-th page is j * rows + r (interleaved, as
    pages grown one at a time by concurrent rows are), or consecutive with --consecutive."""

    def __init__(self, path: str, rows: int, max_len: int, page_size: int, consecutive: bool,
                 attention: str, decode_path: str = "auto", quantization: str = "auto",
                 fused_decode: bool = True, kv_cache_dtype: str = "auto", decode_steps: int = 1):
        from ferroxmp.gpu_worker.runner import ModelRunner
        per_row = -(-max_len // page_size)
        self.pool = PagePool.create(num_pages=per_row * rows, max_rows=rows, max_pages_per_row=per_row)
        kw = {} if attention == "auto" else {"attention": attention}  # "auto" also runs older runners
        kw["quantization"] = quantization
        if not fused_decode:  # only when asked: older runners lack the argument
            kw["fused_decode"] = False
        if kv_cache_dtype != "auto":
            kw["kv_cache_dtype"] = kv_cache_dtype
        if decode_steps > 1:
            kw["decode_steps"] = decode_steps
        self.runner = ModelRunner(path, self.pool, page_size, device="cpu", **kw)
        if decode_path == "gather" and getattr(self.runner.attn, "mirror", None) is not None:
            self.runner.attn.mirror = None  # the fallback: gather each row's pages every layer
        for r in range(rows):
            pages = [r * per_row + j for j in range(per_row)] if consecutive else [j * rows + r for j in range(per_row)]
            self.pool.set_row(r, pages, 0)
        self.bid = 0

    def run(self, new_rows, steps, spec=None):
        self.bid += 1
        res = self.runner.execute(ForwardBatch(self.bid, new_rows, steps, spec or {}))
        assert res.error is None, res.error
        return res

    def decode(self, steps: int = 1, row: int = 0):
        """One decode call of `row` from its last token: `steps` greedy steps in it (the
        runner's --decode-steps budget), or one."""
        last = len(self.runner.rows[row].tokens) - 1
        return self.run([], [RowStep(row, last, 1, True)], {row: steps - 1} if steps > 1 else None)

    def start(self, prompts: dict[int, list[int]]) -> None:
        self.run([NewRow(r, pack_ids(p), GREEDY, 0) for r, p in prompts.items()], [])

    def close(self) -> None:
        self.pool.close()
        self.pool.unlink()


def bench(path: str, batches: list[int], contexts: list[int], prefills: list[int], steps: int,
          page_size: int, consecutive: bool, attention: str, decode_path: str = "auto",
          quantization: str = "auto", fused_decode: bool = True, kv_cache_dtype: str = "auto",
          decode_steps: int = 1) -> dict:
    max_b = max(batches)
    # the b1 rows step again beside the read floor (and, with decode_steps, n steps a call)
    max_len = max(contexts + prefills) + 3 * steps * (1 + decode_steps) + 8
    rb = RunnerBench(path, max_b, max_len, page_size, consecutive, attention, decode_path, quantization,
                     fused_decode, kv_cache_dtype, decode_steps)
    try:
        model, vocab = rb.runner.model, rb.runner.config.vocab_size
        g = torch.Generator().manual_seed(0)
        out = {}
        with torch.inference_mode():
            for n in prefills:
                ids = torch.randint(3, vocab, (n,), generator=g)
                floor = MinimalForward(model, 1, n)

                def runner_prefill():
                    rb.start({0: ids.tolist()})
                    rb.run([], [RowStep(0, 0, n, True)])
                t_run, t_floor = _pair(runner_prefill, lambda: floor.forward(ids[None], 0), 3)
                out[f"prefill{n}"] = {"runner_tok_s": n / t_run, "floor_tok_s": n / t_floor,
                                      "ratio": t_floor / t_run}
                print(f"prefill {n:>5}: runner {n / t_run:8.1f} tok/s, floor {n / t_floor:8.1f} tok/s, "
                      f"runner/floor throughput {t_floor / t_run:.3f}", flush=True)
                del floor
            for ctx in contexts:
                for b in batches:
                    rb.start({r: torch.randint(3, vocab, (ctx,), generator=g).tolist() for r in range(b)})
                    floor = MinimalForward(model, b, ctx + steps + 4)
                    state = {"pos": ctx - 1, "next": torch.randint(3, vocab, (b, 1), generator=g)}

                    def runner_step():
                        rb.run([], [RowStep(r, len(rb.runner.rows[r].tokens) - 1, 1, True) for r in range(b)])

                    def floor_step():
                        state["next"] = floor.forward(state["next"], state["pos"])[:, None]
                        state["pos"] += 1
                    t_run, t_floor = _pair(runner_step, floor_step, steps)
                    out[f"decode_b{b}_ctx{ctx}"] = {"runner_ms": 1000 * t_run, "floor_ms": 1000 * t_floor,
                                                    "ratio": t_run / t_floor}
                    print(f"decode b{b:<3} ctx {ctx:>5}: runner {1000 * t_run:8.1f} ms, floor "
                          f"{1000 * t_floor:8.1f} ms, runner/floor time {t_run / t_floor:.3f}", flush=True)
                    del floor
                    if b == 1:  # issue 29's bandwidth floor, measured alternately with the step
                        t_run, t_read, nbytes = _read_floor(rb.runner, ctx, runner_step, steps)
                        out[f"decode_b1_ctx{ctx}"].update(read_floor_ms=1000 * t_read, read_bytes=nbytes,
                                                          runner_vs_read=t_run / t_read)
                        print(f"decode b1   ctx {ctx:>5}: runner {1000 * t_run:8.1f} ms, read floor "
                              f"{1000 * t_read:8.1f} ms ({nbytes / 2**20:.0f} MiB at {nbytes / t_read / 1e9:.1f} "
                              f"GB/s), runner/read floor {t_run / t_read:.3f}", flush=True)
                    if b == 1 and decode_steps > 1:  # --decode-steps: n steps a call, per token
                        t_run, t_read, nbytes = _read_floor(rb.runner, ctx, lambda: rb.decode(decode_steps), steps)
                        t_run /= decode_steps
                        out[f"decode_b1_ctx{ctx}"].update(steps_runner_ms=1000 * t_run,
                                                          steps_read_floor_ms=1000 * t_read,
                                                          steps_runner_vs_read=t_run / t_read)
                        print(f"decode b1   ctx {ctx:>5}, {decode_steps} steps a call: runner {1000 * t_run:8.1f} ms "
                              f"a token, read floor {1000 * t_read:8.1f} ms ({nbytes / t_read / 1e9:.1f} GB/s), "
                              f"runner/read floor {t_run / t_read:.3f}", flush=True)
        return out
    finally:
        rb.close()


def bench_transformers(path: str, prompt: int, batches: list[int], steps: int) -> dict:
    from transformers import AutoModelForCausalLM, DynamicCache
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager")
    model.eval()
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    out = {}

    from read_floor import median_seconds as timed

    with torch.inference_mode():
        ids = torch.randint(3, vocab, (1, prompt), generator=g)
        out[f"prefill{prompt}_tok_s"] = prompt / timed(lambda: model(ids, past_key_values=DynamicCache(), use_cache=True), 3)
        for b in batches:
            ids = torch.randint(3, vocab, (b, prompt), generator=g)
            cache = DynamicCache()
            logits = model(ids, past_key_values=cache, use_cache=True).logits[:, -1]
            state = {"next": logits.argmax(-1, keepdim=True)}

            def decode() -> None:
                lg = model(state["next"], past_key_values=cache, use_cache=True).logits[:, -1]
                state["next"] = lg.argmax(-1, keepdim=True)
            out[f"decode_b{b}_ctx{prompt}_ms"] = 1000 * timed(decode, steps)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="smol-135m", help="tiny_model shape to build when --model is not given")
    p.add_argument("--model", default=None, help="checkpoint folder (default: build --shape into a temp dir)")
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--contexts", default="160,512,2048", help="decode context per row")
    p.add_argument("--prefills", default="512,2048", help="prompt lengths for prefill")
    p.add_argument("--steps", type=int, default=8, help="timed decode steps (pairs) per point")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--consecutive", action="store_true", help="give each row consecutive pages")
    p.add_argument("--attention", default="auto", help="runner attention backend")
    p.add_argument("--decode-path", default="auto", choices=["auto", "gather"],
                   help="gather: the torch backend gathers decode rows' pages every layer (no decode mirror)")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--quantization", default="auto", help="the runner's --quantization (a GGUF: fp16 under auto)")
    p.add_argument("--disable-fused-decode", action="store_true",
                   help="the runner's --disable-fused-decode (a single int4/int8 row's step eager)")
    p.add_argument("--kv-cache-dtype", default="auto", help="the runner's --kv-cache-dtype")
    p.add_argument("--decode-steps", type=int, default=1,
                   help="also time one row's --decode-steps N: N steps a call, per token, beside the read floor")
    p.add_argument("--transformers", action="store_true", help="also time transformers' forward at --contexts[0]")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    batches, contexts, prefills = ints(a.batches), ints(a.contexts), ints(a.prefills)
    t0 = time.time()
    load0 = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        path = a.model
        if path is None:
            from ferroxmp.tiny_model import build_model
            path = build_model(a.shape, os.path.join(tmp, a.shape))
        results = {"runner_vs_floor": bench(path, batches, contexts, prefills, a.steps, a.page_size,
                                            a.consecutive, a.attention, a.decode_path, a.quantization,
                                            not a.disable_fused_decode, a.kv_cache_dtype, a.decode_steps)}
        if a.transformers:
            results["transformers"] = bench_transformers(path, contexts[0], batches, a.steps)
    cpu = os.times()
    meta = {"model": a.model or a.shape, "quantization": a.quantization, "threads": a.threads,
            "torch": torch.__version__, "decode_path": a.decode_path,
            "pages": "consecutive" if a.consecutive else "interleaved", "load_before": load0,
            "load_after": os.getloadavg()[0], "wall_s": time.time() - t0,
            "cores_used": (cpu.user + cpu.system) / max(1e-9, time.time() - t0)}
    print(json.dumps(meta))
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
