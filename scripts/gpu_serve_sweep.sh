#!/usr/bin/env bash
# Issue 14, GPU part, in one call: `spanllm serve` (random weights, TP=1) driven by a `spanllm bench serve`
# request-rate sweep on saved ShareGPT requests, then the server overhead (the same requests offline through
# `bench throughput` vs the HTTP run at rate inf, same engine flags). Optional peer, PEER=hf: Hugging Face
# `transformers serve --continuous-batching` on a random checkpoint of the same shape (scripts/make_hf_checkpoint.py,
# its tokenizer checked byte-exact against spanllm's on $SAMPLES), driven by the same client on the same requests
# as spanllm serve, and the ratio of output tokens/s per rate.
#
# GPU machine (carry .whl; the wheels go to /tmp/site):
#   SPANLLM_GPU_OUT=/tmp/serve bash scripts/gpu_serve_sweep.sh     # all files also in $OUT/serve_results.tgz
# CPU dry run (tiny preset, byte tokenizer):
#   spanllm bench throughput --model tiny --dataset-name random --input-len 16 --output-len 8 --num-prompts 50 \
#       --save-samples /tmp/s.json --dry-run
#   MODEL=tiny DTYPE=float32 SAMPLES=/tmp/s.json RATES=inf,50 NUM_PROMPTS=50 bash scripts/gpu_serve_sweep.sh
# The peer alone (section 1 cut to one short run). Timed on one H200 (results/h200/engine_speed/call7_final/serve):
# checkpoint 18 s (15 GiB), transformers serve up in 18 s, its 100 requests at rate 4 in 121 s (0.83 req/s), at
# rate inf in 113 s (call9_serve): PEER_TIMEOUT must allow ~130 s per 100 requests and rate.
#   RATES=inf NUM_PROMPTS=200 OVERHEAD=0 PEER=hf SPANLLM_GPU_OUT=/tmp/serve bash scripts/gpu_serve_sweep.sh
# Its CPU dry run (spanllm: tiny; the peer: a 2-layer, 256-wide checkpoint with the Llama 3 vocabulary; needs
# accelerate, and psutil for continuous batching on CPU): the tiny line above plus
#   PEER=hf PEER_NUM_PROMPTS=5 PEER_CKPT=/tmp/hf_small PEER_CKPT_FLAGS="--model llama3.1-8b --layers 2 --hidden 256
#   --dtype fp32 --device cpu" PEER_SERVE_FLAGS="--device cpu --cb-num-blocks 256 --cb-max-batch-tokens 1024"
#
# Knobs (env): MODEL (llama3.1-8b), DTYPE (auto), SAMPLES (results/h200/inputs/sharegpt_llama3_seed0_n1000.json),
# RATES (16,24,32,48,inf), NUM_PROMPTS (1000), ENGINE_FLAGS (--min-admit 32: the same for serve and the offline
# run), LOW_RATES / LOW_NUM_PROMPTS (an extra sweep at low rates with fewer prompts; off by default),
# OVERHEAD (1: run the offline bench throughput), INSTALL_WHEELS (auto: only when fastapi/uvicorn/quicktok do not
# import), SPANLLM_GPU_OUT (results/gpu_run), timeouts SERVER_START_TIMEOUT (300), SWEEP_TIMEOUT (360),
# LOW_TIMEOUT (200), THROUGHPUT_TIMEOUT (180), STOP_TIMEOUT (60), SERVE_FLAGS (extra flags for spanllm serve only,
# e.g. --no-frontend-process: the HTTP front end in the engine's process, a thread; default
# --no-enable-prefix-caching: every rate re-sends the same prompts to one server, so with caching on each rate after
# the first is served from the cache the first filled -- results/h100/fp8_serve/ ran so, at 96% hits).
# Peer knobs (PEER=hf): PEER_RATES (4,inf), PEER_NUM_PROMPTS (200: the first of $SAMPLES), PEER_CKPT (/tmp/hf_ckpt,
# rebuilt each run), PEER_CKPT_FLAGS (--model $MODEL --dtype bf16 --device cuda), PEER_SERVE_FLAGS (--device cuda:0;
# any transformers serve flag, e.g. --cb-max-batch-tokens N), timeouts PEER_BUILD_TIMEOUT (300), PEER_START_TIMEOUT
# (300), PEER_WARMUP_TIMEOUT (300), PEER_TIMEOUT (360, the peer's sweep), PEER_SPANLLM_TIMEOUT (240, spanllm's).
# The peer's serving extras (openai and deps, .whl/peer/) are installed into /tmp/site when they do not import.
#
# Files written (at most 8 without the peer, the device tool's usual limit on what comes back; PEER=hf adds 4, so
# 10, or 12 with the low sweep): run.log, serve.log, serve_sweep_<model>.json/.png (written after each rate, so a
# sweep cut short keeps its finished rates), [serve_sweep_low_<model>.json/.png], throughput_<model>.json, overhead_<model>.json;
# PEER=hf: peer_serve.log, serve_sweep_hf_<model>.json, serve_sweep_spanllm_n<PEER_NUM_PROMPTS>_<model>.json (no
# PNGs), peer_ratio_<model>.json (per rate both servers' throughputs, TTFT, TPOT, the spanllm/hf ratios).
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

