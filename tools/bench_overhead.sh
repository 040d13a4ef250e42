#!/usr/bin/env bash
# Issue 29's per-token overhead at batch 1: the runner's step (tools/bench_worker.py)
# beside a served single stream's TPOT on the same model, alternating, ROUNDS pairs.
#   MODEL=/tmp/smollm2-f32 FLAGS="--dtype float32" tools/bench_overhead.sh
# The server's "worker busy / wall" line says how much of the stream's wall time the
# worker spent in steps: the rest is time between tokens spent elsewhere.
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:-/tmp/smollm2-f32}
FLAGS=${FLAGS:---dtype float32}
PORT=${PORT:-31009}
S=""
trap '[ -z "$S" ] || kill "$S" 2>/dev/null || true' EXIT
for i in $(seq "${ROUNDS:-2}"); do
  .venv/bin/python tools/bench_worker.py --model "$MODEL" --batches 1 --contexts 128 --prefills 64 --steps 32 2>&1 | grep "decode b1"
  .venv/bin/ferroxmp serve --model "$MODEL" $FLAGS --port "$PORT" --log-level warning > /dev/null 2>&1 &
  S=$!
  for t in $(seq 120); do curl -sf "localhost:$PORT/health" >/dev/null && break; sleep 1; done
  .venv/bin/python tools/bench_serving.py --base-url "http://127.0.0.1:$PORT" --endpoint chat --temperature 0 --workload random --num-prompts 4 --input-len 64 --output-len 128 --max-concurrency 1 --seed 62 2>&1 | grep -E "TPOT median|ITL median|worker busy"
  kill "$S"; wait "$S" || true; S=""
done
