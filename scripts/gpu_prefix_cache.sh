#!/usr/bin/env bash
# Issue 29 (automatic prefix caching), GPU part: one H200, the llama3.1-8b preset (random weights), caching on vs off.
#   1. generated-shared-prefix with SGLang's defaults (64 groups x 16 questions, 2,048-token system prompt, 128-token
#      question, 256 output tokens), offline (`bench throughput`): output tok/s and the hit rate, on vs off;
#   2. the same workload (GSP_SERVE_FLAGS: 16 groups by default, to fit the time) through `spanllm serve` at a request
#      rate above what caching off sustains (1.25 x the offline off run's requests/s unless SERVE_RATE is given):
#      median and p99 TTFT, on vs off, and the server's hit rate from /metrics;
#      With SHARED_PREFIX_ABLATION=1 (default) also caching on with --shared-prefix-attention off (what the
#      shared-prefix decode attention adds), and with PREFIX_POLICY=1 (default) caching on with
#      --scheduling-policy prefix (each system prompt's requests admitted together), and with KV8=1 (default 0)
#      caching on with --kv-cache-dtype fp8 (the shared prefixes' decode attention reads half the bytes);
#   3. multi-turn ShareGPT (`bench multi-turn`, the 48 conversations of results/h200/inputs/
#      sharegpt_multiturn_seed0_c48_t6.json): TTFT per turn number, on vs off (same servers as 2);
#   4. the committed 1000-request ShareGPT sample (almost no shared prefix) offline: output tok/s on vs off.
# Steps 2-3 need fastapi/uvicorn/pydantic: installed from .whl/*.whl into /tmp/site when they do not import (as
# scripts/gpu_serve_sweep.sh); without them the server steps are skipped with a message, the rest runs.
#
#   bash scripts/gpu_prefix_cache.sh results/h200/prefix_cache
#
# Writes into the results folder: run.log, env.json (machine, versions, settings), gsp_offline_{on,off}.json,
# sharegpt_offline_{on,off}.json, gsp_serve_{on,off}.json, multi_turn_{on,off}.json, serve_{on,off}.log and
# summary.json (the numbers the issue asks for, the ratios, and every step's status). When $OUT is set (the device
# tool) and the folder is not under it, everything is also packed into $OUT/prefix_cache_results.tgz after each step.
# Every step runs under `timeout`; the whole run stays inside BUDGET_S (540) of wall time: a step that would not fit
# in what is left is skipped and says so. Expected: ~40 s setup, GSP off ~100 s and on ~60 s, ShareGPT 2 x ~45 s,
# each server ~20 s to start plus ~30 s (GSP) and ~40 s (multi-turn).
# CPU dry run (tiny preset, byte tokenizer; minutes):
#   MODEL=tiny DTYPE=float32 GSP_FLAGS="--gsp-num-groups 2 --gsp-prompts-per-group 4 --gsp-system-prompt-len 64
#   --gsp-question-len 8 --gsp-output-len 4" GSP_SERVE_FLAGS="--gsp-num-groups 2 --gsp-prompts-per-group 4
#   --gsp-system-prompt-len 64 --gsp-question-len 8 --gsp-output-len 4" SHAREGPT_NUM_PROMPTS=8 SHAREGPT_OUTPUT_LEN=4
#   MT_FLAGS="--num-conversations 2 --max-turns 2 --output-len 4" ENGINE_FLAGS="--num-kv-blocks 256" LAUNCH=python3
#   bash scripts/gpu_prefix_cache.sh /tmp/pc_dry
#
# Knobs (env): MODEL (llama3.1-8b), DTYPE (auto), ENGINE_FLAGS (none: the same for every engine), GSP_FLAGS (none:
# SGLang's defaults), GSP_SERVE_FLAGS (--gsp-num-groups 16), SERVE_RATE (auto), SHAREGPT_SAMPLES
# (results/h200/inputs/sharegpt_llama3_seed0_n1000.json), SHAREGPT_NUM_PROMPTS (all of it), SHAREGPT_OUTPUT_LEN
# (unset: the sample's), MT_CONVERSATIONS (results/h200/inputs/sharegpt_multiturn_seed0_c48_t6.json), MT_FLAGS
# (--num-conversations 48 --max-turns 6 --max-output-len 128 --request-rate 4 --max-active-conversations 16),
# SHARED_PREFIX_ABLATION (1), PREFIX_POLICY (1), KV8 (0), SKIP_SERVE (0: 1 skips steps 2-3), SKIP_OFFLINE (0: 1 skips
# steps 1 and 4; give SERVE_RATE then, e.g. from an earlier run's gsp_offline_off.json), SKIP_GSP_OFF (0: 1 runs only
# the caching-on variants of step 1, e.g. on a GPU whose pool cannot hold the off run), SKIP_SHAREGPT (0: 1 skips 4), BUDGET_S (540), LAUNCH (torchrun --standalone --nproc-per-node 1), INSTALL_WHEELS (auto), per-step timeouts
# SAMPLE_TIMEOUT (120), GSP_OFF_TIMEOUT (200), GSP_ON_TIMEOUT (150), SHAREGPT_TIMEOUT (100), SERVER_START_TIMEOUT
# (150), SERVE_TIMEOUT (150), MT_TIMEOUT (150).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1

