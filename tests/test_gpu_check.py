"""tools/gpu_check.sh --dry-run: the GPU machine's one script runs end to end on a CPU.

A GPU is lent rarely, and a script that first fails there wastes it. The dry run takes
the same code paths with tiny sizes (Triton under TRITON_INTERPRET=1): kernels of every
backend against the float64 reference per dtype, the greedy oracle against
transformers (one row, and three rows decoding together), decode and prefill timings on
both checkpoints next to transformers' forward, the copy bandwidth. Its figures mean
nothing; what is checked is that every section ran and every check passed.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton", reason="the dry run checks the Triton kernels under the interpreter")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_gpu_check_script_runs_every_section_on_a_cpu(tmp_path):
    env = {**os.environ, "PY": sys.executable}
    proc = subprocess.run(["bash", os.path.join(ROOT, "tools", "gpu_check.sh"), "--dry-run", "--out", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.load(open(tmp_path / "gpu_check.json"))
    kernels = {(k["backend"], k["dtype"]) for k in report["kernels"]}
    assert kernels == {(b, d) for b in ("torch", "triton") for d in ("float32", "float16", "bfloat16")}
    assert all(k["ok"] and k["rel_err"] < k["tol"] for k in report["kernels"])
    assert report["oracle"] and all(o["ok"] for o in report["oracle"])
    assert {o["prompt"] for o in report["oracle"]} == {7, 300, "3 rows batched"}
    who = {(s["model"], s["who"]) for s in report["speed"]}
    for model in ("smol-135m", "1B-shape"):
        assert {(model, "transformers"), (model, "ferroxmp/torch"), (model, "ferroxmp/triton")} <= who
        assert {(model, "ferroxmp/triton int4"), (model, "ferroxmp/triton int8")} <= who
    assert report["copy_bandwidth_gbs"] > 0
    quant = {(q["format"], q["dtype"], q["rows"]) for q in report["quant"] if q["ok"]}
    assert quant == {(f, d, m) for f in ("int4", "int8") for d in ("float16", "bfloat16") for m in (1, 16, 100)}
    assert "| model | who | what |" in open(tmp_path / "gpu_check.md").read()
    # section 4: the real server started on the device (the CPU here), healthy, answering
    reply = json.load(open(tmp_path / "server_reply.json"))
    assert reply["usage"]["completion_tokens"] == 8 and reply["choices"][0]["message"]["role"] == "assistant"
    assert "serving" in open(tmp_path / "server.log").read()
