#!/usr/bin/env bash
# An outside tool's view of pdserve's TTFT and ITL: guidellm (vLLM project) against
# `pdserve serve --http-port` (the OpenAI-compatible front) on this box.
#
#   make bench-guidellm        # builds .venv-guidellm, then runs this script
#
# guidellm lives in its own venv: it pins click~=8.4 and pulls pandas/pyarrow/datasets,
# which would downgrade packages ray and huggingface_hub use in .venv.
# Synthetic prompts of 128 tokens, 64 output tokens (ignore_eos), /v1/completions;
# 1 and then 4 concurrent streams, 40 s each. Writes bench/results/guidellm_serve.json.
set -euo pipefail
cd "$(dirname "$0")/.."
GUIDELLM=${GUIDELLM:-.venv-guidellm/bin/guidellm}
HTTP_PORT=${HTTP_PORT:-8000}
OUT=${OUT:-bench/results/guidellm_serve.json}
LOG=$(mktemp)
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export GUIDELLM__MAX_WORKER_PROCESSES=1   # 2 cores: guidellm's own workers compete

TOKENIZER=$(.venv/bin/python -c "from pdserve.engine.loader import resolve_model; print(resolve_model('default'))")
.venv/bin/pdserve serve --port 0 --metrics-port 0 --http-port "$HTTP_PORT" >"$LOG" 2>&1 &
SERVER=$!
trap 'kill -INT $SERVER 2>/dev/null; wait $SERVER 2>/dev/null; rm -f "$LOG"' EXIT
for _ in $(seq 300); do
  grep -q "pdserve ready" "$LOG" && break
  kill -0 $SERVER 2>/dev/null || { cat "$LOG"; exit 1; }
  sleep 1
done
grep "pdserve ready" "$LOG"

"$GUIDELLM" run \
  --backend "kind=openai_http,target=http://127.0.0.1:$HTTP_PORT/v1,request_format=/v1/completions,timeout=120" \
  --tokenizer "kind=huggingface_auto,model=$TOKENIZER" \
  --data kind=synthetic_text,prompt_tokens=128,output_tokens=64 \
  --profile kind=concurrent,streams=1 --override profile.streams 1,4 \
  --constraint kind=max_duration,seconds=40 --constraint kind=max_requests,count=200 \
  --output "kind=json,path=$OUT" \
  --disable-console-interactive
