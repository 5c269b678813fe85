#!/usr/bin/env bash
# Issue 14, GPU part, in one call: `spanllm serve` (random weights, TP=1) driven by a `spanllm bench serve`
# request-rate sweep on saved ShareGPT requests, then the server overhead (the same requests offline through
# `bench throughput` vs the HTTP run at rate inf, same engine flags). Optional peer: PEER=hf (see below).
#
# GPU machine (carry .whl; the wheels go to /tmp/site):
#   SPANLLM_GPU_OUT=$OUT bash scripts/gpu_serve_sweep.sh
# CPU dry run (tiny preset, byte tokenizer):
#   spanllm bench throughput --model tiny --dataset-name random --input-len 16 --output-len 8 --num-prompts 50 \
#       --save-samples /tmp/s.json --dry-run
#   MODEL=tiny DTYPE=float32 SAMPLES=/tmp/s.json RATES=inf,50 NUM_PROMPTS=50 bash scripts/gpu_serve_sweep.sh
#
# Knobs (env): MODEL (llama3.1-8b), DTYPE (auto), SAMPLES (results/h200/inputs/sharegpt_llama3_seed0_n1000.json),
# RATES (16,24,32,48,inf), NUM_PROMPTS (1000), ENGINE_FLAGS (--min-admit 32: the same for serve and the offline
# run), LOW_RATES / LOW_NUM_PROMPTS (an extra sweep at low rates with fewer prompts; off by default),
# OVERHEAD (1: run the offline bench throughput), INSTALL_WHEELS (auto: only when fastapi/uvicorn/quicktok do not
# import), SPANLLM_GPU_OUT (results/gpu_run), timeouts SERVER_START_TIMEOUT (300), SWEEP_TIMEOUT (360),
# LOW_TIMEOUT (200), THROUGHPUT_TIMEOUT (180), STOP_TIMEOUT (60), SERVE_FLAGS (extra flags for spanllm serve only,
# e.g. --frontend-process: the HTTP front end in its own process).
#
# Files written (at most 8, the device tool's limit on what comes back): run.log, serve.log,
# serve_sweep_<model>.json/.png (written after each rate, so a sweep cut short keeps its finished rates),
# [serve_sweep_low_<model>.json/.png], throughput_<model>.json, overhead_<model>.json.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1

MODEL=${MODEL:-llama3.1-8b}
DTYPE=${DTYPE:-auto}
SAMPLES=${SAMPLES:-results/h200/inputs/sharegpt_llama3_seed0_n1000.json}
RATES=${RATES:-16,24,32,48,inf}
NUM_PROMPTS=${NUM_PROMPTS:-1000}
ENGINE_FLAGS=${ENGINE_FLAGS:---min-admit 32}
LOW_RATES=${LOW_RATES:-}
LOW_NUM_PROMPTS=${LOW_NUM_PROMPTS:-200}
OVERHEAD=${OVERHEAD:-1}
PEER=${PEER:-}
OUT_DIR=${SPANLLM_GPU_OUT:-results/gpu_run}
mkdir -p "$OUT_DIR"
LOG="$OUT_DIR/run.log"
: >"$LOG"
T0=$(date +%s)
log() { echo "=== +$(( $(date +%s) - T0 ))s $*" | tee -a "$LOG"; }
rc=0

# --- wheels: fastapi, starlette, pydantic(-core), uvicorn, quicktok, ... (the GPU image lacks them) -------------
INSTALL_WHEELS=${INSTALL_WHEELS:-auto}
if [ "$INSTALL_WHEELS" = auto ]; then
  python3 -c 'import fastapi, uvicorn, pydantic, quicktok' 2>/dev/null && INSTALL_WHEELS=0 || INSTALL_WHEELS=1
fi
if [ "$INSTALL_WHEELS" = 1 ]; then
  log "installing .whl/*.whl into /tmp/site"
  timeout 120 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >>"$LOG" 2>&1 || { log "wheel install failed"; exit 1; }
  export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
python3 - >>"$LOG" 2>&1 <<'EOF' || { log "imports failed (see run.log)"; tail -5 "$LOG"; exit 1; }
import sys, importlib
mods = ["fastapi", "starlette", "pydantic", "pydantic_core", "uvicorn", "prometheus_client", "aiohttp", "quicktok",
        "matplotlib", "torch"]
