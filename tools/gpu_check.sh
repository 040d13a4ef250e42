#!/usr/bin/env bash
# tools/gpu_check.sh: everything to check on a machine with an NVIDIA GPU, in one run.
#
#   tools/gpu_check.sh [--dry-run] [--out DIR]       (default DIR: gpu-check-results)
#
# 1. kernels: every CUDA attention backend (our Triton kernels; FlashInfer when
#    `flashinfer-python` is installed) against the float64 reference on random inputs:
#    mixed decode rows + chunks, GQA, sliding window, pages out of order, adopted prefixes;
#    relative error per dtype (float32 / float16 / bfloat16).
# 2. oracle: 32 greedy tokens of the runner on the GPU equal transformers' generate on
#    the same GPU, for every tiny checkpoint (llama, qwen2, qwen3, mistral), per backend;
#    one row at a time and three rows decoding together (a padded CUDA graph).
# 3. speed: runner decode step at batch 1/16/64/256 (context 512) and a 2,048-token
#    prefill (CUDA graphs on, and for Triton also off), on the smol-135m shape and a 1B-shaped (Llama-3.2-1B dims) random checkpoint,
#    bf16, next to transformers' own forward (sdpa, DynamicCache) in the same run; the
#    achieved memory bandwidth of each decode step (weights + KV read) against the device's
#    measured copy bandwidth; the same runner with --quantization int4 / int8.
# 4. server: `ferroxmp serve` on the device (smol-135m shape): healthy, a chat completion
#    answered, and on CUDA the KV pool sized from --mem-fraction *after* loading (the
#    worker's log line "measured after loading"); the log is kept in DIR/server.log.
# 5. quant: int4 / int8 weights through quant/triton_groups.py on the device against the
#    float64 reference (float16 / bfloat16 activations; 1, 16 and 100 rows).
# Writes DIR/gpu_check.json and DIR/gpu_check.md (the table for docs/BENCHMARKS.md).
# Exit status: non-zero if a kernel, oracle or server check failed.
#
# --dry-run runs the same code on the CPU with tiny sizes (Triton under TRITON_INTERPRET=1),
# to check the script itself on a machine without a GPU; its figures mean nothing.
# GPU_CHECK_BACKENDS=triton,flashinfer (comma list) picks the attention backends to check.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
DRY=0
OUT=gpu-check-results
while [[ $# -gt 0 ]]; do
  case "$1" in
    --dry-run) DRY=1; shift ;;
    --out) OUT="$2"; shift 2 ;;
    *) echo "usage: $0 [--dry-run] [--out DIR]" >&2; exit 2 ;;
  esac
done
mkdir -p "$OUT"
if [[ $DRY == 1 ]]; then export TRITON_INTERPRET=1; else export TRITON_INTERPRET=0; fi  # tests/conftest.py defaults it to 1

# ---- 4 (run first: it needs the device to itself). the server on the device ------------
server_check() {
    local device=cuda port=31099 model="$OUT/smol-server" pid ok=0
    [[ $DRY == 1 ]] && device=cpu
    [ -d "$model" ] || "$PY" tools/make_tiny_model.py --shape smol-135m --out "$model" >/dev/null
    "$PY" -m ferroxmp.cli serve --model "$model" --device "$device" --port "$port" --log-level info \
        >"$OUT/server.log" 2>&1 &
    pid=$!
    for _ in $(seq 300); do
        curl -sf "http://127.0.0.1:$port/health" >/dev/null && { ok=1; break; }
        kill -0 "$pid" 2>/dev/null || break
        sleep 1
    done
    if [[ $ok == 1 ]]; then
        curl -sf "http://127.0.0.1:$port/v1/chat/completions" -H 'Content-Type: application/json' \
            -d '{"messages":[{"role":"user","content":"hi"}],"max_tokens":8,"ignore_eos":true}' \
            >"$OUT/server_reply.json" || ok=0
        "$PY" -c 'import json, sys; assert json.load(open(sys.argv[1]))["usage"]["completion_tokens"] == 8' \
            "$OUT/server_reply.json" 2>/dev/null || ok=0
    fi
    if [[ $device == cuda ]] && ! grep -q "measured after loading" "$OUT/server.log"; then ok=0; fi
    kill "$pid" 2>/dev/null; wait "$pid" 2>/dev/null || true
    grep -E "KV pool|after loading" "$OUT/server.log" | sed 's/^/  /' || true
    [[ $ok == 1 ]]
}
SERVER_OK=1
if server_check; then echo "server on the device: ok"; else SERVER_OK=0; echo "server on the device: FAILED (see $OUT/server.log)"; fi
"$PY" - "$DRY" "$OUT" <<'PYEOF'
import importlib.util, json, os, statistics, sys, tempfile, time
import numpy as np
import torch