# The device tool brings back only a few files from $OUT: when it is set, everything under OUT_DIR is also packed
# into $OUT/serve_results.tgz after each section (give SPANLLM_GPU_OUT a folder outside $OUT, e.g. /tmp/serve, so that
# the archive is the one file to come back).
pack() { [ -n "${OUT:-}" ] && tar -czf "$OUT/serve_results.tgz" -C "$OUT_DIR" . 2>/dev/null; return 0; }
case "$OUT_DIR/" in "${OUT:-/nonexistent}"/*) log "note: SPANLLM_GPU_OUT=$OUT_DIR is under \$OUT: files past the device tool's count stay behind (serve_results.tgz has them all)";; esac

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

SERVER_PID=""
start_server() {  # $1 = port; the rest: extra flags
  local port=$1; shift
  log "spanllm serve --model $MODEL --dtype $DTYPE --port $port $ENGINE_FLAGS ${SERVE_FLAGS---no-enable-prefix-caching} $*"
  python3 -m spanllm.cli serve --model "$MODEL" --dtype "$DTYPE" --port "$port" $ENGINE_FLAGS \
    ${SERVE_FLAGS---no-enable-prefix-caching} "$@" \
    >>"$OUT_DIR/serve.log" 2>&1 &
  SERVER_PID=$!
  wait_healthy "$port" server "$OUT_DIR/serve.log" "${SERVER_START_TIMEOUT:-300}" || return 1
  log "server up (pid $SERVER_PID)"; tail -3 "$OUT_DIR/serve.log"
}
wait_healthy() {  # $1 = port, $2 = what, $3 = its log, $4 = timeout s: until /health answers 200 from $SERVER_PID
  local port=$1 what=$2 logf=$3 deadline=$(( $(date +%s) + $4 ))
  until python3 -c "import urllib.request,sys; sys.exit(urllib.request.urlopen('http://127.0.0.1:$port/health', timeout=2).status != 200)" 2>/dev/null; do
    if ! kill -0 "$SERVER_PID" 2>/dev/null; then log "$what exited before /health answered"; tail -20 "$logf"; return 1; fi
    if [ "$(date +%s)" -ge "$deadline" ]; then log "$what not healthy after $4 s"; tail -20 "$logf"; return 1; fi
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
trap 'stop_server; pack' EXIT
trap 'stop_server; exit 130' INT TERM

bench_serve() {  # $1 = port, $2 = rates, $3 = num prompts, $4 = result file name, $5 = timeout s, rest: extra flags
  local port=$1 rates=$2 n=$3 name=$4 limit=$5; shift 5
  rm -f "$OUT_DIR/$name"  # a run cut before it writes must not leave an older run's file to be read as this one
  log "bench serve rates $rates, $n prompts from $SAMPLES -> $OUT_DIR/$name"
  timeout "$limit" python3 -m spanllm.cli bench serve --base-url "http://127.0.0.1:$port" --tokenizer "$MODEL" \
    --samples-file "$SAMPLES" --num-prompts "$n" --request-rate "$rates" --ignore-eos --temperature 1.0 --top-p 1.0 \
    --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,90,99 --goodput tpot:50 --request-timeout 300 \
    --result-dir "$OUT_DIR" --result-filename "$name" --disable-tqdm --save-result \
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
pack

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
    doc = json.load(open(sweep_path))
    rows = doc.get("rows", [doc])  # a sweep, or one rate's result (--save-result)
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
pack

# --- 3. optional peer (PEER=hf): transformers serve and spanllm serve on the same requests and rates ---------------
# transformers serve has no random-weight mode: scripts/make_hf_checkpoint.py writes the preset's shape (random
# weights) and a tokenizer.json built from quicktok (checked byte-exact against spanllm's on $SAMPLES). The peer's
# client run has no --ignore-eos (transformers serve answers 422 to fields it does not know); the checkpoint has no
# eos, so both servers generate each request's output_len (the ratio file checks the token totals).
if [ "$PEER" = hf ]; then
  PEER_RATES=${PEER_RATES:-4,inf}
  PEER_NUM_PROMPTS=${PEER_NUM_PROMPTS:-200}
  PEER_CKPT=${PEER_CKPT:-/tmp/hf_ckpt}
  PEER_CKPT_FLAGS=${PEER_CKPT_FLAGS:---model $MODEL --dtype bf16 --device cuda}
  PEER_SERVE_FLAGS=${PEER_SERVE_FLAGS:---device cuda:0}
  HF_SWEEP="serve_sweep_hf_${MODEL}.json"
  SP_SWEEP="serve_sweep_spanllm_n${PEER_NUM_PROMPTS}_${MODEL}.json"
  export HF_HUB_OFFLINE=1 HF_HUB_DISABLE_UPDATE_CHECK=1  # no hub, no update check: the machine is offline
  peer_ok=1
  if ! python3 -c 'from transformers.utils.import_utils import is_serve_available as a; assert a()' 2>/dev/null; then
    log "installing .whl/peer/*.whl (openai and its deps: transformers serve needs them) into /tmp/site"
    timeout 120 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      .whl/peer/*.whl >>"$LOG" 2>&1 || { log "peer wheel install failed"; peer_ok=0; }
    case ":$PYTHONPATH:" in *:/tmp/site:*) ;; *) export PYTHONPATH=$PYTHONPATH:/tmp/site ;; esac
  fi
  python3 -c 'import transformers; from transformers.utils.import_utils import is_serve_available as a
assert a(), "transformers: is_serve_available() is False (fastapi, uvicorn, pydantic or openai missing)"
print("transformers", transformers.__version__, "with its serving extras")' >>"$LOG" 2>&1 \
    || { log "transformers serve cannot run here (see run.log)"; peer_ok=0; }
  tail -1 "$LOG"
  # `transformers serve` is transformers.cli.serve.Serve under typer; the CLI module also imports `transformers chat`,
  # which needs `requests`: where that import fails, run the same Serve class (same flags) through typer directly.
  if python3 -c 'import transformers.cli.transformers' 2>/dev/null; then
    PEER_CMD=(python3 -m transformers.cli.transformers serve)
    PEER_HOW="transformers serve (python3 -m transformers.cli.transformers serve)"
  else
    PEER_CMD=(python3 -c 'import typer; from transformers.cli.serve import Serve
app = typer.Typer(add_completion=False); app.command()(Serve); app()')
    PEER_HOW="transformers.cli.serve.Serve through typer (the transformers CLI module does not import here: no requests)"
  fi

  # (a) the checkpoint first (fails fast; the GPU is free again when it exits): 16 GB for the 8B
  if [ "$peer_ok" = 1 ]; then
    log "make_hf_checkpoint.py $PEER_CKPT_FLAGS --out $PEER_CKPT --check-samples $SAMPLES"
    if [ -d "$PEER_CKPT" ] && [ ! -f "$PEER_CKPT/spanllm_checkpoint.json" ] && [ -n "$(ls -A "$PEER_CKPT")" ]; then
      log "PEER_CKPT=$PEER_CKPT holds files make_hf_checkpoint.py did not finish (no spanllm_checkpoint.json): remove it"
      peer_ok=0
    fi
  fi
  if [ "$peer_ok" = 1 ]; then
    rm -rf "$PEER_CKPT"
    timeout "${PEER_BUILD_TIMEOUT:-300}" python3 scripts/make_hf_checkpoint.py $PEER_CKPT_FLAGS --out "$PEER_CKPT" \
      --check-samples "$SAMPLES" 2>&1 | grep -v 'Writing model shards' | tee -a "$LOG"
    s=${PIPESTATUS[0]}; [ "$s" = 0 ] || { log "make_hf_checkpoint.py exit status $s (124 = cut at ${PEER_BUILD_TIMEOUT:-300} s)"; peer_ok=0; rc=1; }
  fi

  # (b) spanllm on the peer's requests and rates (the first $PEER_NUM_PROMPTS of $SAMPLES), ignore_eos as in section 1
  PORT=$(free_port)
  if [ "$peer_ok" = 1 ] && start_server "$PORT"; then
    bench_serve "$PORT" "$PEER_RATES" "$PEER_NUM_PROMPTS" "$SP_SWEEP" "${PEER_SPANLLM_TIMEOUT:-240}" "server=spanllm" \
      || rc=1
  else
    rc=1
  fi
  stop_server
  pack
  rm -f "$OUT_DIR/${SP_SWEEP%.json}.png"  # the numbers are in the JSON and the ratio file: fewer files to bring back

  # (c) transformers serve --continuous-batching, one warm-up request (model in memory, CB manager made), the sweep
  if [ "$peer_ok" = 1 ]; then
    PORT=$(free_port)
    log "peer: $PEER_HOW $PEER_CKPT --continuous-batching --host 127.0.0.1 --port $PORT $PEER_SERVE_FLAGS"
    "${PEER_CMD[@]}" "$PEER_CKPT" --continuous-batching --host 127.0.0.1 --port "$PORT" $PEER_SERVE_FLAGS \
      >>"$OUT_DIR/peer_serve.log" 2>&1 &
    SERVER_PID=$!  # stop_server and the EXIT trap stop it like spanllm's
    wait_healthy "$PORT" peer "$OUT_DIR/peer_serve.log" "${PEER_START_TIMEOUT:-300}" || peer_ok=0
  fi
  if [ "$peer_ok" = 1 ]; then
    log "peer up (pid $SERVER_PID); warm-up request (the CB manager is made on the first request, with its sampling)"
    python3 - "$PORT" "$PEER_CKPT" "${PEER_WARMUP_TIMEOUT:-300}" 2>&1 <<'EOF' | tee -a "$LOG"
import json, sys, time, urllib.request
port, model, limit = sys.argv[1], sys.argv[2], float(sys.argv[3])
body = {"model": model, "prompt": "Hello", "max_tokens": 8, "temperature": 1.0, "top_p": 1.0}
req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(),
                             {"Content-Type": "application/json"})
t0 = time.perf_counter()
try:
    out = json.load(urllib.request.urlopen(req, timeout=limit))
except Exception as e:  # noqa: BLE001 - report any failure, the sweep is skipped
    sys.exit(f"peer warm-up failed after {time.perf_counter() - t0:.1f} s: {type(e).__name__}: {e}")
print(f"peer warm-up: {out['usage']} in {time.perf_counter() - t0:.1f} s")
EOF
    [ "${PIPESTATUS[0]}" = 0 ] || peer_ok=0
  fi
  if [ "$peer_ok" = 1 ]; then
    rm -f "$OUT_DIR/$HF_SWEEP"
    log "bench serve (peer, no --ignore-eos) rates $PEER_RATES, $PEER_NUM_PROMPTS prompts -> $OUT_DIR/$HF_SWEEP"
    timeout "${PEER_TIMEOUT:-360}" python3 -m spanllm.cli bench serve --base-url "http://127.0.0.1:$PORT" --model "$PEER_CKPT" \
      --tokenizer "$MODEL" --samples-file "$SAMPLES" --num-prompts "$PEER_NUM_PROMPTS" --request-rate "$PEER_RATES" \
      --temperature 1.0 --top-p 1.0 --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,90,99 \
      --goodput tpot:50 --request-timeout 300 --result-dir "$OUT_DIR" --result-filename "$HF_SWEEP" --disable-tqdm --save-result \
      --metadata "model=$MODEL" "server=transformers serve --continuous-batching" "checkpoint=$PEER_CKPT" 2>&1 | tee -a "$LOG"
    s=${PIPESTATUS[0]}; [ "$s" = 0 ] || { log "peer bench serve exit status $s (124 = cut at ${PEER_TIMEOUT:-360} s)"; rc=1; }
    rm -f "$OUT_DIR/${HF_SWEEP%.json}.png"
  else
    rc=1
  fi
  stop_server
  pack

  # (d) the ratio, per rate (from whatever rates both sweeps finished)
  python3 - "$OUT_DIR/$SP_SWEEP" "$OUT_DIR/$HF_SWEEP" "$PEER_CKPT/spanllm_checkpoint.json" "$SAMPLES" \
    "$PEER_NUM_PROMPTS" "$OUT_DIR/peer_ratio_${MODEL}.json" "$PEER_HOW" 2>&1 <<'EOF' | tee -a "$LOG"
import json, sys
sp_path, hf_path, note_path, samples_path, n, out_path, how = sys.argv[1:]
def rows(path):
    try:
        doc = json.load(open(path))
        return {f"{float(r['request_rate']):g}": r for r in doc.get("rows", [doc])}  # a sweep, or one rate's result
    except (OSError, ValueError, KeyError) as e:
        print(f"peer ratio: no rows from {path} ({type(e).__name__}: {e})")
        return {}
sp, hf = rows(sp_path), rows(hf_path)
try:
    note = json.load(open(note_path))
except (OSError, ValueError) as e:
    note = {"error": f"{note_path}: {e}"}
reqs = json.load(open(samples_path))["requests"][: int(n)]
want_out = sum(r["output_len"] for r in reqs)
keys = ("completed", "failed", "total_input_tokens", "total_output_tokens", "output_throughput", "request_throughput",
        "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms")
per_rate = {}
for rate in [r for r in hf if r in sp]:
    a, b = sp[rate], hf[rate]
    per_rate[rate] = {"spanllm": {k: a.get(k) for k in keys}, "hf": {k: b.get(k) for k in keys},
                      "output_throughput_ratio_spanllm_over_hf": a["output_throughput"] / b["output_throughput"]
                      if b.get("output_throughput") else None,
                      "request_throughput_ratio_spanllm_over_hf": a["request_throughput"] / b["request_throughput"]
                      if b.get("request_throughput") else None,
                      "requested_output_tokens": want_out,
                      "all_output_lengths_met": {s: r["completed"] == len(reqs) and r["total_output_tokens"] == want_out
                                                 for s, r in (("spanllm", a), ("hf", b))},
                      "same_prompt_tokens": a["total_input_tokens"] == b["total_input_tokens"]}
    print(f"peer rate {rate}: spanllm {a['output_throughput']:.1f} out tok/s ({a['completed']} ok / {a['failed']} failed), "
          f"transformers serve {b['output_throughput']:.1f} ({b['completed']} ok / {b['failed']} failed): spanllm/hf "
          f"{per_rate[rate]['output_throughput_ratio_spanllm_over_hf'] or float('nan'):.2f}x")
doc = {"peer": how, "transformers": note.get("transformers"), "checkpoint": note, "samples_file": samples_path,
       "num_prompts": len(reqs), "per_rate": per_rate, "rates_missing": sorted(set(sp) ^ set(hf)),
       "output_token_count": "the usage chunk on both sides: transformers 5.17's /v1/completions stream ends with a "
                             "chunk holding usage (completion_tokens = the tokens generated) whatever stream_options "
                             "says; all_output_lengths_met checks the totals against the requested output lengths",
       "sampling": "temperature 1.0, top_p 1.0 sent; top_k off (spanllm: not sent; hf: generation_config top_k 0); "
                   "spanllm with ignore_eos, hf without eos (none in its config)"}
json.dump(doc, open(out_path, "w"), indent=1)
print(f"wrote {out_path}")
EOF
elif [ -n "$PEER" ]; then
  log "PEER=$PEER: unknown peer (PEER=hf runs transformers serve)"; rc=1
fi

log "done rc=$rc; files in $OUT_DIR:"; ls -la "$OUT_DIR" | tee -a "$LOG"
pack
exit $rc
