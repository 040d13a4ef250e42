#!/usr/bin/env bash
# Two flag sets of one server, alternated: a served load (single stream by default) and
# the CPU seconds each process spent on it. Issue 29's per-token overhead, flag by flag.
#   MODEL=/tmp/smollm2-f32 A_FLAGS="--dtype float32 --decode-steps 1" B_FLAGS="--dtype float32" tools/bench_stream_ab.sh
# CONCURRENCY (1), PROMPTS (6), OUTPUT_LEN (128), INPUT_LEN (64), ROUNDS (2) shape the load.
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:-/tmp/smollm2-f32}
PORT=${PORT:-31011}
S=""
trap '[ -z "$S" ] || kill "$S" 2>/dev/null || true' EXIT
cpu() { awk '{printf "%.2f", ($14 + $15) / 100}' "/proc/$1/stat"; }
since() { awk -v a="$(cpu "$1")" -v b="$2" 'BEGIN {printf "%.2f", a - b}'; }  # CPU s of pid $1 since $2
for round in $(seq "${ROUNDS:-2}"); do
  for side in A B; do
    flags=$([ "$side" = A ] && echo "${A_FLAGS:-}" || echo "${B_FLAGS:-}")
    # shellcheck disable=SC2086
    .venv/bin/ferroxmp serve --model "$MODEL" $flags --port "$PORT" --log-level warning > /dev/null 2>&1 &
    S=$!
    for _ in $(seq 180); do curl -sf "localhost:$PORT/health" >/dev/null && break; sleep 1; done
    run="ferroxmp-$S-"
    W=$(pgrep -f "gpu_worker.worker.*$run"); SC=$(pgrep -f "scheduler.scheduler.*$run"); F=$(pgrep -f "frontend.server.*$run")
    w0=$(cpu "$W"); s0=$(cpu "$SC"); f0=$(cpu "$F")
    echo "== round $round, $side: [$flags]"
    .venv/bin/python tools/bench_serving.py --base-url "http://127.0.0.1:$PORT" --endpoint chat --temperature 0 \
      --workload random --num-prompts "${PROMPTS:-6}" --input-len "${INPUT_LEN:-64}" --output-len "${OUTPUT_LEN:-128}" \
      --max-concurrency "${CONCURRENCY:-1}" --seed 62 2>&1 | grep -E "Output token throughput|TPOT median|TPOT mean|TTFT median|worker busy"
    echo "CPU s: worker $(since "$W" "$w0"), scheduler $(since "$SC" "$s0"), frontend $(since "$F" "$f0")"
    kill "$S"; wait "$S" || true; S=""
  done
done
