#!/usr/bin/env bash
# Issue 33's measurement as its acceptance states it: the TTFT of long prompts through `spanllm serve`, one request
# at a time on an otherwise idle server (random prompts of LENGTHS tokens, 16 output tokens, NUM each, no warm-up
# request and no bench ready check, which would send the first prompt and fill the cache with its blocks: the first
# request is the first the server ever saw; a seed per request, so no prompt starts with another's tokens and hits
# the prefix cache; a run whose prompts hit the cache is reported INVALID). The server runs the long-prompt settings
# (cuDNN cascade on every chunk, 16,384-token chunks) unless SERVE_FLAGS says otherwise (set and empty: the defaults).
#
#   bash scripts/gpu_long_serve.sh OUTDIR                    # GPU machine (carry .whl: fastapi, uvicorn, quicktok)
#   MODEL=smollm2-135m-instruct SERVE_FLAGS="--max-num-batched-tokens 256" LENGTHS=300,450 NUM=2 \
#     bash scripts/gpu_long_serve.sh OUT   # CPU dry run (~80 s; the tiny preset's byte tokenizer maps every random
#                                         # prompt to the same bytes, so its prompts hit the cache)
#
# Each request is its own `bench serve` call (a seed per request), with the server's /metrics read around it.
# Writes OUTDIR/long_serve_<length>_<rep>.json (`bench serve --save-result --save-detailed`), OUTDIR/
# long_serve_summary.jsonl (per request: the client's TTFT, the server's TTFT and queue time), OUTDIR/serve.log,
# OUTDIR/run.log.
set -u
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${1:?usage: bash scripts/gpu_long_serve.sh OUTDIR}
MODEL=${MODEL:-llama3.1-8b}
LENGTHS=${LENGTHS:-36402,111352}
NUM=${NUM:-3}
SERVE_FLAGS=${SERVE_FLAGS---prefill-attention cudnn-cascade --cascade-min-prefix 0 --max-num-batched-tokens 16384}
START_TIMEOUT=${START_TIMEOUT:-300}
REQUEST_TIMEOUT=${REQUEST_TIMEOUT:-120}
mkdir -p "$OUT"
LOG="$OUT/run.log"
: >"$LOG"
log() { echo "=== $(date +%H:%M:%S) $*" | tee -a "$LOG"; }
if ! python3 -c 'import fastapi, uvicorn, quicktok' 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
  log "installing .whl/*.whl into /tmp/site"
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >>"$LOG" 2>&1
  export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
PORT=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
log "spanllm serve --model $MODEL $SERVE_FLAGS on port $PORT"
# shellcheck disable=SC2086
python3 -m spanllm.cli serve --model "$MODEL" --port "$PORT" $SERVE_FLAGS >"$OUT/serve.log" 2>&1 &
SERVER=$!
stop() { kill -INT "$SERVER" 2>/dev/null; for _ in $(seq 60); do kill -0 "$SERVER" 2>/dev/null || return 0; sleep 1; done
         kill -KILL "$SERVER" 2>/dev/null; return 0; }
trap stop EXIT
# up when /health answers 200 (the engine built, warmed up, the front end listening)
python3 - "$PORT" "$START_TIMEOUT" "$SERVER" <<'EOF' >>"$LOG" 2>&1 || { log "the server did not come up:"; tail -5 "$OUT/serve.log"; exit 1; }
import os, sys, time, urllib.request
port, limit, pid = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
t0 = time.monotonic()
while time.monotonic() - t0 < limit:
    try:
        os.kill(pid, 0)
    except OSError:
        sys.exit(f"the server exited after {time.monotonic() - t0:.1f} s")
    try:
        if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5).status == 200:
            print(f"server up after {time.monotonic() - t0:.1f} s")
            sys.exit(0)
    except OSError:
        time.sleep(1)