OUT_DIR=${1:?usage: bash scripts/gpu_prefix_cache.sh RESULTS_DIR}
MODEL=${MODEL:-llama3.1-8b}
DTYPE=${DTYPE:-auto}
ENGINE_FLAGS=${ENGINE_FLAGS:-}
GSP_FLAGS=${GSP_FLAGS:-}
GSP_SERVE_FLAGS=${GSP_SERVE_FLAGS:---gsp-num-groups 16}
SERVE_RATE=${SERVE_RATE:-}
SHAREGPT_SAMPLES=${SHAREGPT_SAMPLES:-results/h200/inputs/sharegpt_llama3_seed0_n1000.json}
SHAREGPT_NUM_PROMPTS=${SHAREGPT_NUM_PROMPTS:-}
SHAREGPT_OUTPUT_LEN=${SHAREGPT_OUTPUT_LEN:-}
MT_CONVERSATIONS=${MT_CONVERSATIONS:-results/h200/inputs/sharegpt_multiturn_seed0_c48_t6.json}
MT_FLAGS=${MT_FLAGS:---num-conversations 48 --max-turns 6 --max-output-len 128 --request-rate 4 --max-active-conversations 16}
BUDGET_S=${BUDGET_S:-540}
LAUNCH=${LAUNCH:-torchrun --standalone --nproc-per-node 1}
WORK=$(mktemp -d /tmp/prefix_cache.XXXXXX)  # the GSP samples (~10 MB) stay out of the results
mkdir -p "$OUT_DIR"
LOG="$OUT_DIR/run.log"
: >"$LOG"
T0=$(date +%s)
log() { echo "=== +$(( $(date +%s) - T0 ))s $*" | tee -a "$LOG"; }
pack() { [ -n "${OUT:-}" ] && tar -czf "$OUT/prefix_cache_results.tgz" -C "$OUT_DIR" . 2>/dev/null; return 0; }
STATUS="$WORK/status.txt"
: >"$STATUS"
status() { echo "$1=$2" >>"$STATUS"; log "$1: $2"; pack; }
# run_step NAME TIMEOUT CMD...: under `timeout`, never past the budget; records ok / failed (rc) / skipped
run_step() {
  local name=$1 limit=$2; shift 2
  local left=$(( BUDGET_S - ($(date +%s) - T0) ))
  if [ "$left" -lt 20 ]; then status "$name" "skipped: ${left}s of the ${BUDGET_S}s budget left"; return 1; fi
  [ "$left" -lt "$limit" ] && limit=$left
  log "$name (timeout ${limit}s): $*"
  timeout "$limit" "$@" >>"$LOG" 2>&1
  local rc=$?
  if [ $rc -eq 0 ]; then status "$name" ok; else status "$name" "failed (rc $rc$([ $rc -eq 124 ] && echo ', timed out'))"; fi
  return $rc
}

# --- wheels (the GPU image lacks fastapi, uvicorn, pydantic, quicktok) -------------------------------------------
INSTALL_WHEELS=${INSTALL_WHEELS:-auto}
if [ "$INSTALL_WHEELS" = auto ]; then
  python3 -c 'import fastapi, uvicorn, pydantic, quicktok' 2>/dev/null && INSTALL_WHEELS=0 || INSTALL_WHEELS=1