DRY, OUT = sys.argv[1] == "1", sys.argv[2]
sys.path.insert(0, os.getcwd())
from ferroxmp.gpu_worker.attention import make_backend, reference_attention  # noqa: E402
from ferroxmp.gpu_worker.kv.pool import KVPool  # noqa: E402
from ferroxmp.protocol import ForwardBatch, NewRow, RowStep, SamplingParams, pack_ids, unpack_ids  # noqa: E402
from ferroxmp.page_pool import PagePool  # noqa: E402

if not DRY and not torch.cuda.is_available():
    sys.exit("no CUDA device: run with --dry-run to check the script on a CPU")
DEV = torch.device("cpu" if DRY else "cuda")
torch.backends.cuda.matmul.allow_tf32 = False  # the oracle compares fp32 tokens exactly
torch.backends.cudnn.allow_tf32 = False
BACKENDS = ["triton"] + (["flashinfer"] if importlib.util.find_spec("flashinfer") and not DRY else [])
if DRY:
    BACKENDS = ["torch", "triton"]
if os.environ.get("GPU_CHECK_BACKENDS"):  # e.g. GPU_CHECK_BACKENDS=triton to leave flashinfer out
    BACKENDS = os.environ["GPU_CHECK_BACKENDS"].split(",")
report = {"device": torch.cuda.get_device_name() if not DRY else "cpu (dry run)",
          "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "torch": torch.__version__,
          "backends": BACKENDS, "kernels": [], "oracle": [], "speed": []}
failed = []


def sync():
    if DEV.type == "cuda":
        torch.cuda.synchronize()


# ---- 1. kernels against the float64 reference ------------------------------------------
def kernel_case(name, dtype, H, KVH, D, ps, window, seed):
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    n_pages, per_row, rows = 400, 48, 8
    layout = "hnd" if name == "torch" else "nhd"
    kv = KVPool(n_pages, ps, 1, KVH, D, dtype, DEV, layout)
    kv.slots_view(0, "k").copy_(torch.randn(n_pages * ps, KVH, D, generator=g).to(DEV))
    kv.slots_view(0, "v").copy_(torch.randn(n_pages * ps, KVH, D, generator=g).to(DEV))
    table = rng.permutation(n_pages)[:rows * per_row].reshape(rows, per_row).astype(np.int32)
    table[6, :5] = table[0, :5]  # row 6 adopted row 0's first 5 pages
    cap = per_row * ps
    steps = [(r, int(rng.integers(0, cap - 1)), 1) for r in range(4)]  # decode rows, any length
    steps += [(4, 0, int(rng.integers(2, 90))), (5, int(rng.integers(1, 300)), int(rng.integers(2, 70))),
              (6, 5 * ps, int(rng.integers(2, 60))), (7, int(rng.integers(300, 600)), 1)]
    T = sum(n for _, _, n in steps)
    q = torch.randn(T, H, D, generator=g).to(dtype)
    k = torch.randn(T, KVH, D, generator=g).to(dtype)
    v = torch.randn(T, KVH, D, generator=g).to(dtype)
    be = make_backend(kv, window, DEV, name, num_heads=H)
    plan = be.plan(steps, table)
    plan.check_integrity()
    starts = np.cumsum([0] + [n for _, _, n in steps])
    perm = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in plan.order])
    out = be.forward(0, q[perm].to(DEV), k[perm].to(DEV), v[perm].to(DEV)).cpu()
    back = torch.empty_like(out)
    back[perm] = out
    ks, vs = kv.slots_view(0, "k").cpu(), kv.slots_view(0, "v").cpu()
    ref = reference_attention(q, ks, vs, steps, table, ps, window)
    return ((back.double() - ref).abs().max() / ref.abs().max()).item()


TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}
shapes = [("smol-135m heads 9/3 d64", 9, 3, 64), ("1B heads 32/8 d64", 32, 8, 64)]
if DRY:
    shapes = [("dry heads 6/2 d16", 6, 2, 16)]
for name in BACKENDS:
    dtypes = [torch.float16, torch.bfloat16] if name == "flashinfer" else [torch.float32, torch.float16, torch.bfloat16]
    for label, H, KVH, D in shapes:
        for dtype in dtypes:
            # dry: the window's path once (float32); Triton is interpreted on the CPU
            for window in ((None, 200) if not DRY or dtype == torch.float32 else (None,)):
                err = kernel_case(name, dtype, H, KVH, D, 16, window, seed=len(report["kernels"]))
                ok = err < TOL[dtype]
                row = {"backend": name, "shape": label, "dtype": str(dtype).removeprefix("torch."),
                       "window": window, "rel_err": err, "tol": TOL[dtype], "ok": ok}
                report["kernels"].append(row)
                print(f"kernel {name:<10} {label:<24} {row['dtype']:<9} window={window}: rel err {err:.2e} "
                      f"{'ok' if ok else 'FAIL'}", flush=True)
                if not ok:
                    failed.append(f"kernel {row}")


# ---- 2. greedy oracle against transformers on the tiny checkpoints ---------------------
class Runner:
    """A ModelRunner on a private pool; row r owns pages interleaved with the others'."""

    def __init__(self, path, rows, max_len, attention, page_size=16, cuda_graph=True, quantization="none"):
        from ferroxmp.gpu_worker.runner import ModelRunner
        per_row = -(-max_len // page_size)
        self.pool = PagePool.create(num_pages=per_row * rows, max_rows=rows, max_pages_per_row=per_row)
        self.r = ModelRunner(path, self.pool, page_size, device=DEV.type, attention=attention,
                             cuda_graph=cuda_graph, quantization=quantization)
        for row in range(rows):
            self.pool.set_row(row, [j * rows + row for j in range(per_row)], 0)
        self.bid = 0

    def run(self, new_rows, steps):
        self.bid += 1
        res = self.r.execute(ForwardBatch(self.bid, new_rows, steps))
        if res.error is not None or res.row_errors:
            raise RuntimeError(res.error or res.row_errors)
        return res

    def start(self, prompts):
        self.run([NewRow(r, pack_ids(p), SamplingParams(temperature=0.0), 0) for r, p in prompts.items()], [])

    def close(self):
        self.pool.close()
        self.pool.unlink()


from ferroxmp.tiny_model import TINY_SHAPES, build_model  # noqa: E402
tmp = tempfile.mkdtemp(prefix="gpu-check-")
n_new = 4 if DRY else 32  # dry: the oracle's path, not its length (Triton is interpreted)
for shape in (TINY_SHAPES[:1] if DRY else TINY_SHAPES):
    path = build_model(shape, os.path.join(tmp, shape))
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(path).to(DEV).eval()
    hf.generation_config.eos_token_id = None
    vocab = hf.config.vocab_size
    for backend in BACKENDS:
        for n in (7, 300):
            prompt = torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(n)).tolist()
            rb = Runner(path, 1, n + n_new + 16, backend)
            try:
                rb.start({0: prompt})
                toks = [int(unpack_ids(rb.run([], [RowStep(0, 0, n, True)]).tokens)[0])]
                while len(toks) < n_new:
                    toks.append(int(unpack_ids(rb.run([], [RowStep(0, n + len(toks) - 1, 1, True)]).tokens)[0]))
            finally:
                rb.close()
            with torch.inference_mode():
                ref = hf.generate(torch.tensor([prompt], device=DEV), max_new_tokens=n_new, do_sample=False,
                                  pad_token_id=0)[0, n:].tolist()
            ok = toks == ref
            report["oracle"].append({"shape": shape, "backend": backend, "prompt": n, "ok": ok,
                                     "first_diff": next((i for i, (a, b) in enumerate(zip(toks, ref)) if a != b), None)})
            print(f"oracle {shape:<8} {backend:<10} prompt {n:>4}: {'same tokens' if ok else 'DIFFERENT'}", flush=True)
            if not ok:
                failed.append(f"oracle {shape} {backend} prompt {n}")
        # Three rows decoding together (a CUDA graph of 4 rows: one padding row) must each
        # give transformers' tokens for that row alone.
        lens = (7, 33, 300)
        prompts = {r: torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(50 + n)).tolist()
                   for r, n in enumerate(lens)}
        rb = Runner(path, len(lens), max(lens) + n_new + 16, backend)
        try:
            rb.start(prompts)
            res = rb.run([], [RowStep(r, 0, n, True) for r, n in enumerate(lens)])
            toks = {r: [t] for r, t in zip(unpack_ids(res.rows).tolist(), unpack_ids(res.tokens).tolist())}
            while len(toks[0]) < n_new:
                res = rb.run([], [RowStep(r, n + len(toks[r]) - 1, 1, True) for r, n in enumerate(lens)])
                for r, t in zip(unpack_ids(res.rows).tolist(), unpack_ids(res.tokens).tolist()):
                    toks[r].append(t)
        finally:
            rb.close()
        with torch.inference_mode():
            same = all(toks[r] == hf.generate(torch.tensor([p], device=DEV), max_new_tokens=n_new, do_sample=False,
                                              pad_token_id=0)[0, len(p):].tolist() for r, p in prompts.items())
        report["oracle"].append({"shape": shape, "backend": backend, "prompt": "3 rows batched", "ok": same})
        print(f"oracle {shape:<8} {backend:<10} 3 rows batched: {'same tokens' if same else 'DIFFERENT'}", flush=True)
        if not same:
            failed.append(f"oracle {shape} {backend} 3 rows batched")
    del hf


