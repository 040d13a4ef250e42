#!/usr/bin/env bash
# Starts the comparison peer for tools/bench_serving.py: transformers' own OpenAI
# server with continuous batching, pinned to one local checkpoint folder, offline.
#
#   tools/start_peer.sh MODEL_DIR PORT [extra `transformers serve` flags]
#
# Runs in the foreground (exec: its pid is the server's; stop it with kill PID).
# The model name clients must send is the absolute MODEL_DIR (GET /v1/models lists
# it). It rejects `ignore_eos` with 422: bench with `--dialect transformers`.
# Threads: PEER_THREADS (default 2) caps torch's intra-op threads.
set -euo pipefail
MODEL_DIR=${1:?usage: tools/start_peer.sh MODEL_DIR PORT [flags]}
PORT=${2:?usage: tools/start_peer.sh MODEL_DIR PORT [flags]}
shift 2
ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV=${VENV:-$ROOT/.venv}
MODEL_DIR=$(cd "$MODEL_DIR" && pwd)  # the pinned name is compared verbatim with each request's

if ! "$VENV/bin/python" -c "import fastapi, uvicorn" 2>/dev/null; then
    echo "transformers serve needs its extras: $VENV/bin/pip install 'transformers[serving]'" >&2
    exit 2
fi

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
export OMP_NUM_THREADS=${PEER_THREADS:-2}
exec "$VENV/bin/transformers" serve "$MODEL_DIR" --continuous-batching \
    --host 127.0.0.1 --port "$PORT" --log-level warning "$@"