print("python", sys.version.split()[0], {m: getattr(importlib.import_module(m), "__version__", "?") for m in mods})
import torch
print("cuda", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
EOF
tail -2 "$LOG"
[ -f "$SAMPLES" ] || { log "no samples file $SAMPLES"; exit 1; }
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv >>"$LOG" 2>&1

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

SERVER_PID=""
start_server() {  # $1 = port; the rest: extra flags
  local port=$1; shift
  log "spanllm serve --model $MODEL --dtype $DTYPE --port $port $ENGINE_FLAGS ${SERVE_FLAGS:-} $*"
  python3 -m spanllm.cli serve --model "$MODEL" --dtype "$DTYPE" --port "$port" $ENGINE_FLAGS ${SERVE_FLAGS:-} "$@" \
    >>"$OUT_DIR/serve.log" 2>&1 &
  SERVER_PID=$!
  local deadline=$(( $(date +%s) + ${SERVER_START_TIMEOUT:-300} ))
  while :; do
    if python3 -c "import urllib.request,sys; sys.exit(urllib.request.urlopen('http://127.0.0.1:$port/health', timeout=2).status != 200)" 2>/dev/null; then
      log "server up (pid $SERVER_PID)"; tail -3 "$OUT_DIR/serve.log"; return 0
    fi
    if ! kill -0 "$SERVER_PID" 2>/dev/null; then log "server exited before /health answered"; tail -20 "$OUT_DIR/serve.log"; return 1; fi
    if [ "$(date +%s)" -ge "$deadline" ]; then log "server not healthy after ${SERVER_START_TIMEOUT:-300} s"; tail -20 "$OUT_DIR/serve.log"; return 1; fi
    sleep 2
  done
}
stop_server() {  # SIGTERM, bounded wait, then SIGKILL
  [ -n "$SERVER_PID" ] || return 0
  kill -0 "$SERVER_PID" 2>/dev/null || { SERVER_PID=""; return 0; }
  log "stopping server (SIGTERM pid $SERVER_PID)"
  kill -TERM "$SERVER_PID" 2>/dev/null
  local i=0
  while kill -0 "$SERVER_PID" 2>/dev/null && [ $i -lt $(( ${STOP_TIMEOUT:-60} * 2 )) ]; do sleep 0.5; i=$((i + 1)); done
  if kill -0 "$SERVER_PID" 2>/dev/null; then
    log "server still alive after ${STOP_TIMEOUT:-60} s: SIGKILL"; kill -KILL "$SERVER_PID" 2>/dev/null
  fi
  wait "$SERVER_PID" 2>/dev/null; log "server exit status $?"
  SERVER_PID=""
}
trap 'stop_server' EXIT
trap 'stop_server; exit 130' INT TERM

bench_serve() {  # $1 = port, $2 = rates, $3 = num prompts, $4 = result file name, $5 = timeout s, rest: extra flags
  local port=$1 rates=$2 n=$3 name=$4 limit=$5; shift 5
  log "bench serve rates $rates, $n prompts from $SAMPLES -> $OUT_DIR/$name"
  timeout "$limit" python3 -m spanllm.cli bench serve --base-url "http://127.0.0.1:$port" --tokenizer "$MODEL" \
    --samples-file "$SAMPLES" --num-prompts "$n" --request-rate "$rates" --ignore-eos --temperature 1.0 --top-p 1.0 \
    --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,90,99 --goodput tpot:50 --request-timeout 300 \
    --result-dir "$OUT_DIR" --result-filename "$name" --disable-tqdm \
    --metadata "model=$MODEL" "engine_flags=$ENGINE_FLAGS" "dtype=$DTYPE" "$@" 2>&1 | tee -a "$LOG"
  local s=${PIPESTATUS[0]}
  [ "$s" = 0 ] || log "bench serve exit status $s (124 = cut at ${limit} s; finished rates are in $name)"
  return "$s"
}

# --- 1. spanllm serve + the sweep -----------------------------------------------------------------------------------
PORT=$(free_port)
SWEEP="serve_sweep_${MODEL}.json"
if start_server "$PORT"; then
  bench_serve "$PORT" "$RATES" "$NUM_PROMPTS" "$SWEEP" "${SWEEP_TIMEOUT:-360}" "server=spanllm" || rc=1
  if [ -n "$LOW_RATES" ]; then
    bench_serve "$PORT" "$LOW_RATES" "$LOW_NUM_PROMPTS" "serve_sweep_low_${MODEL}.json" "${LOW_TIMEOUT:-200}" \
      "server=spanllm" || rc=1
  fi
  metrics_text=$(python3 -c "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:$PORT/metrics', timeout=5).read().decode())" 2>/dev/null \
    | grep -E '^spanllm:(num_preemptions|prompt_tokens|generation_tokens|request_success)' | head -8)
  [ -n "$metrics_text" ] && { echo "$metrics_text" | tee -a "$LOG"; }
else
  rc=1
fi
stop_server

# --- 2. server overhead: the same requests offline (bench throughput), same engine flags -----------------------------
TPUT="throughput_${MODEL}.json"
if [ "$OVERHEAD" = 1 ]; then
  log "bench throughput --model $MODEL --samples-file $SAMPLES $ENGINE_FLAGS (offline, torchrun 1 rank)"
  timeout "${THROUGHPUT_TIMEOUT:-180}" python3 -m torch.distributed.run --standalone --nproc-per-node 1 -m spanllm.cli \
    bench throughput --model "$MODEL" --dtype "$DTYPE" --samples-file "$SAMPLES" $ENGINE_FLAGS \
    --json "$OUT_DIR/$TPUT" 2>&1 | tee -a "$LOG"
  s=${PIPESTATUS[0]}; [ "$s" = 0 ] || { log "bench throughput exit status $s"; rc=1; }
  python3 - "$OUT_DIR/$SWEEP" "$OUT_DIR/$TPUT" "$OUT_DIR/overhead_${MODEL}.json" 2>&1 <<'EOF' | tee -a "$LOG"
import json, sys
sweep_path, tput_path, out_path = sys.argv[1:]
try:
    rows = json.load(open(sweep_path))["rows"]
    off = json.load(open(tput_path))
except (OSError, ValueError, KeyError) as e:
    sys.exit(f"overhead: missing input ({e})")
inf = [r for r in rows if r["request_rate"] == "inf"]
if not inf:
    sys.exit("overhead: the sweep has no rate-inf run")
h = inf[-1]
doc = {"http_rate_inf": {k: h.get(k) for k in ("completed", "failed", "num_prompts", "duration", "total_output_tokens",
                                                "output_throughput", "request_throughput", "median_tpot_ms",
                                                "median_ttft_ms", "median_itl_ms")},
       "offline": {k: off.get(k) for k in ("num_requests", "elapsed_time", "total_output_tokens",
                                            "output_tokens_per_second", "requests_per_second", "median_itl_ms",
                                            "mean_tpot_ms", "median_ttft_ms")}}
doc["output_tok_s_ratio_http_over_offline"] = h["output_throughput"] / off["output_tokens_per_second"]
doc["req_s_ratio_http_over_offline"] = h["request_throughput"] / off["requests_per_second"]
doc["same_requests"] = (h["completed"] == off["num_requests"] and h["total_output_tokens"] == off["total_output_tokens"])
json.dump(doc, open(out_path, "w"), indent=1)
print(f"server overhead: HTTP rate inf {h['output_throughput']:.1f} output tok/s ({h['request_throughput']:.2f} req/s, "
      f"{h['completed']} ok / {h['failed']} failed) vs offline {off['output_tokens_per_second']:.1f} output tok/s "
      f"({off['requests_per_second']:.2f} req/s): ratio {doc['output_tok_s_ratio_http_over_offline']:.3f}"
      + ("" if doc["same_requests"] else "  [WARNING: not the same requests/tokens: compare with care]"))
print(f"wrote {out_path}")
EOF
fi

# --- 3. optional peer: transformers serve ------------------------------------------------------------------------
if [ -n "$PEER" ]; then
  log "PEER=$PEER: not run. transformers serve loads a model folder by name (a random Llama 3.1 8B checkpoint is"
  log "  16 GB to write) and a Hugging Face tokenizer (the Llama 3 tokenizer.json is not on the GPU machine); at the"
  log "  ~4.5 req/s its continuous batching reached offline, 1000 prompts take > 200 s a rate: it needs its own call."
  log "  Its serving extra's wheels (openai 3.57 and deps) are in .whl/peer/ (not installed by this script)."
fi

log "done rc=$rc; files in $OUT_DIR:"; ls -la "$OUT_DIR" | tee -a "$LOG"
exit $rc
