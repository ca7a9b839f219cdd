#!/usr/bin/env bash
# pdserve against vLLM's CPU build, both measured by vLLM's own client (`vllm bench serve`)
# on the same ShareGPT V3 prompts, as a user comparing the two would.
#
#   make bench-vllm                       # builds .venv-vllm, then runs this script
#   RATE=0.5,1,2,4 make bench-vllm        # a request-rate sweep (default: inf)
#
# For each dtype (fp32, bf16) and rate: start `vllm serve` on the default model, wait for
# /health, run the client, stop the server; then the same for `pdserve serve --http-port`
# (1 prefill + 1 decode worker, the decode worker's KV pool as large as vLLM's KV cache
# space) with the same client command. A fresh server per run, so
# no prefix-cache state carries over between rates. Each run writes
# bench/results/vllm_peer_<vllm|pdserve>_<dtype>_<rate>.json (vLLM's result format; server
# logs in bench/out/); a table with pdserve/vLLM ratios closes the run.
#
# Environment: NUM_PROMPTS (64), OUTPUT_LEN (128 output tokens a request, ignore_eos),
# RATE (inf, or a comma list), DTYPES (fp32,bf16), GOODPUT (the client's --goodput SLOs,
# "ttft:2000 tpot:250" in ms), MAX_MODEL_LEN (2048), VLLM_CPU_KVCACHE_SPACE (GiB, 4),
# STARTUP_TIMEOUT (s, 900), RESULT_DIR (bench/results), SYSTEMS (vllm,pdserve: which servers
# to run, e.g. SYSTEMS=pdserve to rerun only ours against recorded vLLM results),
# PDSERVE_ARGS (more `pdserve serve` flags, e.g. "--compile"; default none), REPEATS (1:
# with N > 1 each (dtype, rate) runs vLLM, pdserve, vLLM, pdserve, ... N times each, into
# files suffixed _run<k>, and the table shows the median of each figure over the runs),
# CLIENT_ARGS (more `vllm bench serve` flags, e.g. "--save-detailed" for per-request
# input lengths, TTFTs and ITLs in the result files), BACKEND (the client's --backend:
# openai, the completions API, or openai-chat, the chat completions API; result files of
# openai-chat runs are suffixed _chat).
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM=${VLLM:-.venv-vllm/bin/vllm}
PDSERVE=${PDSERVE:-.venv/bin/pdserve}
NUM_PROMPTS=${NUM_PROMPTS:-64}
OUTPUT_LEN=${OUTPUT_LEN:-128}
RATE=${RATE:-inf}
DTYPES=${DTYPES:-fp32,bf16}
GOODPUT=${GOODPUT:-ttft:2000 tpot:250}
MAX_MODEL_LEN=${MAX_MODEL_LEN:-2048}
STARTUP_TIMEOUT=${STARTUP_TIMEOUT:-900}
RESULT_DIR=${RESULT_DIR:-bench/results}
SYSTEMS=${SYSTEMS:-vllm,pdserve}
REPEATS=${REPEATS:-1}
BACKEND=${BACKEND:-openai}
case $BACKEND in
  openai) BACKEND_ARGS=(--backend openai) ;;
  openai-chat) BACKEND_ARGS=(--backend openai-chat --endpoint /v1/chat/completions) ;;
  *) echo "BACKEND: openai or openai-chat, got $BACKEND" >&2; exit 2 ;;
esac
read -ra PDSERVE_EXTRA <<<"${PDSERVE_ARGS:-}"
read -ra CLIENT_EXTRA <<<"${CLIENT_ARGS:-}"
LOG_DIR=bench/out
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# vLLM's CPU worker: OpenMP threads on both cores, none held back for the frontend.
export VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-4}
mkdir -p "$RESULT_DIR" "$LOG_DIR" .cache

MODEL=$(.venv/bin/python -c "from pdserve.engine.loader import resolve_model; print(resolve_model('default'))")

# vLLM's ShareGPT loader json.load()s the whole file; the packaged copy is cut mid-array,
# so write the complete conversations once as a valid JSON array.
DATA=.cache/ShareGPT_V3_complete.json
if [[ ! -s $DATA ]]; then
  echo "writing $DATA (the complete conversations of the packaged ShareGPT V3) ..."
  .venv/bin/python - "$DATA" <<'EOF'
import json, os, sys
from pdserve.sharegpt import conversations
with open(sys.argv[1] + ".tmp", "w", encoding="utf-8") as f:
    json.dump(list(conversations()), f)
os.replace(sys.argv[1] + ".tmp", sys.argv[1])
EOF
fi

SERVER=
stop_server() {   # the server's own process group (setsid below): SIGTERM, then SIGKILL
  [[ -n $SERVER ]] || return 0
  kill -TERM -- "-$SERVER" 2>/dev/null || true
  for _ in $(seq 120); do
    kill -0 "$SERVER" 2>/dev/null || break
    sleep 0.5
  done
  kill -KILL -- "-$SERVER" 2>/dev/null || true
  wait "$SERVER" 2>/dev/null || true
  SERVER=
}
trap stop_server EXIT
trap 'exit 130' INT TERM