# ---- 3. speed: runner vs transformers, achieved bandwidth ------------------------------
def copy_bandwidth():
    n = (64 << 20) if DRY else (1 << 30)
    a = torch.empty(n, dtype=torch.uint8, device=DEV)
    b = torch.empty_like(a)
    b.copy_(a)
    sync()
    t = time.perf_counter()
    for _ in range(10):
        b.copy_(a)
    sync()
    return 2 * n * 10 / (time.perf_counter() - t)  # read + write


def make_1b(out, like):
    """A Llama-3.2-1B-shaped random bf16 checkpoint (tokenizer files from `like`)."""
    import shutil
    from safetensors.torch import save_file
    os.makedirs(out, exist_ok=True)
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(os.path.join(like, f), out)
    cfg = json.load(open(os.path.join(like, "config.json")))
    dims = dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                intermediate_size=8192, vocab_size=128256, head_dim=64, tie_word_embeddings=True,
                rope_theta=500000.0, max_position_embeddings=8192, torch_dtype="bfloat16")
    if DRY:
        dims.update(hidden_size=128, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                    intermediate_size=256, vocab_size=cfg["vocab_size"], head_dim=16)
    cfg.update(dims)
    cfg.pop("rope_scaling", None)
    json.dump(cfg, open(os.path.join(out, "config.json"), "w"))
    g = torch.Generator(device=DEV).manual_seed(0)
    h, f, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]

    def rand(*shape):
        return (torch.randn(*shape, generator=g, device=DEV) * 0.02).to(torch.bfloat16).cpu()
    w = {"model.embed_tokens.weight": rand(cfg["vocab_size"], h), "model.norm.weight": torch.ones(h, dtype=torch.bfloat16)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w.update({p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
                  p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
                  p + "self_attn.q_proj.weight": rand(nh * hd, h), p + "self_attn.k_proj.weight": rand(nkv * hd, h),
                  p + "self_attn.v_proj.weight": rand(nkv * hd, h), p + "self_attn.o_proj.weight": rand(h, nh * hd),
                  p + "mlp.gate_proj.weight": rand(f, h), p + "mlp.up_proj.weight": rand(f, h),
                  p + "mlp.down_proj.weight": rand(h, f)})
    save_file(w, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    return out


def median_time(fn, n):
    fn()
    sync()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        sync()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


peak = copy_bandwidth()
report["copy_bandwidth_gbs"] = peak / 1e9
print(f"device copy bandwidth: {peak / 1e9:.1f} GB/s", flush=True)
batches, ctx, prefill, n_steps = ([1, 2], 64, 32, 2) if DRY else ([1, 16, 64, 256], 512, 2048, 20)
smol = build_model("llama" if DRY else "smol-135m", os.path.join(tmp, "smol-135m"))  # dry: 2-layer stand-in
models = {"smol-135m": smol, "1B-shape": make_1b(os.path.join(tmp, "1b"), smol)}
for label, path in models.items():
    from ferroxmp.gpu_worker.loader import load_config, weight_bytes
    cfg = load_config(path)
    kv_tok = cfg.kv_bytes_per_token(cfg.dtype)
    # Every backend as served (CUDA graphs on where the backend has them), the Triton
    # backend once more without graphs (what the graphs buy), and the Triton backend with
    # int4 and int8 weights (section 5's kernels; dry: the CPU kernels).
    variants = [(b, True, "none") for b in BACKENDS] + [("triton", True, q) for q in ("int4", "int8")]
    variants += [("triton", False, "none")] if "triton" in BACKENDS and not DRY else []
    for backend, graphs, quant in variants:
        wbytes = weight_bytes(path, cfg.dtype, quant)
        rb = Runner(path, max(batches), max(ctx + n_steps + 8, prefill + 8), backend, cuda_graph=graphs,
                    quantization=quant)
        who = f"ferroxmp/{backend}" + ("" if graphs or DRY else " no-graph") + ("" if quant == "none" else " " + quant)
        if graphs and not DRY:
            who += " graph" if rb.r.graphs is not None else ""
        try:
            g = torch.Generator().manual_seed(0)
            ids = torch.randint(3, cfg.vocab_size, (prefill,), generator=g).tolist()

            def run_prefill():
                rb.start({0: ids})
                rb.run([], [RowStep(0, 0, prefill, True)])
            t = median_time(run_prefill, 3)
            report["speed"].append({"model": label, "who": who, "what": f"prefill {prefill}",
                                    "tok_s": prefill / t})
            print(f"speed {label} {who} prefill {prefill}: {prefill / t:,.0f} tok/s", flush=True)
            for b in batches:
                rb.start({r: torch.randint(3, cfg.vocab_size, (ctx,), generator=g).tolist() for r in range(b)})

                def step():
                    rb.run([], [RowStep(r, len(rb.r.rows[r].tokens) - 1, 1, True) for r in range(b)])
                t = median_time(step, n_steps)
                bw = (wbytes + b * ctx * kv_tok) / t
                report["speed"].append({"model": label, "who": who, "what": f"decode b{b} ctx{ctx}",
                                        "ms": 1000 * t, "gbs": bw / 1e9, "of_copy_bw": bw / peak})
                print(f"speed {label} {who} decode b{b}: {1000 * t:.2f} ms, {bw / 1e9:.0f} GB/s "
                      f"({100 * bw / peak:.0f}% of copy)", flush=True)
        finally:
            rb.close()
    from transformers import AutoModelForCausalLM, DynamicCache
    hf = AutoModelForCausalLM.from_pretrained(path, torch_dtype=cfg.dtype, attn_implementation="sdpa").to(DEV).eval()
    with torch.inference_mode():
        x = torch.randint(3, cfg.vocab_size, (1, prefill), device=DEV)
        t = median_time(lambda: hf(x, past_key_values=DynamicCache(), use_cache=True), 3)
        report["speed"].append({"model": label, "who": "transformers", "what": f"prefill {prefill}", "tok_s": prefill / t})
        print(f"speed {label} transformers prefill {prefill}: {prefill / t:,.0f} tok/s", flush=True)
        for b in batches:
            cache = DynamicCache()
            lg = hf(torch.randint(3, cfg.vocab_size, (b, ctx), device=DEV), past_key_values=cache, use_cache=True).logits
            state = {"next": lg[:, -1].argmax(-1, keepdim=True)}

            def hf_step():
                state["next"] = hf(state["next"], past_key_values=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
            t = median_time(hf_step, n_steps)
            bw = (weight_bytes(path, cfg.dtype) + b * ctx * kv_tok) / t
            report["speed"].append({"model": label, "who": "transformers", "what": f"decode b{b} ctx{ctx}",
                                    "ms": 1000 * t, "gbs": bw / 1e9, "of_copy_bw": bw / peak})
            print(f"speed {label} transformers decode b{b}: {1000 * t:.2f} ms", flush=True)
    del hf

# ---- 5. int4 / int8 weights: quant/triton_groups.py against the float64 reference -----
from ferroxmp.gpu_worker.quant.groups import Groups  # noqa: E402
from ferroxmp.gpu_worker.quant.triton_groups import groups_linear  # noqa: E402
report["quant"] = []
QTOL = {torch.float16: 3e-3, torch.bfloat16: 2e-2}  # of the output's largest value: the weight rounded to dtype
for fmt in ("int4", "int8"):
    for dtype in QTOL:
        for m in (1, 16, 100):  # 1-64 rows: the tiled kernel; 100: widened whole, then cuBLAS
            g = torch.Generator().manual_seed(m)
            rows, cols = (72, 96) if DRY else (4096, 2048)
            w = Groups.quantize(torch.randn(rows, cols, generator=g), fmt)
            x = torch.randn(m, cols, generator=g).to(dtype)
            ref = x.double() @ w.dequantize(torch.float64).T
            y = groups_linear(x.to(DEV), w.to(DEV)).cpu().double()
            err = ((y - ref).abs().max() / ref.abs().max()).item()
            ok = err < QTOL[dtype]
            report["quant"].append({"format": fmt, "dtype": str(dtype).removeprefix("torch."), "rows": m,
                                    "rel_err": err, "tol": QTOL[dtype], "ok": ok})
            print(f"quant {fmt} {dtype} {m} rows: rel err {err:.2e} {'ok' if ok else 'FAIL'}", flush=True)
            if not ok:
                failed.append(f"quant {fmt} {dtype} {m} rows")

json.dump(report, open(os.path.join(OUT, "gpu_check.json"), "w"), indent=2)
with open(os.path.join(OUT, "gpu_check.md"), "w") as f:
    f.write(f"GPU check, {report['date']}, {report['device']}, torch {report['torch']}; "
            f"device copy bandwidth {report['copy_bandwidth_gbs']:.0f} GB/s\n\n")
    f.write("| model | who | what | result | bandwidth (of copy) |\n|---|---|---|---:|---:|\n")
    for s in report["speed"]:
        res = f"{s['tok_s']:,.0f} tok/s" if "tok_s" in s else f"{s['ms']:.2f} ms"
        bw = f"{s['gbs']:.0f} GB/s ({100 * s['of_copy_bw']:.0f}%)" if "gbs" in s else ""
        f.write(f"| {s['model']} | {s['who']} | {s['what']} | {res} | {bw} |\n")
    worst = {}
    for k in report["kernels"]:
        key = (k["backend"], k["dtype"])
        worst[key] = max(worst.get(key, 0.0), k["rel_err"])
    f.write("\n| kernel | dtype | worst relative error |\n|---|---|---:|\n")
    for (b, d), e in sorted(worst.items()):
        f.write(f"| {b} | {d} | {e:.2e} |\n")
    f.write(f"\noracle: {sum(o['ok'] for o in report['oracle'])} of {len(report['oracle'])} greedy runs equal transformers\n")
print(open(os.path.join(OUT, "gpu_check.md")).read())
if failed:
    print("FAILED:", *failed, sep="\n  ")
    sys.exit(1)
PYEOF
[[ $SERVER_OK == 1 ]] || exit 1
