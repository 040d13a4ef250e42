#!/usr/bin/env bash
# Two flag sets of one server, alternated on a served load (single stream by default):
# tok/s, TTFT, TPOT and each process's CPU seconds (bench_serving.py's own columns).
#   MODEL=/tmp/smollm2-f32 A_FLAGS="--dtype float32 --decode-steps 1" B_FLAGS="--dtype float32" tools/bench_stream_ab.sh
# CONCURRENCY (1), PROMPTS (6), OUTPUT_LEN (128), INPUT_LEN (64), ROUNDS (2) shape the load.
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:-/tmp/smollm2-f32}
PORT=${PORT:-31011}
S=""
trap '[ -z "$S" ] || kill "$S" 2>/dev/null || true' EXIT
for round in $(seq "${ROUNDS:-2}"); do
  for side in A B; do
    flags=$([ "$side" = A ] && echo "${A_FLAGS:-}" || echo "${B_FLAGS:-}")
    # shellcheck disable=SC2086
    .venv/bin/ferroxmp serve --model "$MODEL" $flags --port "$PORT" --log-level warning > /dev/null 2>&1 &
    S=$!
    for _ in $(seq 180); do curl -sf "localhost:$PORT/health" >/dev/null && break; sleep 1; done
    echo "== round $round, $side: [$flags]"
    .venv/bin/python tools/bench_serving.py --base-url "http://127.0.0.1:$PORT" --endpoint chat --temperature 0 \
      --workload random --num-prompts "${PROMPTS:-6}" --input-len "${INPUT_LEN:-64}" --output-len "${OUTPUT_LEN:-128}" \
      --max-concurrency "${CONCURRENCY:-1}" --seed 62 2>&1 \
      | grep -E "output tokens/s|TTFT median|TPOT median|TPOT mean|worker busy|CPU s, (worker|scheduler|frontend)"
    kill "$S"; wait "$S" || true; S=""
  done
done