fi
if [ "$INSTALL_WHEELS" = 1 ] && ls .whl/*.whl >/dev/null 2>&1; then
  log "installing .whl/*.whl into /tmp/site"
  timeout 120 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl >>"$LOG" 2>&1 || log "wheel install failed (see run.log)"
  export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
SERVE_OK=1
python3 -c 'import fastapi, uvicorn, pydantic' 2>>"$LOG" || {
  SERVE_OK=0
  log "fastapi/uvicorn/pydantic do not import (no .whl/ wheels?): the server steps (2, 3) are SKIPPED"
}
python3 - "$OUT_DIR/env.json" "$MODEL" "$DTYPE" "$ENGINE_FLAGS" "$GSP_FLAGS" "$GSP_SERVE_FLAGS" "$MT_FLAGS" \
  "$BUDGET_S" >>"$LOG" 2>&1 <<'EOF' || { log "environment check failed (see run.log)"; exit 1; }
import json, subprocess, sys
from spanllm.measure.report import machine_info, versions
import torch
path, model, dtype, engine, gsp, gsp_serve, mt, budget = sys.argv[1:]
try:
    rev = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10).stdout.strip()
except Exception:
    rev = ""
env = {"machine": machine_info(), "versions": versions(), "git": rev or "unknown",
       "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
       "settings": {"model": model, "dtype": dtype, "engine_flags": engine, "gsp_flags": gsp or "SGLang defaults",
                    "gsp_serve_flags": gsp_serve, "multi_turn_flags": mt, "budget_s": int(budget)}}
json.dump(env, open(path, "w"), indent=1, default=str)
print(json.dumps(env, default=str)[:600])
EOF
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv >>"$LOG" 2>&1

# --- 1. generated-shared-prefix offline, on vs off (the same saved requests) --------------------------------------
if [ "${SKIP_OFFLINE:-0}" = 1 ]; then
  status offline "skipped: SKIP_OFFLINE=1"
else
run_step gsp_samples "${SAMPLE_TIMEOUT:-120}" python3 -m spanllm.cli bench throughput --model "$MODEL" \
  --dataset-name generated-shared-prefix $GSP_FLAGS --save-samples "$WORK/gsp.json" --dry-run
fi
if [ -f "$WORK/gsp.json" ]; then
  if [ "${SKIP_GSP_OFF:-0}" = 1 ]; then
    status gsp_offline_off "skipped: SKIP_GSP_OFF=1"
  else
    run_step gsp_offline_off "${GSP_OFF_TIMEOUT:-200}" $LAUNCH -m spanllm.cli bench throughput --model "$MODEL" \
      --dtype "$DTYPE" $ENGINE_FLAGS --no-enable-prefix-caching --samples-file "$WORK/gsp.json" \
      --json "$OUT_DIR/gsp_offline_off.json"
  fi
  run_step gsp_offline_on "${GSP_ON_TIMEOUT:-150}" $LAUNCH -m spanllm.cli bench throughput --model "$MODEL" \
    --dtype "$DTYPE" $ENGINE_FLAGS --enable-prefix-caching --samples-file "$WORK/gsp.json" \
    --json "$OUT_DIR/gsp_offline_on.json"
  if [ "${SHARED_PREFIX_ABLATION:-1}" = 1 ]; then  # caching on, each decode reading its whole context
    run_step gsp_offline_on_no_shared_prefix "${GSP_ON_TIMEOUT:-150}" $LAUNCH -m spanllm.cli bench throughput \
      --model "$MODEL" --dtype "$DTYPE" $ENGINE_FLAGS --enable-prefix-caching --shared-prefix-attention off \
      --samples-file "$WORK/gsp.json" --json "$OUT_DIR/gsp_offline_on_no_shared_prefix.json"
  fi
  if [ "${KV8:-0}" = 1 ]; then  # caching on, an FP8 KV cache
    run_step gsp_offline_on_kv8 "${GSP_ON_TIMEOUT:-150}" $LAUNCH -m spanllm.cli bench throughput \
      --model "$MODEL" --dtype "$DTYPE" $ENGINE_FLAGS --enable-prefix-caching --kv-cache-dtype fp8 \
      --samples-file "$WORK/gsp.json" --json "$OUT_DIR/gsp_offline_on_kv8.json"
  fi
  if [ "${PREFIX_POLICY:-1}" = 1 ]; then  # caching on, requests of one system prompt admitted together
    run_step gsp_offline_on_prefix_policy "${GSP_ON_TIMEOUT:-150}" $LAUNCH -m spanllm.cli bench throughput \
      --model "$MODEL" --dtype "$DTYPE" $ENGINE_FLAGS --enable-prefix-caching --scheduling-policy prefix \
      --samples-file "$WORK/gsp.json" --json "$OUT_DIR/gsp_offline_on_prefix_policy.json"
  fi
fi

# --- 4. the committed ShareGPT sample offline, on vs off ----------------------------------------------------------
SG_SAMPLES=$SHAREGPT_SAMPLES
if [ -n "$SHAREGPT_NUM_PROMPTS$SHAREGPT_OUTPUT_LEN" ]; then  # a cut sample (dry runs): its first requests, shorter
  SG_SAMPLES=$WORK/sharegpt_cut.json
  python3 - "$SHAREGPT_SAMPLES" "$SG_SAMPLES" "${SHAREGPT_NUM_PROMPTS:-0}" "${SHAREGPT_OUTPUT_LEN:-0}" <<'EOF2'
import json, sys
src, dst, n, out_len = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
d = json.load(open(src))
d["requests"] = d["requests"][: n or None]
for r in d["requests"]:
    r["output_len"] = out_len or r["output_len"]
d["info"] = {**d["info"], "cut_to": len(d["requests"]), "output_len_override": out_len or None}
json.dump(d, open(dst, "w"))
EOF2
fi
for mode in on off; do
  [ "${SKIP_OFFLINE:-0}" = 1 ] || [ "${SKIP_SHAREGPT:-0}" = 1 ] && break
  run_step "sharegpt_offline_$mode" "${SHAREGPT_TIMEOUT:-100}" $LAUNCH -m spanllm.cli bench throughput --model "$MODEL" \
    --dtype "$DTYPE" $ENGINE_FLAGS --$([ $mode = off ] && echo no-)enable-prefix-caching --samples-file "$SG_SAMPLES" \
    --json "$OUT_DIR/sharegpt_offline_$mode.json"
done

# --- 2 + 3. spanllm serve, on then off: GSP at a saturating rate, then multi-turn ShareGPT ------------------------
if [ -z "$SERVE_RATE" ]; then
  SERVE_RATE=$(python3 -c "
import json, sys
try:
    r = json.load(open('$OUT_DIR/gsp_offline_off.json'))['requests_per_second']
except Exception:
    sys.exit(1)
print(round(1.25 * r, 2))" 2>/dev/null) || SERVE_RATE=16
fi
log "serve request rate for generated-shared-prefix: $SERVE_RATE req/s"
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
SERVER_PID=""
stop_server() {
  [ -n "$SERVER_PID" ] || return 0
  kill -TERM "$SERVER_PID" 2>/dev/null
  for _ in $(seq 30); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 1; done
  kill -KILL "$SERVER_PID" 2>/dev/null
  wait "$SERVER_PID" 2>/dev/null
  SERVER_PID=""
}
trap stop_server EXIT
wait_healthy() {  # $1 port, $2 timeout s
  local deadline=$(( $(date +%s) + $2 ))
  until python3 -c "import urllib.request,sys; sys.exit(urllib.request.urlopen('http://127.0.0.1:$1/health', timeout=2).status != 200)" 2>/dev/null; do
    kill -0 "$SERVER_PID" 2>/dev/null || return 1
    [ "$(date +%s)" -ge "$deadline" ] && return 1
    sleep 2
  done
}
if [ "${SKIP_SERVE:-0}" = 1 ]; then
  status serve "skipped: SKIP_SERVE=1"
elif [ "$SERVE_OK" = 1 ]; then
  for mode in on off; do
    left=$(( BUDGET_S - ($(date +%s) - T0) ))
    if [ "$left" -lt 60 ]; then status "serve_$mode" "skipped: ${left}s of the ${BUDGET_S}s budget left"; continue; fi
    port=$(free_port)
    flag=--$([ $mode = off ] && echo no-)enable-prefix-caching
    log "spanllm serve --model $MODEL --dtype $DTYPE --port $port $ENGINE_FLAGS $flag"
    python3 -m spanllm.cli serve --model "$MODEL" --dtype "$DTYPE" --port "$port" $ENGINE_FLAGS $flag \
      >"$OUT_DIR/serve_$mode.log" 2>&1 &
    SERVER_PID=$!
    start_limit=${SERVER_START_TIMEOUT:-150}; [ "$left" -lt "$start_limit" ] && start_limit=$left
    if ! wait_healthy "$port" "$start_limit"; then
      status "serve_$mode" "server did not become healthy in ${start_limit}s (serve_$mode.log)"; tail -5 "$OUT_DIR/serve_$mode.log"
      stop_server; continue
    fi
    status "serve_$mode" "up after $(( $(date +%s) - T0 ))s"
    run_step "gsp_serve_$mode" "${SERVE_TIMEOUT:-150}" python3 -m spanllm.cli bench serve --base-url "http://127.0.0.1:$port" \
      --tokenizer "$MODEL" --dataset-name generated-shared-prefix $GSP_SERVE_FLAGS --request-rate "$SERVE_RATE" \
      --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,90,99 --save-result --result-dir "$OUT_DIR" \
      --result-filename "gsp_serve_$mode.json" --disable-tqdm --metadata prefix_caching=$mode
    run_step "multi_turn_$mode" "${MT_TIMEOUT:-150}" python3 -m spanllm.cli bench multi-turn --base-url "http://127.0.0.1:$port" \
      --tokenizer "$MODEL" --dataset-path "$MT_CONVERSATIONS" $MT_FLAGS --json "$OUT_DIR/multi_turn_$mode.json"
    stop_server
  done
else
  status serve "skipped: fastapi/uvicorn/pydantic do not import (carry their wheels in .whl/)"
fi

# --- summary -----------------------------------------------------------------------------------------------------
python3 - "$OUT_DIR" "$STATUS" >>"$LOG" 2>&1 <<'EOF'
import json, os, sys
out, status_file = sys.argv[1:]
def load(name):
    p = os.path.join(out, name)
    return json.load(open(p)) if os.path.exists(p) else None
def ratio(a, b):
    return a / b if a is not None and b else None
s = {"status": dict(l.strip().split("=", 1) for l in open(status_file) if "=" in l)}
for variant in ("no_shared_prefix", "prefix_policy", "kv8"):
    r = load(f"gsp_offline_on_{variant}.json")
    s[f"gsp_offline_on_{variant}"] = r and {"output_tok_s": r["output_tokens_per_second"],
                                            "hit_rate": r["prefix_cache"]["hit_rate"]}
for name in ("gsp_offline", "sharegpt_offline"):
    on, off = load(f"{name}_on.json"), load(f"{name}_off.json")
    tok = lambda r: r and r["output_tokens_per_second"]
    s[name] = {"output_tok_s_on": tok(on), "output_tok_s_off": tok(off), "on_over_off": ratio(tok(on), tok(off)),
               "hit_rate_on": on and on["prefix_cache"]["hit_rate"], "hit_rate_off": off and off["prefix_cache"]["hit_rate"],
               "requests": (on or off or {}).get("num_requests")}
on, off = load("gsp_serve_on.json"), load("gsp_serve_off.json")
g = lambda r, k: r and r.get(k)
s["gsp_serve"] = {"request_rate": g(on or off, "request_rate"), "requests": g(on or off, "num_prompts"),
                  "median_ttft_ms_on": g(on, "median_ttft_ms"), "median_ttft_ms_off": g(off, "median_ttft_ms"),
                  "p99_ttft_ms_on": g(on, "p99_ttft_ms"), "p99_ttft_ms_off": g(off, "p99_ttft_ms"),
                  "median_ttft_off_over_on": ratio(g(off, "median_ttft_ms"), g(on, "median_ttft_ms")),
                  "output_throughput_on": g(on, "output_throughput"), "output_throughput_off": g(off, "output_throughput"),
                  "hit_rate_on": g(on, "prefix_cache_hit_rate"), "hit_rate_off": g(off, "prefix_cache_hit_rate")}
on, off = load("multi_turn_on.json"), load("multi_turn_off.json")
turns = {}
for mode, r in (("on", on), ("off", off)):
    for t in (r or {}).get("per_turn", []):
        turns.setdefault(t["turn"], {})[f"median_ttft_ms_{mode}"] = t["median_ttft_ms"]
        turns[t["turn"]][f"mean_prompt_len_{mode}"] = t["mean_prompt_len"]
s["multi_turn"] = {"per_turn": [{"turn": k, **v} for k, v in sorted(turns.items())],
                   "median_ttft_ms_on": g(on, "median_ttft_ms"), "median_ttft_ms_off": g(off, "median_ttft_ms"),
                   "hit_rate_on": g(on, "prefix_cache_hit_rate"), "hit_rate_off": g(off, "prefix_cache_hit_rate")}
json.dump(s, open(os.path.join(out, "summary.json"), "w"), indent=1)
print(json.dumps(s, indent=1))
EOF
log "summary: $OUT_DIR/summary.json"
tail -60 "$LOG" | grep -v '^===' | tail -45
pack
grep -v "SKIP_SERVE=1\|SKIP_OFFLINE=1" "$STATUS" | grep -q "failed\|skipped\|did not" && exit 1
exit 0