sys.exit(1)
EOF
log "server up"
# The server's own view of each request, from /metrics between requests: its TTFT histogram (from the engine's
# arrival stamp, after HTTP parsing and tokenization, to the first token) and queue time (arrival to first scheduled).
metrics() {
  python3 - "$PORT" <<'EOF'
import sys, urllib.request
from prometheus_client.parser import text_string_to_metric_families
text = urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/metrics", timeout=10).read().decode()
want = {"spanllm:time_to_first_token_seconds_sum": "ttft", "spanllm:request_queue_time_seconds_sum": "queue"}
vals = {want[s.name]: s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name in want}
print(vals.get("ttft", 0.0), vals.get("queue", 0.0))
EOF
}
rc=0
n=0
SUMMARY="$OUT/long_serve_summary.jsonl"
: >"$SUMMARY"
for len in ${LENGTHS//,/ }; do
  for rep in $(seq "$NUM"); do
    n=$((n + 1))
    # a seed per request: every prompt is new (no cached block), the first of its length meets new shapes
    seed=$((len * 100 + rep))
    log "request $n: $len tokens (seed $seed), alone on the server"
    rm -f "$OUT/long_serve_${len}_$rep.json"  # a failed call must not leave an earlier run's result here
    read -r ttft0 queue0 < <(metrics)
    # shellcheck disable=SC2086
    timeout $(( START_TIMEOUT + REQUEST_TIMEOUT )) python3 -m spanllm.cli bench serve --port "$PORT" \
      --model "$MODEL" --dataset-name random --random-input-len "$len" --random-output-len 16 \
      --random-range-ratio 0 --num-prompts 1 --seed "$seed" --max-concurrency 1 --request-rate inf --num-warmups 0 \
      --request-timeout "$REQUEST_TIMEOUT" --disable-tqdm \
      --save-result --save-detailed --result-dir "$OUT" --result-filename "long_serve_${len}_$rep.json" \
      --metadata "serve_flags=$SERVE_FLAGS" >>"$LOG" 2>&1 || { log "bench serve failed: request $n"; rc=1; }
    read -r ttft1 queue1 < <(metrics)
    python3 - "$OUT/long_serve_${len}_$rep.json" "$n" "$rep" "$ttft0" "$ttft1" "$queue0" "$queue1" <<'EOF' 2>&1 \
      | tee -a "$LOG"
import json, sys
path, n, rep = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
ttft0, ttft1, queue0, queue1 = map(float, sys.argv[4:8])
try:
    d = json.load(open(path))
except OSError:
    sys.exit(0)
row = {
    "request": n,  # the server's n-th request
    "first_of_its_length": rep == 1,
    "input_len": d["input_lens"][0],
    "ttft_s": d["ttfts"][0],  # the client's: request sent to first token received
    "server_ttft_s": round(ttft1 - ttft0, 4),  # the engine's arrival stamp to its first token
    "server_queue_s": round(queue1 - queue0, 4),  # arrival to first scheduled
    "prefix_cache_hits": d.get("prefix_cache_hits"),
}
with open(sys.argv[1].rsplit("/", 1)[0] + "/long_serve_summary.jsonl", "a") as f:
    f.write(json.dumps(row) + "\n")
print(
    f"request {n}: {row['input_len']} tokens: TTFT {row['ttft_s']:.3f} s (server {row['server_ttft_s']:.3f} s, "
    f"queue {row['server_queue_s']:.3f} s), prefix-cache hits {row['prefix_cache_hits']}"
)
if row["prefix_cache_hits"] is None:  # bench serve found no prefix-cache counters in /metrics
    sys.exit("INVALID: the server reported no prefix-cache hits; the prompt's freshness is unknown")
if row["prefix_cache_hits"]:  # a request reused cached blocks: its TTFT is not a fresh prompt's
    sys.exit("INVALID: the prompt hit the prefix cache; its TTFT is not a fresh prompt's")
EOF
    [ "${PIPESTATUS[0]}" = 0 ] || rc=1
  done
done
exit $rc