free_port() {
  .venv/bin/python -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"
}

# start_server LOG CMD...: CMD in a session of its own (its pid is its process group id)
start_server() {
  local log=$1; shift
  setsid "$@" >"$log" 2>&1 </dev/null &
  SERVER=$!
  local t0=$SECONDS
  until curl -sf -o /dev/null --max-time 5 "http://127.0.0.1:$PORT/health"; do
    if ! kill -0 "$SERVER" 2>/dev/null; then
      tail -n 40 "$log"; echo "server exited before /health answered (log: $log)" >&2
      exit 1
    fi
    if (( SECONDS - t0 > STARTUP_TIMEOUT )); then
      tail -n 40 "$log"; echo "no /health after ${STARTUP_TIMEOUT}s (log: $log)" >&2
      exit 1
    fi
    sleep 2
  done
  echo "ready after $((SECONDS - t0))s"
}

RESULTS=()
IFS=, read -ra RATES <<<"$RATE"
IFS=, read -ra DTYPE_LIST <<<"$DTYPES"
IFS=, read -ra SYSTEM_LIST <<<"$SYSTEMS"
read -ra GOODPUT_ARGS <<<"$GOODPUT"
for dtype in "${DTYPE_LIST[@]}"; do
  case $dtype in
    fp32) torch_dtype=float32 ;;
    bf16) torch_dtype=bfloat16 ;;
    *) echo "DTYPES: fp32 or bf16, got $dtype" >&2; exit 2 ;;
  esac
  for rate in "${RATES[@]}"; do
   for run in $(seq "$REPEATS"); do
    for system in "${SYSTEM_LIST[@]}"; do
      PORT=$(free_port)
      name=vllm_peer_${system}_${dtype}_${rate}
      (( REPEATS == 1 )) || name+=_run$run
      [[ $BACKEND == openai ]] || name+=_chat
      echo "=== $system $dtype, rate $rate: 127.0.0.1:$PORT (log $LOG_DIR/$name.log)"
      if [[ $system == vllm ]]; then
        start_server "$LOG_DIR/$name.log" "$VLLM" serve "$MODEL" --host 127.0.0.1 \
          --port "$PORT" --dtype "$torch_dtype" --max-model-len "$MAX_MODEL_LEN"
      else
        # the decode worker's KV blocks in vLLM's KV cache space (GiB) at this dtype
        kv_blocks=$(.venv/bin/python - "$MODEL" "$torch_dtype" "$VLLM_CPU_KVCACHE_SPACE" <<'EOF'
import sys, torch
from pathlib import Path
from transformers import AutoConfig
from pdserve.engine.config import CacheConfig, ModelConfig
model, dtype, gib = sys.argv[1], getattr(torch, sys.argv[2]), float(sys.argv[3])
cfg = ModelConfig.from_hf(AutoConfig.from_pretrained(model), Path(model))
print(CacheConfig.blocks_for_bytes(cfg, int(gib * 2**30), dtype=dtype))
EOF
)
        extra=(--decode-kv-blocks "$kv_blocks")
        [[ $dtype == fp32 ]] || extra+=(--dtype "$torch_dtype")
        start_server "$LOG_DIR/$name.log" "$PDSERVE" serve --model "$MODEL" --host 127.0.0.1 \
          --port 0 --metrics-port 0 --http-port "$PORT" "${extra[@]}" ${PDSERVE_EXTRA[@]+"${PDSERVE_EXTRA[@]}"}
      fi
      "$VLLM" bench serve "${BACKEND_ARGS[@]}" --base-url "http://127.0.0.1:$PORT" \
        --model "$MODEL" --dataset-name sharegpt --dataset-path "$DATA" \
        --num-prompts "$NUM_PROMPTS" --sharegpt-output-len "$OUTPUT_LEN" --ignore-eos \
        --request-rate "$rate" --seed 0 --goodput "${GOODPUT_ARGS[@]}" \
        --save-result --result-dir "$RESULT_DIR" --result-filename "$name.json" \
        --metadata "system=$system" "dtype=$dtype" ${CLIENT_EXTRA[@]+"${CLIENT_EXTRA[@]}"}
      stop_server
      RESULTS+=("$RESULT_DIR/$name.json")
    done
   done
  done
done

# (the client's triton import prints nanobind leak reports at exit, with no final newline)
printf '\n\nvllm bench serve: %s prompts, %s output tokens, goodput %s\n' \
  "$NUM_PROMPTS" "$OUTPUT_LEN" "$GOODPUT"
.venv/bin/python bench/vllm_peer_table.py "${RESULTS[@]}"
